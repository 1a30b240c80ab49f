"""A service task that dies takes its process down (exit code 1 for the supervisor to
restart it), instead of leaving the service running with messages leased forever."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from prefixflow.services.bucketer.service import Bucketer
from prefixflow.shared.process.config import BucketerConfig

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


def test_bucketer_dispatcher_death_ends_the_service(nats_server, monkeypatch):
    async def broken_dispatch(self, stop):
        await asyncio.sleep(0.5)
        raise RuntimeError("dispatcher bug")

    monkeypatch.setattr(Bucketer, "dispatch", broken_dispatch)
    bucketer = Bucketer(BucketerConfig(nats_url=nats_server.url))

    async def go() -> None:
        stop = asyncio.Event()
        await asyncio.wait_for(bucketer.run(stop), 20)

    with pytest.raises(BaseExceptionGroup) as info:
        asyncio.run(go())
    assert info.group_contains(RuntimeError, match="dispatcher bug")


def test_run_service_exits_nonzero_on_an_unexpected_error():
    code = (
        "from prefixflow.shared.process.supervise import run_service\n"
        "async def main(stop):\n"
        "    raise ValueError('boom')\n"
        "run_service(main)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1, proc.stderr



SERVICES = ("ingestor", "bucketer", "router", "sink", "engine-worker")


def test_sigterm_before_nats_answers_stops_every_service_at_once(tmp_path, tiny_model):
    """Services started before their nats-server (a supervisor starting everything at once)
    and stopped before it came up exit 0 within seconds, not after their 120 s connect wait."""
    import os
    import signal
    import time

    from prefixflow.launch.local_cluster import free_port

    env = {**os.environ, "PFX_NATS_URL": f"nats://127.0.0.1:{free_port()}", "PFX_MODEL": str(tiny_model)}  # nothing listens
    procs = {}
    for service in SERVICES:
        extra = ["--engine", "echo", "--replica", "r0"] if service == "engine-worker" else []
        procs[service] = subprocess.Popen([sys.executable, "-m", "prefixflow.cli.main", "serve", service, *extra], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    def catches_sigterm(pid: int) -> bool:
        """Its SIGTERM handler is installed (past its imports: on a loaded machine that can
        take far more than the few seconds a quiet one needs)."""
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        return bool(caught & (1 << (signal.SIGTERM - 1)))

    try:
        deadline = time.monotonic() + 120
        for service, proc in procs.items():
            while not catches_sigterm(proc.pid):
                assert proc.poll() is None and time.monotonic() < deadline, (service, proc.poll())
                time.sleep(0.1)
        time.sleep(1)  # inside the connect wait
        for service, proc in procs.items():
            assert proc.poll() is None, (service, proc.stdout.read())
            proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        outs = {service: proc.communicate(timeout=30)[0] for service, proc in procs.items()}
        took = time.monotonic() - sent
    finally:
        for proc in procs.values():
            proc.kill()
    for service, proc in procs.items():
        assert proc.returncode == 0 and "stopped before connecting" in outs[service], (service, outs[service])
    assert took < 10, took
