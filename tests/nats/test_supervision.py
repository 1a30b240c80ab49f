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
