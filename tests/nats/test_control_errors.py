"""One error convention on every control subject (issue 38, item 6): a request the handler
fails on gets a nats.micro error reply (`Nats-Service-Error`, `Nats-Service-Error-Code`)
and the endpoint's error count goes up, seen in the service's stats and in `$SRV.STATS`.
The router's and an engine-worker's micro services run in-process on a real nats-server
(no engine is started: the echo engine's own calls are enough)."""

from __future__ import annotations

import asyncio
import json

import pytest
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER

from prefixflow.services.engine_worker.service import EngineWorker
from prefixflow.services.router.service import Router
from prefixflow.shared.bus import control
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.process.config import EngineWorkerConfig, RouterConfig
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


def errors(service) -> dict[str, int]:
    """Error count per endpoint, from the service's own stats."""
    return {e.name: e.num_errors for e in service.stats().endpoints}


async def raw_error(nc, subject: str, data: bytes) -> tuple[str, str]:
    """(code, description) of the error reply to `data` on `subject` (asserts it is one)."""
    reply = await nc.request(subject, data, timeout=5)
    assert reply.headers and ERROR_HEADER in reply.headers, (subject, reply.headers, reply.data)
    return reply.headers[ERROR_CODE_HEADER], reply.headers[ERROR_HEADER]


async def srv_stats(nc, name: str) -> dict[str, int]:
    """Error count per endpoint as micro's discovery (`$SRV.STATS.<name>`) reports it."""
    stats = json.loads((await nc.request(f"$SRV.STATS.{name}", b"", timeout=5)).data)
    return {e["name"]: e["num_errors"] for e in stats["endpoints"]}


def test_router_endpoints_answer_failures_as_counted_error_replies(nats_server):
    async def scenario() -> None:
        nc = await connect(nats_server.url, "control-errors")
        router = Router(RouterConfig(policy="round-robin"))
        service = await router.serve(nc)
        try:
            # route: a body that does not decode -> 400; the decision raising -> 500
            assert (await raw_error(nc, subjects.ROUTE, b"\xc1"))[0] == "400"

            def broken(req):
                raise RuntimeError("decision failed")

            router.decide = broken
            code, why = await raw_error(nc, subjects.ROUTE, m.encode(m.RouteRequest("b", 1, 2)))
            assert code == "500" and "decision failed" in why
            # policy: an unknown policy, or the raw text of older callers -> 400; the policy stays
            with pytest.raises(control.ControlError) as info:
                await control.set_policy(nc, "fastest")
            assert info.value.code == "400" and "unknown policy 'fastest'" in info.value.description
            assert (await raw_error(nc, subjects.ROUTER_POLICY, b"least-loaded"))[0] == "400"
            assert router.policy.name == "round-robin"
            assert await control.set_policy(nc, "least-loaded") == m.ControlReply(True, "least-loaded")
            # room: no request can be bad (the body is not read); it answers
            assert m.router_room_decoder.decode(await control.request(nc, subjects.ROUTER_ROOM, timeout=5)).live == 0

            assert errors(service) == {"route": 2, "room": 0, "policy": 2}
            assert await srv_stats(nc, "prefixflow-router") == {"route": 2, "room": 0, "policy": 2}
        finally:
            await service.stop()
            await close(nc)

    asyncio.run(scenario())


def test_engine_worker_endpoints_answer_failures_as_counted_error_replies(nats_server):
    async def scenario() -> None:
        nc = await connect(nats_server.url, "control-errors")
        worker = EngineWorker(EngineWorkerConfig(engine="echo", replica="r7"))
        service = await worker.serve(nc)
        try:
            # reset: not ready yet is a state (ok False), not an error
            assert await control.reset_prefix_cache(nc, "r7") == m.ControlReply(False, "not ready")
            worker.ready = True

            async def refuses() -> bool:
                raise RuntimeError("cache reset failed")

            worker.engine.reset_prefix_cache = refuses
            with pytest.raises(control.ControlError) as info:
                await control.reset_prefix_cache(nc, "r7")
            assert info.value.code == "500" and "cache reset failed" in info.value.description
            # scheduling: an unknown mode, or raw text -> 400; the mode stays
            with pytest.raises(control.ControlError, match="unknown scheduling 'lifo'") as info:
                await control.set_scheduling(nc, "r7", "lifo")
            assert info.value.code == "400"
            assert (await raw_error(nc, subjects.engine_scheduling("r7"), b"fcfs"))[0] == "400"
            assert worker.scheduling == "prefix-groups"
            assert await control.set_scheduling(nc, "r7", "fcfs") == m.ControlReply(True, "fcfs")
            # status: the handler failing -> 500
            status, worker.status = worker.status, lambda: 1 / 0
            assert (await raw_error(nc, subjects.engine_status_request("r7"), b""))[0] == "500"
            worker.status = status

            assert errors(service) == {"reset": 1, "scheduling": 2, "status": 1}
            assert await srv_stats(nc, "prefixflow-engine-worker") == {"reset": 1, "scheduling": 2, "status": 1}
        finally:
            await service.stop()
            await close(nc)

    asyncio.run(scenario())
