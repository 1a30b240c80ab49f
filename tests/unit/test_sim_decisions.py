"""The simulator makes the live services' decisions (must-show 3 of the simulator issue).

A small pipeline simulation records every status the router saw and every route request
it answered, with the sim's assignments. The recorded stream is then fed to the
services' own objects, as the services use them:
- each status to `prefixflow.services.router.service.Router.on_status` (as an `EngineStatus`),
- each request to `Router.decide` (as the `RouteRequest` the bucketer sends),
with the router's clock set to the recorded time. Every answer must be the sim's. The
bucketer side: every bucket the sim routed is turned into a request by the service's
own `Bucketer.route_request` too, and must equal the sim's.
"""

from __future__ import annotations

import pytest

from prefixflow.services.bucketer import service as bucketer_service
from prefixflow.services.router import service as router_service
from prefixflow.shared.process.config import BucketerConfig, RouterConfig
from prefixflow.shared.wire import messages as m
from prefixflow.sim.cluster import BucketerSim, Options, simulate
from prefixflow.sim.cost import load_profile
from prefixflow.sim.workload import prefix_repetition

pytestmark = pytest.mark.unit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return self.now


def small_run(policy: str, monkeypatch):
    # Zipf-skewed prefixes: large groups (keyed buckets, splits) and a long tail (pooled
    # batches routed part by part); a KV cache and caps small enough for retry-after.
    # Three LoRA adapters (prompt i under adapter i mod 4, one of them the base model) on
    # engines of two slots: adapter-keyed buckets and the router's adapter candidates.
    wl = prefix_repetition(num_prompts=3000, prefix_len=256, suffix_len=128, num_prefixes=600, output_len=32, seed=3, zipf=1.1)
    wl = wl.with_adapters(4)
    wl.lora = [a if a != "lora3" else "" for a in wl.lora]
    profile = load_profile("l4-8b")
    profile.kv_blocks = 400
    built: list[tuple[m.RouteRequest, m.RouteRequest]] = []
    real = bucketer_service.Bucketer(BucketerConfig(node="node0"))
    original = BucketerSim.route_request

    def both(self, bucket):
        got = original(self, bucket)
        # The same bucket with wire prompts as payload, through the service's own code.
        wire = type(bucket)(
            [type(it)(it.tokens, it.arrived, m.Prompt("j", it.payload, it.tokens, b"", int(wl.output_len[it.payload]),
                                                      lora=it.lora), None, it.weight, it.lora)
             for it in bucket.items],
            bucket.key, bucket.prefix_len, bucket.parts, bucket.pooled,
        )
        tokens = sum(it.payload.work_tokens for it in wire.items)
        built.append((real.route_request(wire, tokens, "b"), got))
        return got

    monkeypatch.setattr(BucketerSim, "route_request", both)
    result = simulate(wl, profile, 6, policy, Options(nodes=2, record=True, include_startup=False, max_loras=2))
    return result, built


@pytest.mark.parametrize("policy", ["prefix-aware", "daft", "round-robin"])
def test_router_service_makes_the_sims_assignments(policy, monkeypatch):
    from prefixflow.sim import cluster

    traces = []
    original_init = cluster.RouterSim.__init__

    def keep(self, sim, name):
        original_init(self, sim, name)
        traces.append(self)

    monkeypatch.setattr(cluster.RouterSim, "__init__", keep)
    result, built = small_run(policy, monkeypatch)
    trace = traces[0].trace
    routes = [e for e in trace if e[0] == "route"]
    assert len(routes) > 30
    assert any(e[7] is None for e in routes)  # retry-after answers are compared too
    # Load in engine cost: the workers measured what an output token costs, and the router
    # charged assignments by it (cached prefixes free: below the work tokens).
    statuses = [e[3] for e in trace if e[0] == "status"]
    assert any(st["decode_cost"] > 0 for st in statuses)
    answers = [(e[3], e[7]) for e in routes if e[7]]
    assert all(sum(c for _, _, c in a) > 0 for _, a in answers)
    if policy == "prefix-aware":
        assert sum(sum(c for _, _, c in a) for _, a in answers) < sum(t for t, _ in answers)
    assert any(e[5] for e in routes)  # pooled batches (route_parts)

    clock = Clock()
    monkeypatch.setattr(router_service, "time", clock)
    router = router_service.Router(RouterConfig(policy=policy))
    answered = 0
    for event in trace:
        clock.now = event[1]
        if event[0] == "status":
            _, _, name, st = event
            router.on_status(m.EngineStatus(
                replica=name, ts=event[1], ready=st["ready"], outstanding_tokens=st["outstanding"],
                done_tokens=st["done_tokens"], kv_blocks=st["kv_blocks"], block_size=st["engine_block_size"],
                window=st["window"], decode_cost=st["decode_cost"], adapters=st["adapters"],
                lora_slots=st["lora_slots"], loras=st["loras"],
            ))
        else:
            _, _, prompts, tokens, key, parts, output, sim_answer, lora = event
            req = m.RouteRequest("node0", prompts, tokens, key, [m.RoutePart(*p) for p in parts], output=output,
                                 lora=lora)
            reply = router.decide(req)
            got = [(a.replica, a.prompts, a.cost) for a in reply.assignments] if reply.assignments else None
            assert got == sim_answer, (answered, req)
            answered += 1
    assert answered == len(routes)
    # The bucketer side: the service builds the same request from the same bucket.
    assert built
    for service_req, (prompts, tokens, key, parts, output, lora) in built:
        assert (service_req.prompts, service_req.tokens, service_req.key, service_req.output, service_req.lora) == (
            prompts, tokens, key, output, lora)
        assert [(p.prompts, p.tokens, p.key, p.output, p.lora) for p in service_req.parts] == parts
    assert result.prompts == 3000


def test_a_route_request_asked_again_gets_its_first_answer(monkeypatch):
    """A bucketer whose route reply was lost asks again with the same bucket id: the same
    replicas, and the work counted once (twice, it would hold the replica at its cap)."""
    router = router_service.Router(RouterConfig(policy="prefix-aware", replica_cap_tokens=2000))
    for name in ("a", "b"):
        router.on_status(m.EngineStatus(replica=name, ts=0.0, ready=True))
    first = router.decide(m.RouteRequest("node0", 4, 600, [1, 2], bucket="x1"))
    again = router.decide(m.RouteRequest("node0", 4, 600, [1, 2], bucket="x1"))
    assert again == first and len(first.assignments) == 1
    assert sum(r.outstanding for r in router.fleet.replicas.values()) == 600
    other = router.decide(m.RouteRequest("node1", 4, 600, [1, 2], bucket="x1"))  # another bucketer's id
    assert sum(r.outstanding for r in router.fleet.replicas.values()) == 1200 and other.assignments
    monkeypatch.setattr(router_service, "ANSWERS_KEPT", 2)  # bounded: the oldest answers go
    router.decide(m.RouteRequest("node0", 1, 1, bucket="x2"))
    assert list(router.answered) == [("node1", "x1"), ("node0", "x2")]
