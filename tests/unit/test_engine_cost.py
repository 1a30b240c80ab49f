"""Load in engine cost: the workers' fit of what tokens cost, the router's charge, and the
charge shared out over prompts and reported done in the same unit."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.services.engine_worker.cost_fit import MAX_RATIO, MIN_RATIO, CostFit
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import make_policy
from prefixflow.shared.wire import messages as m
from tests.tiers import COSTLY

HB = 128  # hash block size of the keys below


def steps(a: float, b: float, n: int, rng: random.Random, noise: float = 0.0):
    """Engine steps of a continuous-batching engine: decode steps of 1-64 sequences, some
    with a prefill chunk beside them; seconds = a x computed + b x generated (+ noise)."""
    for _ in range(n):
        generated = rng.randint(1, 64)
        computed = rng.choice([0, 0, 0, rng.randint(16, 2048)])
        seconds = a * computed + b * generated
        yield seconds * (1 + rng.uniform(-noise, noise)), computed, generated


@settings(COSTLY)
@given(a=st.floats(1e-5, 1e-3), ratio=st.floats(0.5, 50.0), seed=st.integers(0, 10**6))
def test_the_fit_finds_what_an_output_token_costs(a, ratio, seed):
    fit = CostFit()
    rng = random.Random(seed)
    for sample in steps(a, a * ratio, 400, rng, noise=0.05):
        fit.add(*sample)
    assert fit.ratio > 0
    assert abs(fit.ratio - ratio) / ratio < 0.15
    assert abs(fit.prompt_seconds - a) / a < 0.15


def test_the_fit_follows_a_change_of_load_and_ignores_what_it_cannot_separate():
    rng = random.Random(1)
    fit = CostFit(tau=5.0)
    for sample in steps(1e-4, 2e-4, 300, rng):
        fit.add(*sample)
    assert abs(fit.ratio - 2.0) < 0.05
    # Decode-only steps say nothing of the prompt cost: the ratio is kept, not invented.
    for _ in range(200):
        fit.add(64 * 2e-4, 0, 64)
    assert abs(fit.ratio - 2.0) < 0.05
    # The engine now runs where an output token costs 8 prompt tokens (say, longer contexts).
    for sample in steps(1e-4, 8e-4, 600, rng):
        fit.add(*sample)
    assert abs(fit.ratio - 8.0) < 0.4


@given(st.lists(st.tuples(st.floats(0, 10), st.integers(-5, 5000), st.integers(-5, 500)), max_size=80))
def test_the_fit_never_reports_nonsense(samples):
    fit = CostFit(min_steps=1)
    for sample in samples:
        fit.add(*sample)
        assert fit.ratio == 0 or MIN_RATIO <= fit.ratio <= MAX_RATIO


def two_replicas(decode_cost: float = 0.0) -> Fleet:
    fleet = Fleet(cap_tokens=10**9)
    for name in ("a", "b"):
        fleet.observe(name, 0.0, ready=True, outstanding=0, done_tokens=0, kv_blocks=1000, engine_block_size=16,
                      window=64, decode_cost=decode_cost)
    return fleet


def test_a_cached_prefix_is_free_and_an_output_token_costs_what_the_replica_measured():
    fleet = two_replicas(decode_cost=3.0)
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    key = [11, 12]  # a 256-token common prefix
    # 4 prompts of 256 + 64 prompt tokens, 32 output tokens each.
    prompts, output = 4, 4 * 32
    tokens = 4 * 320 + output
    # Nothing cached: the first prompt computes the prefix, the other three only their suffixes.
    assert fleet.charge(a, 4, prompts, tokens, output, key) == 320 + 3 * 64 + 3 * output
    fleet.assign(a, 4, 1, key)  # a now holds the prefix
    assert fleet.charge(a, 4, prompts, tokens, output, key) == 4 * 64 + 3 * output
    assert fleet.charge(b, 4, prompts, tokens, output, key) == 320 + 3 * 64 + 3 * output
    # Half of the bucket: its share of prompt and output tokens.
    assert fleet.charge(a, 2, prompts, tokens, output, key) == 2 * 64 + 3 * output // 2
    # Not told the output (an older bucketer): its share of the work tokens, as before.
    assert fleet.charge(a, 1, prompts, tokens, -1, key) == tokens // 4
    assert fleet.charges([(a, 1), (b, 3)], prompts, tokens, -1, key) == [tokens // 4, tokens - tokens // 4]


def test_the_fleet_decode_cost_stands_in_for_a_replica_that_measured_none():
    fleet = two_replicas()
    assert fleet.decode_cost == 1.0
    fleet.observe("a", 1.0, ready=True, outstanding=0, done_tokens=0, decode_cost=4.0)
    assert fleet.decode_cost == 4.0
    fleet.observe("a", 2.0, ready=True, outstanding=0, done_tokens=0, decode_cost=6.0)  # a new measure replaces a's
    fleet.observe("b", 2.0, ready=True, outstanding=0, done_tokens=0, decode_cost=2.0)
    assert fleet.decode_cost == 4.0
    fleet.observe("b", 3.0, ready=True, outstanding=0, done_tokens=0)  # nothing measured: b's stays
    assert fleet.decode_cost == 4.0
    fleet.observe("b", 4.0, ready=True, outstanding=0, done_tokens=0, decode_cost=4.0)
    fleet.observe("a", 4.0, ready=True, outstanding=0, done_tokens=0, decode_cost=4.0)
    assert fleet.charge(fleet.replicas["b"], 1, 1, 100 + 10, 10, []) == 100 + 4 * 10


def test_the_router_charges_what_it_counts_and_the_replica_reports_it_done_in_that_unit():
    """Route a stream of buckets; share each assignment's cost out over its prompts as the
    bucketer does; the workers report those shares done: every replica's outstanding load
    returns to zero (what is charged is what is taken off), and prefix-aware routing
    charged less than the raw work tokens (cached prefixes free)."""
    rng = random.Random(7)
    fleet = two_replicas(decode_cost=2.0)
    policy = make_policy("prefix-aware")
    routed: dict[str, list[m.Prompt]] = {"a": [], "b": []}
    raw = charged = 0
    for i in range(200):
        group = rng.randrange(6)
        n = rng.randint(1, 12)
        prompts = [m.Prompt("j", 100 * i + k, b"\0\0\0\1" * (2 * HB + rng.randint(1, 100)), max_tokens=rng.randint(1, 64))
                   for k in range(n)]
        tokens, output = sum(p.work_tokens for p in prompts), sum(p.max_tokens for p in prompts)
        chosen = policy.route(fleet, 0.0, n, tokens, [1000 + group, 2000 + group], output)
        assert chosen is not None and len(chosen) == len(policy.last_costs)
        start = 0
        for (r, k), cost in zip(chosen, policy.last_costs):
            m.charge_prompts(prompts[start : start + k], cost)
            assert sum(p.load for p in prompts[start : start + k]) == cost
            routed[r.name] += prompts[start : start + k]
            start += k
        raw += tokens
        charged += sum(policy.last_costs)
    assert sum(r.outstanding for r in fleet.replicas.values()) == charged
    assert charged < raw
    for name, done in routed.items():
        fleet.observe(name, 1.0, ready=True, outstanding=0, done_tokens=sum(p.load for p in done))
        assert fleet.replicas[name].outstanding == 0


@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 512)), min_size=1, max_size=40),
       st.integers(-5, 10**6))
def test_charge_shares_add_up_to_the_charge(prompts, cost):
    batch = [m.Prompt("j", i, b"\0\0\0\1" * t, max_tokens=o) for i, (t, o) in enumerate(prompts)]
    m.charge_prompts(batch, cost)
    if cost <= 0:  # not told: each counts its work tokens
        assert [p.load for p in batch] == [p.work_tokens for p in batch]
        return
    assert all(p.cost >= 1 for p in batch)
    assert sum(p.cost for p in batch) == max(cost, len(batch))
    heavy = max(batch, key=lambda p: p.work_tokens)
    light = min(batch[:-1], key=lambda p: p.work_tokens, default=heavy)
    assert light.cost <= heavy.cost or heavy is batch[-1] or light is batch[-1]
