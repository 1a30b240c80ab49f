"""The real router process writes off work that never reached its replica (the bucketer's
publish failed after routing): without that, the replica stays at its cap for good and
a job stalls with its prompts waiting in the bucketer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import router_process, wait_for_router

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]

CAP = 1000


def test_router_writes_off_work_its_replica_never_got(nats_server, tmp_path: Path):
    log_path = tmp_path / "router.log"
    with router_process(nats_server.url, log_path, PFX_POLICY="prefix-aware", PFX_REPLICA_CAP_TOKENS=str(CAP)):
        waited = asyncio.run(scenario(nats_server.url))
    router_log = log_path.read_text()
    assert '"work routed here never arrived: written off"' in router_log, router_log[-2000:]
    assert '"tokens": 5000' in router_log
    # Written off after ~3 s (`Fleet.settle`) of the replica holding nothing.
    assert 2.5 <= waited <= 15, waited


async def scenario(url: str) -> float:
    """One replica `a`. The first route (5000 tokens, over the cap) is lost on its way;
    `a` keeps reporting that it holds nothing. Returns the seconds until the router
    routes to `a` again."""
    nc = await connect(url, "write-off-test")
    stop = asyncio.Event()

    async def statuses() -> None:
        while not stop.is_set():
            await nc.publish(subjects.status("a"), m.encode(m.EngineStatus("a", time.time(), ready=True)))
            await asyncio.sleep(0.2)

    async def route() -> m.RouteReply:
        req = m.RouteRequest("node0", 10, 5000, [7, 8])
        return m.route_reply_decoder.decode((await nc.request(subjects.ROUTE, m.encode(req), timeout=5)).data)

    beat = asyncio.create_task(statuses())
    try:
        await wait_for_router(nc)
        await asyncio.sleep(0.5)  # a few statuses: `a` is live
        first = await route()
        assert [x.replica for x in first.assignments] == ["a"]
        lost_at = time.monotonic()
        capped = await route()
        assert not capped.assignments and capped.retry_after > 0, "the lost work holds a at its cap"
        while time.monotonic() - lost_at < 20:
            reply = await route()
            if reply.assignments:
                assert [x.replica for x in reply.assignments] == ["a"]
                return time.monotonic() - lost_at
            await asyncio.sleep(0.2)
        raise AssertionError("the router never wrote the lost work off")
    finally:
        stop.set()
        await beat
        await close(nc)
