"""prefixflow.services.router.hot and its use by the prefix-aware policy: a prefix group whose recent
work exceeds a replica's fair share is spread over as many replicas as it needs (a stable,
rendezvous-chosen set); every other group stays on one replica."""

from __future__ import annotations

import collections
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.router.hot import WARM_TOKENS, HotPrefixes, rendezvous
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import PrefixAware

pytestmark = pytest.mark.unit

NOW = 100.0


@given(st.lists(st.text("abcdefgh0123456789-", min_size=1, max_size=8), min_size=2, max_size=40, unique=True),
       st.integers(0, 10**6), st.integers(1, 39))
def test_rendezvous_sets_are_stable_nested_and_move_only_what_leaves(names, group, k):
    k = min(k, len(names) - 1)
    items = [(n, n) for n in names]
    top = rendezvous(group, items, k)
    assert len(top) == k and len(set(top)) == k
    assert rendezvous(group, list(reversed(items)), k) == top, "the order the replicas come in does not matter"
    assert rendezvous(group, items, k + 1)[:k] == top, "a growing group keeps its replicas"
    outsider = next(n for n in names if n not in top)
    assert rendezvous(group, [i for i in items if i[0] != outsider], k) == top, "another replica leaving moves nothing"


def test_a_group_needs_replicas_in_proportion_to_its_share_of_the_recent_work():
    hot = HotPrefixes()
    live = 10
    per_round = WARM_TOKENS * live // 50
    for step in range(100):  # group A: 30 % of the work, the rest spread over many small groups
        now = step * 0.1
        hot.add("A", 0.3 * per_round, now)
        for g in range(35):
            hot.add(("cold", g), 0.7 * per_round / 35, now)
    assert hot.replicas_needed("A", 0, live, 10.0) == 3
    assert hot.replicas_needed(("cold", 0), 0, live, 10.0) == 1
    assert hot.replicas_needed("A", 0, 1, 10.0) == 1, "one replica: nothing to spread over"
    # Work is remembered for about HOT_TAU seconds: long after, A is no longer hot.
    for g in range(50):
        hot.add(("later", g), per_round * 20 / 50, 500.0)
    assert hot.replicas_needed("A", 0, live, 500.0) == 1


def test_the_first_buckets_of_a_job_are_never_spread():
    hot = HotPrefixes()
    assert hot.replicas_needed("A", 4096, 8, NOW) == 1, "its only group, but too little work seen to tell"


def fleet(n: int) -> Fleet:
    f = Fleet(cap_tokens=10**12)
    for i in range(n):
        f.observe(f"r{i}", NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=0)
    return f


def route_skewed(policy: PrefixAware, f: Fleet, buckets: int = 3000, seed: int = 1) -> tuple[dict, float]:
    """Buckets of 16 prompts x 512 tokens, half of them of one hot group, the rest of 64
    cold groups, one per step; each replica works off 1.25 / 8 of a bucket per step (the
    fleet is 80 % busy) and reports what it holds. Which replicas each group's buckets
    went to, and the most work any replica held at once."""
    rng = random.Random(seed)
    went: dict = collections.defaultdict(collections.Counter)
    held = dict.fromkeys(f.replicas, 0.0)
    worst = 0.0
    tokens = 16 * 512
    for i in range(buckets):
        now = NOW + i * 0.01
        for name in held:
            held[name] = max(0.0, held[name] - 1.25 * tokens / len(held))
            # A KV cache far larger than the job's prefixes: the history forgets nothing.
            f.observe(name, now, ready=True, outstanding=int(held[name]), done_tokens=0, kv_blocks=1 << 20)
        g = 0 if rng.random() < 0.5 else 1 + rng.randrange(64)
        group = "hot" if g == 0 else f"cold{g}"
        out = policy.route(f, now, 16, tokens, [1000 + g, 7])
        assert out is not None and sum(n for _, n in out) == 16
        for r, n in out:
            went[group][r.name] += n
            held[r.name] += tokens * n / 16
        worst = max(worst, *held.values())
    return went, worst


def test_a_hot_group_is_spread_over_the_replicas_its_work_needs_and_cold_ones_stay_affine():
    went, worst = route_skewed(PrefixAware(split_factor=float("inf")), fleet(8))
    # Half of the work is one group: at one replica's fair share (1/8) it needs 4 replicas.
    hot = went["hot"]
    assert len(hot) >= 4, hot
    assert max(hot.values()) <= 0.4 * sum(hot.values()), "no single replica takes the hot group"
    cold = [g for g in went if g != "hot"]
    affine = sum(1 for g in cold if len(went[g]) == 1)
    assert affine >= 0.9 * len(cold), {g: dict(went[g]) for g in cold if len(went[g]) > 1}
    assert worst <= 40 * 16 * 512, "no replica falls behind"


def test_without_spreading_the_hot_group_piles_onto_one_replica():
    went, worst = route_skewed(PrefixAware(split_factor=float("inf"), hot_factor=0), fleet(8))
    hot = went["hot"]
    assert max(hot.values()) >= 0.9 * sum(hot.values()), hot
    assert worst >= 500 * 16 * 512, "that replica falls further and further behind"
