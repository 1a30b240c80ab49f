"""The simulator makes the live services' decisions (must-show 3 of the simulator issue).

Both drive one decision core each (`services/bucketer/release.Release`,
`services/router/decision.Decider`); what is checked here is that the drivers feed them
alike. A small pipeline simulation records every status the router saw and every route
request it answered, with its replies. The recorded stream is then fed to the router
service itself, as its subscriptions and endpoint do: each status to
`prefixflow.services.router.service.Router.on_status`, each request to `Router.decide`,
with the router's clock set to the recorded time. Every answer must be the sim's. The
bucketer side: every bucket the sim routed is rebuilt with the wire prompts the service
would hold (`Bucketer.take`'s items), and the request the release core builds from it
must equal the sim's.
"""

from __future__ import annotations

import pytest

from prefixflow.services.bucketer.release import Release
from prefixflow.services.router import decision
from prefixflow.services.router import service as router_service
from prefixflow.shared.process.config import RouterConfig
from prefixflow.shared.wire import messages as m
from prefixflow.sim import services as sim_services
from prefixflow.sim.cluster import Options, simulate
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
    original = Release.route_request

    def both(node, bucket, bucket_id=""):
        got = original(node, bucket, bucket_id)
        # The same bucket with wire prompts as payload, its items as `Bucketer.take` makes them.
        prompts = [m.Prompt("j", it.payload, it.tokens, b"", int(wl.output_len[it.payload]), lora=it.lora)
                   for it in bucket.items]
        wire = type(bucket)(
            [type(it)(p.tokens, it.arrived, p, None, p.work_tokens, p.lora, p.max_tokens)
             for it, p in zip(bucket.items, prompts)],
            bucket.key, bucket.prefix_len, bucket.parts, bucket.pooled,
        )
        built.append((original(node, wire, bucket_id), got))
        return got

    monkeypatch.setattr(Release, "route_request", staticmethod(both))
    traces = []
    init = sim_services.RouterSim.__init__

    def keep(self, sim, name):
        init(self, sim, name)
        traces.append(self)

    monkeypatch.setattr(sim_services.RouterSim, "__init__", keep)
    result = simulate(wl, profile, 6, policy, Options(nodes=2, record=True, include_startup=False, max_loras=2))
    return result, built, traces[0].trace


@pytest.mark.parametrize("policy", ["prefix-aware", "daft", "round-robin"])
def test_router_service_makes_the_sims_assignments(policy, monkeypatch):
    result, built, trace = small_run(policy, monkeypatch)
    routes = [e for e in trace if e[0] == "route"]
    assert len(routes) > 30
    assert any(not e[3].assignments for e in routes)  # retry-after answers are compared too
    # Load in engine cost: the workers measured what an output token costs, and the router
    # charged assignments by it (cached prefixes free: below the work tokens).
    statuses = [e[2] for e in trace if e[0] == "status"]
    assert any(st.decode_cost > 0 for st in statuses)
    answers = [(e[2].tokens, e[3].assignments) for e in routes if e[3].assignments]
    assert all(sum(a.cost for a in got) > 0 for _, got in answers)
    if policy == "prefix-aware":
        assert sum(sum(a.cost for a in got) for _, got in answers) < sum(t for t, _ in answers)
    assert any(e[2].parts for e in routes)  # pooled batches (route_parts)

    clock = Clock()
    monkeypatch.setattr(router_service, "time", clock)
    router = router_service.Router(RouterConfig(policy=policy))
    answered = 0
    for event in trace:
        clock.now = event[1]
        if event[0] == "status":
            router.on_status(event[2])
        else:
            _, _, req, sim_reply = event
            # Through the wire, as the bucketer sends it and the router answers it.
            reply = router.decide(m.route_request_decoder.decode(m.encode(req)))
            assert m.encode(reply) == m.encode(sim_reply), (answered, req)
            answered += 1
    assert answered == len(routes)
    # The bucketer side: the release core builds the same request from the service's items.
    assert len(built) >= len({id(e[2]) for e in routes}) > 30
    for service_req, sim_req in built:
        assert service_req == sim_req
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
    monkeypatch.setattr(decision, "ANSWERS_KEPT", 2)  # bounded: the oldest answers go
    router.decide(m.RouteRequest("node0", 1, 1, bucket="x2"))
    assert list(router.answered) == [("node1", "x1"), ("node0", "x2")]
