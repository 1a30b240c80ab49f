"""The real router process answers a recorded simulation stream as the simulator did.

A small pipeline simulation records every engine status the router saw and every route
request with the simulator's answer. A real nats-server and a real `prefixflow serve
router` process then get the same statuses on `pfx.status.<replica>` and the same
requests on `pfx.route`, in the same order; every reply must be the simulator's
assignment (or retry-after where the simulator was refused). The unit test
`tests/unit/test_sim_decisions.py` does the same in process, with the recorded clock.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.sim.cluster import Options, Sim
from prefixflow.sim.cost import load_profile
from prefixflow.sim.workload import prefix_repetition
from tests.conftest import router_process, wait_for_router

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

STATUS_SETTLE = 0.01
"""Seconds for the router's status callbacks to run before the next route request (they
run in another task than the route endpoint)."""


def record(policy: str) -> list:
    wl = prefix_repetition(num_prompts=1500, prefix_len=256, suffix_len=128, num_prefixes=300, output_len=32, seed=5, zipf=1.1)
    wl = wl.with_adapters(3)  # LoRA adapters on engines of two slots: the adapter fields cross the wire too
    profile = load_profile("l4-8b")
    profile.kv_blocks = 400
    sim = Sim(wl, profile, 4, policy, Options(nodes=2, record=True, include_startup=False, max_loras=2))
    sim.run()
    return sim.router.trace


@pytest.mark.parametrize("policy", ["prefix-aware", "daft"])
def test_router_process_replays_the_sims_decisions(nats_server, tmp_path: Path, policy: str):
    trace = record(policy)
    routes = [e for e in trace if e[0] == "route"]
    assert len(routes) > 20
    kept = [e for e in routes if any(not a.replica for a in e[3].assignments)]
    if policy == "prefix-aware":  # buckets past the replicas' room: some prompts handed back (bounded lead)
        assert kept, "no decision kept prompts back: the replay would not check the router's deferral"
    else:
        assert not kept, "the reference places whole buckets"
    with router_process(nats_server.url, tmp_path / "router.log", PFX_POLICY=policy):
        mismatches = asyncio.run(replay(nats_server.url, trace))
    assert mismatches == [], mismatches[:5]


async def replay(url: str, trace: list) -> list:
    nc = await connect(url, "sim-replay")
    try:
        await wait_for_router(nc)
        mismatches = []
        pending_status = False
        for event in trace:
            if event[0] == "status":
                _, _, status = event  # the EngineStatus the simulated worker sent
                await nc.publish(subjects.status(status.replica), m.encode(status))
                pending_status = True
                continue
            _, _, req, answer = event  # the RouteRequest the simulated bucketer sent, the sim's reply
            if pending_status:
                await nc.flush()
                await asyncio.sleep(STATUS_SETTLE)
                pending_status = False
            reply = m.route_reply_decoder.decode((await nc.request(subjects.ROUTE, m.encode(req), timeout=5)).data)
            if reply.assignments != answer.assignments:  # (a retry-after's delay goes by the real clock)
                mismatches.append((req.prompts, reply.assignments, answer.assignments))
        return mismatches
    finally:
        await close(nc)
