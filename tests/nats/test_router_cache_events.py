"""The real router process scores replicas by the KV-cache changes they send on
`pfx.cache.<replica>` (`CacheEvents`), over a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.messages import CacheOp
from tests.conftest import router_process, wait_for_router

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]

K = [101, 102, 103]


def test_router_follows_the_replicas_cache_events(nats_server, tmp_path: Path):
    with router_process(nats_server.url, tmp_path / "router.log", PFX_POLICY="prefix-aware"):
        got = asyncio.run(scenario(nats_server.url))
    assert got == ["a", "b", "a"], (tmp_path / "router.log").read_text()[-2000:]


async def scenario(url: str) -> list[str]:
    nc = await connect(url, "cache-events-test")
    done = {"a": 0, "b": 0}

    async def status() -> None:
        for name in ("a", "b"):  # every routed token done: equal loads before each decision
            await nc.publish(subjects.status(name), m.encode(m.EngineStatus(name, 0.0, ready=True, done_tokens=done[name])))
        await nc.flush()
        await asyncio.sleep(0.1)

    async def cache(name: str, seq: int, *ops) -> None:
        await nc.publish(subjects.cache_events(name), m.encode(m.CacheEvents(name, "e1", seq, list(ops))))

    async def route() -> str:
        req = m.RouteRequest("node0", 1, 100, K)
        reply = m.route_reply_decoder.decode((await nc.request(subjects.ROUTE, m.encode(req), timeout=5)).data)
        [a] = reply.assignments
        done[a.replica] += 100
        return a.replica

    try:
        await wait_for_router(nc)
        got = []
        await status()
        got.append(await route())  # nothing known: the first name; history now says a
        await cache("a", 0, (CacheOp.STORED, K), (CacheOp.REMOVED, K))  # a ran it and evicted it
        await cache("b", 0, (CacheOp.STORED, K[:1]))  # b holds its first block
        await status()
        got.append(await route())  # by the cache, not a's history
        await cache("b", 1, (CacheOp.CLEARED, []))
        await cache("a", 1, (CacheOp.STORED, K))
        await status()
        got.append(await route())
        return got
    finally:
        await close(nc)
