"""A nats-server whose JetStream storage is smaller than the streams' size limits add up
to (as on a machine with little free disk: the server's default is 75 % of it) refuses
the streams: the services' provisioning fails with an error that names the refusal and
what to do, not an empty `ServerError()` after 30 s of retries (seen when a test
machine's disk filled up: every honcho cluster start timed out with nothing said)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.provision import provision
from tests.conftest import VENV_BIN, free_port

pytestmark = pytest.mark.nats


def test_too_little_jetstream_storage_is_named(tmp_path):
    port = free_port()
    conf = tmp_path / "nats.conf"
    conf.write_text(f'listen: "127.0.0.1:{port}"\njetstream {{\n  store_dir: "{tmp_path / "js"}"\n  max_file_store: 2GB\n}}\n')
    proc = subprocess.Popen([str(VENV_BIN / "nats-server"), "-c", str(conf)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        async def go() -> str:
            nc = await connect(f"nats://127.0.0.1:{port}", "provision-test", wait=20)
            try:
                with pytest.raises(RuntimeError) as err:
                    await provision(nc.jetstream(), replicas=1, create=True, attempts=3)
                return str(err.value)
            finally:
                await close(nc)

        t0 = time.monotonic()
        message = asyncio.run(go())
        assert "JetStream refused the streams" in message, message
        assert "insufficient storage resources" in message and "JetStream error 10047" in message, message
        assert "free disk" in message, message
        assert time.monotonic() - t0 < 20
    finally:
        proc.terminate()
        proc.wait(10)
