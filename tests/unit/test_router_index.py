"""prefixflow.services.router.prefix_index.PrefixIndex and the cost work behind it: the indexed match
equals a scan of the history, and prefix-aware decisions equal the scanning, sorting
implementation they replaced; plus `prefixflow bench router` and the router's wiring of
the engine block size."""

from __future__ import annotations

import json
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.bench.router import bench_router
from prefixflow.services.router.fleet import MIN_HISTORY, Fleet
from prefixflow.services.router.assignments import extend_merged
from prefixflow.services.router.policies import PrefixAware
from prefixflow.shared.prefix.block_keys import matched_blocks
from prefixflow.shared.wire import messages as m
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit

NOW = 100.0


# --- brute-force references: the code the index replaced ----------------------------------


def brute_best_match(r, key) -> tuple[int, int]:
    """(matched blocks, routing clock) of r's best history entry: a scan of every entry."""
    best = (0, 0)
    for past, stamp in r.history:
        blocks = matched_blocks(key, past)
        if blocks and (blocks, stamp) > best:
            best = (blocks, stamp)
    return best


def ref_live(fleet, now):
    return sorted((r for r in fleet.replicas.values() if r.ready and now - r.last_seen < fleet.dead_after), key=lambda r: r.name)


def ref_open(fleet, now):
    return [r for r in ref_live(fleet, now) if r.outstanding < fleet.cap(r)]


class ScanningPrefixAware(PrefixAware):
    """The prefix-aware policy as it was: a history scan per replica inside a sort key,
    full sorts of the fleet, `fleet.open` recomputed per part."""

    def ranked(self, fleet, candidates, key, n=None):
        floor = min(r.outstanding for r in candidates)
        eligible = [r for r in candidates if r.outstanding <= floor + self.slack(fleet, r)]
        scored = sorted(
            eligible, key=lambda r: (brute_best_match(r, key) if key else (0, 0), -r.outstanding, r.name), reverse=True
        )
        if not fleet.hungry(scored[0]) and any(fleet.hungry(r) for r in scored):
            eligible = scored = [r for r in scored if fleet.hungry(r)]
        if not key or brute_best_match(scored[0], key)[0] == 0:
            scored = sorted(eligible, key=lambda r: (r.outstanding, r.name))
        rest = sorted((r for r in candidates if r not in eligible), key=lambda r: (r.outstanding, r.name))
        return scored + rest

    def choose(self, fleet, now, prompts, tokens, key, lora=""):
        candidates = ref_open(fleet, now)
        if not candidates:
            return None
        return self.split(fleet, candidates, prompts, tokens, key)

    def split(self, fleet, candidates, prompts, tokens, key):
        ranked = self.ranked(fleet, candidates, key)
        parts = self.pieces(candidates, prompts, tokens)
        base, extra = divmod(prompts, parts)
        return [(r, base + (1 if i < extra else 0)) for i, r in enumerate(ranked[:parts])]

    def route_parts(self, fleet, now, parts, key=()):
        if not ref_open(fleet, now):
            return None
        out, out_costs = [], []
        for prompts, tokens, part_key in parts:
            placed = self.split(fleet, ref_open(fleet, now) or ref_live(fleet, now), prompts, tokens, part_key)
            costs = fleet.charges(placed, prompts, tokens, -1, part_key)
            fleet.assign_all(placed, costs, part_key)
            extend_merged(out, placed, out_costs, costs)
        return out


# --- the index equals the scan ----------------------------------------------------------------

# Tiny alphabets make keys that are not hash chains (the same hash at several depths, under
# different parents): the index must still be exact.
small_keys = st.lists(st.integers(0, 2), min_size=1, max_size=5)
index_ops = st.lists(
    st.one_of(
        st.tuples(st.just("assign"), st.integers(0, 3), small_keys),
        st.tuples(st.just("forget"), st.integers(0, 4)),  # 4: everyone
    ),
    max_size=60,
)


def prefixes_held(fleet) -> set[tuple[int, ...]]:
    return {key[:i] for r in fleet.replicas.values() for key, _ in r.history for i in range(1, len(key) + 1)}


@THOROUGH
@given(
    ops=index_ops,
    kv=st.lists(st.sampled_from([0, 1, 3, 8, 20]), min_size=4, max_size=4),
    queries=st.lists(st.lists(st.integers(0, 2), max_size=6), min_size=1, max_size=8),
)
def test_indexed_match_equals_history_scan(ops, kv, queries):
    f = Fleet(history=MIN_HISTORY + 2, hash_block_size=128)
    names = [f"r{i}" for i in range(4)]
    for name, blocks in zip(names, kv):  # small KV budgets: eviction all the time
        f.observe(name, NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=blocks, engine_block_size=128)
    for op in ops:
        if op[0] == "assign":
            f.assign(f.replicas[names[op[1]]], 1, 10, op[2])
        elif op[1] == 4:
            f.forget_history()
        else:
            f.forget_history(f.replicas[names[op[1]]])
        # Nothing leaks: the index holds exactly the prefixes of the remembered keys.
        assert len(f.index) == len(prefixes_held(f))
        for r in f.replicas.values():
            assert r.history_blocks == sum(len(k) for k, _ in r.history)
    for key in queries:
        expected = {r: brute_best_match(r, key) for r in f.replicas.values()}
        assert {r: f.best_match(r, key) for r in f.replicas.values()} == expected
        assert f.index.matches(key) == {r: best for r, best in expected.items() if best[0]}


def test_index_is_exact_for_keys_that_are_not_hash_chains():
    """Hash 1 at depth 2 under parent 0 is not hash 1 at depth 2 under parent 5."""
    f = Fleet()
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=0)
    a = f.replicas["a"]
    f.assign(a, 1, 0, [5, 1])
    f.assign(a, 1, 0, [1, 1])
    assert f.best_match(a, [0, 1]) == (0, 0)
    assert f.best_match(a, [1, 1, 1]) == (2, 2)
    assert f.best_match(a, [5, 1, 1]) == (2, 1)
    assert f.best_match(a, []) == (0, 0)


def test_eviction_keeps_the_latest_clock():
    """A replica routed a prefix twice: evicting the older entry leaves the newer clock."""
    f = Fleet(history=MIN_HISTORY)
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=0)
    a = f.replicas["a"]
    f.assign(a, 1, 0, [1, 2])  # clock 1
    f.assign(a, 1, 0, [1, 3])  # clock 2
    for i in range(MIN_HISTORY - 1):  # pushes [1, 2] out
        f.assign(a, 1, 0, [100 + i])
    assert a.history[0][0] == (1, 3)
    assert f.best_match(a, [1, 2]) == (1, 2)  # [1] still held, by the entry of clock 2
    assert f.best_match(a, [1, 3]) == (2, 2)


class NoScan(deque):
    """A history that fails the test if a decision reads it entry by entry."""

    def __iter__(self):
        raise AssertionError("a decision scanned a replica's history")

    def __reversed__(self):
        raise AssertionError("a decision scanned a replica's history")


def test_prefix_aware_decisions_never_scan_histories():
    """The cost of a decision does not grow with history: the policy reads the index only."""
    f = Fleet(cap_tokens=10**9)
    for i in range(4):
        f.observe(f"r{i}", NOW, ready=True, outstanding=100 * i, done_tokens=0, window=4)
        f.replicas[f"r{i}"].history = NoScan()
    for i in range(200):
        f.assign(f.replicas[f"r{i % 4}"], 1, 10, [i % 7, i % 5, i])
    p = PrefixAware()
    for i in range(50):
        assert p.route(f, NOW, 1 + i % 5, 100 * (1 + i % 20), [i % 7, i % 5])
        assert p.route_parts(f, NOW, [(1, 10, [i % 7]), (2, 20, []), (3, 30, [i % 7, i % 5, 3])])
    assert p.route(f, NOW, 20, 10**7, [1, 1])  # a split too


# --- decisions equal the scanning implementation -----------------------------------------------

# Loads from a few round values tie often (ties are where orderings differ); large
# buckets push replicas past the automatic slack and get split.
loads = st.one_of(st.sampled_from([0, 100, 250, 4000]), st.integers(0, 3000))
fleet_specs = st.lists(
    st.tuples(
        loads,  # outstanding
        st.sampled_from([True, True, True, False]),  # ready
        st.sampled_from([0.0, 0.0, 1.0, 4.999, 5.0, 7.0]),  # age of last status
        st.integers(0, 6),  # window (0: unknown)
        st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4), max_size=6),  # keys routed
    ),
    min_size=1,
    max_size=6,
)
part = st.tuples(st.integers(1, 5), st.integers(0, 800), st.lists(st.integers(0, 2), max_size=4))
steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("route"),
            st.integers(1, 40),
            st.one_of(st.sampled_from([0, 100, 150, 70_000]), st.integers(0, 20_000)),
            st.lists(st.integers(0, 2), max_size=4),
        ),
        st.tuples(st.just("parts"), st.lists(part, min_size=1, max_size=5)),
        st.tuples(st.just("status"), st.integers(0, 5), loads, st.sampled_from([0, 50, 100, 500, 100_000])),
    ),
    min_size=1,
    max_size=25,
)


def build(specs, cap):
    f = Fleet(dead_after=5.0, cap_tokens=cap, history=MIN_HISTORY + 2)
    order = []
    for i, (outstanding, ready, age, window, hist) in enumerate(specs):
        f.observe(f"r{i}", NOW - age, ready=ready, outstanding=outstanding, done_tokens=0, window=window, kv_blocks=12)
        order += [(j, f"r{i}", h) for j, h in enumerate(hist)]
    for _, name, h in sorted(order, key=lambda x: (x[0], x[1])):
        f.assign(f.replicas[name], 1, 50, h)
    return f


def named(out):
    return None if out is None else [(r.name, n) for r, n in out]


@THOROUGH
@given(
    specs=fleet_specs,
    steps=steps,
    cap=st.sampled_from([0, 0, 2000, 10**6]),  # 0: automatic caps from windows
    slack=st.sampled_from([0, 0, 1, 500, 10**6]),  # 0: automatic slack (the cap)
    split=st.sampled_from([0.5, 2.0, float("inf")]),
)
def test_decisions_equal_the_scanning_implementation(specs, steps, cap, slack, split):
    new, old = build(specs, cap), build(specs, cap)
    # (hot-prefix spreading off: the reference predates it; `test_hot_prefixes.py` tests it)
    p_new, p_old = PrefixAware(slack, split, hot_factor=0), ScanningPrefixAware(slack, split, hot_factor=0)
    for step in steps:
        match step:
            case ("route", prompts, tokens, key):
                assert named(p_new.route(new, NOW, prompts, tokens, key)) == named(p_old.route(old, NOW, prompts, tokens, key))
            case ("parts", parts):
                assert named(p_new.route_parts(new, NOW, parts)) == named(p_old.route_parts(old, NOW, parts))
            case ("status", i, reported, done):
                name = f"r{i % len(specs)}"
                for f in (new, old):
                    r = f.replicas[name]
                    f.observe(name, r.last_seen, ready=r.ready, outstanding=reported, done_tokens=r.done_tokens + done, window=r.window, kv_blocks=r.kv_blocks)
        assert {n: r.outstanding for n, r in new.replicas.items()} == {n: r.outstanding for n, r in old.replicas.items()}
        assert [r.name for r in new.open(NOW)] == [r.name for r in ref_open(old, NOW)]


# --- the router reads the engine block size ----------------------------------------------------


def test_router_converts_engine_blocks_from_status():
    from prefixflow.services.router.service import Router
    from prefixflow.shared.process.config import RouterConfig

    router = Router(RouterConfig(hash_block_size=128))
    status = m.EngineStatus("gpu0", 0.0, ready=True, kv_blocks=64, block_size=16, window=8)
    assert router.on_status(status)  # a new replica with room
    r = router.fleet.replicas["gpu0"]
    # 64 engine blocks x 16 tokens = 1024 tokens = 8 hash blocks of 128, not 64.
    assert (r.kv_blocks, r.engine_block_size, r.history_budget) == (64, 16, 8)


# --- prefixflow bench router -------------------------------------------------------------------


def test_bench_router_output_shape():
    out = bench_router(replicas=4, history_blocks=16, keys=8, decisions=20, rounds=2)
    assert {k: out[k] for k in ("replicas", "history_blocks", "keys", "decisions", "rounds")} == {
        "replicas": 4,
        "history_blocks": 16,
        "keys": 8,
        "decisions": 20,
        "rounds": 2,
    }
    assert out["us_per_decision"] > 0 and len(out["us_per_decision_rounds"]) == 2
    assert out["refused"] == 0
    json.dumps(out)


def test_bench_router_cli_prints_one_json_object(capsys):
    from prefixflow.cli.main import build_parser

    args = build_parser().parse_args(
        ["bench", "router", "--replicas", "3", "--history-blocks", "8", "--decisions", "5", "--rounds", "1", "--json"]
    )
    args.fn(args)
    out = json.loads(capsys.readouterr().out)
    assert out["replicas"] == 3 and out["history_blocks"] == 8 and out["decisions"] == 5
    assert isinstance(out["us_per_decision"], float)
