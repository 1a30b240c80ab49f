"""prefixflow.services.router.policies: the fleet view and the routing policies."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.router.assignments import MIN_CUT_PROMPTS
from prefixflow.services.router.fleet import MIN_HISTORY, RATE_WARMUP, Fleet
from prefixflow.services.router.policies import (
    MIN_SPLIT_PROMPTS,
    POLICIES,
    Daft,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    make_policy,
)
from prefixflow.shared.prefix.block_keys import matched_blocks
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit

NOW = 100.0
NO_SPLIT = math.inf


def fleet(*specs, dead_after=5.0, cap=1000, history=64):
    """specs: (name, outstanding[, ready[, last_seen]])"""
    f = Fleet(dead_after=dead_after, cap_tokens=cap, history=history)
    for spec in specs:
        name, outstanding, *rest = spec
        ready = rest[0] if rest else True
        seen = rest[1] if len(rest) > 1 else NOW
        f.observe(name, seen, ready=ready, outstanding=outstanding, done_tokens=0, kv_blocks=0)
    return f


def names(assignments):
    return None if assignments is None else [(r.name, n) for r, n in assignments]


def one(policy, f, tokens=1, key=(), prompts=1):
    """Route a bucket that is not split; the chosen replica's name (None: nowhere)."""
    a = policy.route(f, NOW, prompts, tokens, list(key))
    if a is None:
        return None
    assert len(a) == 1 and a[0][1] == prompts
    return a[0][0].name


def policy(name):
    return PrefixAware(split_factor=NO_SPLIT) if name == "prefix-aware" else make_policy(name)


# --- liveness and caps ------------------------------------------------------------------


@pytest.mark.parametrize("name", POLICIES)
def test_dead_and_not_ready_never_chosen(name):
    f = fleet(("dead", 0, True, NOW - 5.0), ("stale", 0, True, NOW - 50), ("unready", 0, False), ("ok", 500))
    key = [1, 2, 3]
    for r in ("dead", "stale", "unready"):  # give them a perfect prefix match
        f.assign(f.replicas[r], 1, 0, key)
    assert [r.name for r in f.live(NOW)] == ["ok"]
    p = policy(name)
    assert [one(p, f, tokens=1, key=key) for _ in range(5)] == ["ok"] * 5


@pytest.mark.parametrize("name", POLICIES)
def test_dead_never_chosen_in_a_split(name):
    f = fleet(("dead", 0, True, NOW - 6), ("unready", 0, False), ("a", 0), ("b", 0), cap=10**9)
    p = make_policy(name)
    out = p.route(f, NOW, 100, 10**6, [1])
    assert out is not None
    assert {r.name for r, _ in out} <= {"a", "b"}
    assert sum(n for _, n in out) == 100


def test_live_boundary():
    f = fleet(("a", 0, True, NOW - 4.999), ("b", 0, True, NOW - 5.0))
    assert [r.name for r in f.live(NOW)] == ["a"]


@pytest.mark.parametrize("name", POLICIES)
def test_capped_replicas_never_chosen(name):
    f = fleet(("at", 1000), ("over", 5000), ("under", 999), cap=1000)
    f.assign(f.replicas["at"], 1, 0, [7, 7])
    p = policy(name)
    assert one(p, f, tokens=10, key=[7, 7]) == "under"
    assert f.replicas["under"].outstanding == 1009
    # now every replica is at or over the cap: nowhere to go, and nothing is assigned
    before = {r.name: (r.outstanding, r.routed_prompts) for r in f.replicas.values()}
    assert p.route(f, NOW, 1, 10, [7, 7]) is None
    assert before == {r.name: (r.outstanding, r.routed_prompts) for r in f.replicas.values()}


@pytest.mark.parametrize("name", POLICIES)
def test_empty_fleet_routes_nowhere(name):
    assert make_policy(name).route(Fleet(), NOW, 1, 1, [1]) is None
    assert make_policy(name).route(fleet(("x", 0, False)), NOW, 1, 1, [1]) is None


def test_automatic_cap():
    f = Fleet(cap_tokens=0, start_windows=2.0)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, window=4)
    r = f.replicas["r"]
    assert f.cap(r) == math.inf  # no prompt seen yet
    f.assign(r, 10, 1000, [])  # 100 tokens per prompt
    assert f.avg_prompt_tokens == 100
    assert f.cap(r) == 2.0 * 4 * 100
    assert f.open(NOW) == []  # 1000 outstanding >= 800
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=300, window=4)
    assert r.outstanding == 700 and f.open(NOW) == [r]
    f.observe("w0", NOW, ready=True, outstanding=0, done_tokens=0, window=0)
    assert f.cap(f.replicas["w0"]) == math.inf  # window unknown
    assert Fleet(cap_tokens=5).cap(r) == 5


def busy(f, name, seconds, rate, *, start=NOW, window=4):
    """`seconds` of status messages from a replica completing `rate` work tokens per second
    with work outstanding throughout (the router routes it 100-token prompts as fast)."""
    step = 100 / rate
    r = f.replicas[name]
    t, done = start, r.done_tokens
    while t < start + seconds - 1e-9:
        f.assign(r, 1, 100, [])  # routed as fast as it completes
        t += step
        done += 100
        f.observe(name, t, ready=True, outstanding=50, done_tokens=done, window=window)
    return t


def test_cap_is_a_bounded_lead_once_the_rate_is_measured():
    """Windows of work until the replica has been busy RATE_WARMUP seconds; then its window
    plus lead_seconds of work at its measured rate (issue #26: a replica holds no more than
    a few seconds of work beyond what it runs)."""
    f = Fleet(cap_windows=2.0, start_windows=1.0, lead_seconds=1.5)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, window=4)
    r = f.replicas["r"]
    f.assign(r, 10, 1000, [])  # 100 tokens per prompt
    f.observe("r", NOW, ready=True, outstanding=1000, done_tokens=0, window=4)
    t = busy(f, "r", RATE_WARMUP - 0.5, 400.0)
    assert r.rate == 0 and f.cap(r) == pytest.approx(1.0 * 4 * f.avg_prompt_tokens), "not measured yet"
    t = busy(f, "r", 1.0, 400.0, start=t)
    assert r.rate == pytest.approx(400.0)
    assert f.cap(r) == pytest.approx(4 * f.avg_prompt_tokens + 1.5 * 400.0)
    busy(f, "r", 30, 1000.0, start=t)  # it speeds up: the moving average follows
    assert r.rate == pytest.approx(1000.0, rel=0.01)
    assert PrefixAware().slack(f, r) == pytest.approx(2.0 * 4 * f.avg_prompt_tokens), "the slack stays in windows"


def test_rate_counts_busy_time_only_and_restarts_with_the_worker():
    f = Fleet(lead_seconds=1.0)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, window=4)
    r = f.replicas["r"]
    for i in range(1, 100):  # idle: nothing routed, nothing done
        f.observe("r", NOW + i, ready=True, outstanding=0, done_tokens=0, window=4)
    assert r.busy_seconds == 0 and r.rate == 0
    f.assign(r, 1, 100, [])
    f.observe("r", NOW + 100, ready=True, outstanding=100, done_tokens=0, window=4)  # it pulled the work
    t = busy(f, "r", 3, 200.0, start=NOW + 100)
    assert r.rate == pytest.approx(200.0)
    f.observe("r", t + 1, ready=True, outstanding=0, done_tokens=0, window=4)  # a new worker: counts from 0
    assert r.rate == 0 and r.busy_seconds == 0


@given(st.lists(st.tuples(st.floats(0.01, 3), st.integers(0, 10_000), st.booleans()), max_size=60))
def test_rate_and_lead_cap_property(steps):
    """Whatever the statuses: the rate is never negative nor above the fastest completion
    seen, and the cap never falls below one window of work."""
    f = Fleet(lead_seconds=1.0)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, window=8)
    r = f.replicas["r"]
    f.assign(r, 1, 50, [])
    t, done, fastest = NOW, 0, 0.0
    for dt, d, route in steps:
        if route:
            f.assign(r, 1, 50, [])
        t += dt
        done += d
        f.observe("r", t, ready=True, outstanding=50 * route, done_tokens=done, window=8)
        fastest = max(fastest, d / dt)
        assert 0 <= r.rate <= fastest + 1e-6
        assert f.cap(r) >= 8 * f.avg_prompt_tokens - 1e-6


def test_work_waits_for_a_replica_that_comes_up_later():
    """A replica ready first holds its window plus its lead, no more: the rest of a job
    stays unrouted (in the bucketers) and goes to the one that comes up later."""
    f = Fleet(lead_seconds=1.0)
    policy = PrefixAware()
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=0, window=4)
    a = f.replicas["a"]
    f.assign(a, 4, 400, [])
    f.observe("a", NOW, ready=True, outstanding=400, done_tokens=0, window=4)
    t = busy(f, "a", 3, 200.0)
    routed = {"a": 0, "b": 0}
    for _ in range(200):  # a 200-bucket job, 100 tokens each, while only `a` is up
        got = policy.route(f, t, 1, 100, [7, 7])
        if got is None:
            break
        routed[got[0][0].name] += 1
    assert a.outstanding <= f.cap(a) + 100 and routed["a"] < 20, "a holds its lead, not the job"
    f.observe("b", t, ready=True, outstanding=0, done_tokens=0, window=4)
    got = policy.route(f, t, 1, 100, [7, 7])
    assert got is not None and got[0][0].name == "b", "the later replica takes what a has no room for"


def lead_fleet(window=4, rate=200.0):
    """One replica `a` with a measured rate: its cap is a bounded lead."""
    f = Fleet(lead_seconds=1.0)
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=0, window=window)
    f.assign(f.replicas["a"], window, 100 * window, [])
    f.observe("a", NOW, ready=True, outstanding=100 * window, done_tokens=0, window=window)
    return f, busy(f, "a", 3, rate)


def test_a_bucket_past_the_room_is_cut_and_the_rest_kept():
    """With `defer` (a bucketer asks), a 96-prompt bucket offered to a replica with room
    for a few prompts places `MIN_CUT_PROMPTS` (or as many as its room takes, if more) and
    hands the rest back (None); without it the whole bucket lands there (failover, the
    baselines). A bucket no larger than the minimum is never cut."""
    f, t = lead_fleet()
    a = f.replicas["a"]
    room, before = f.cap(a) - a.outstanding, a.outstanding
    assert 0 < room < 96 * 100
    keep = max(MIN_CUT_PROMPTS, math.ceil(room / 100))
    assert keep < 96
    got = PrefixAware().route(f, t, 96, 96 * 100, [7, 7], defer=True)
    assert [(r and r.name, n) for r, n in got] == [("a", keep), (None, 96 - keep)]
    assert a.outstanding - before == keep * 100, "charged for what it got only"
    f2, t2 = lead_fleet()
    assert names(PrefixAware().route(f2, t2, 96, 96 * 100, [7, 7])) == [("a", 96)]
    f3, t3 = lead_fleet()
    small = PrefixAware().route(f3, t3, MIN_CUT_PROMPTS, MIN_CUT_PROMPTS * 100, [7, 7], defer=True)
    assert names(small) == [("a", MIN_CUT_PROMPTS)]


def test_kept_prompts_go_to_a_replica_that_comes_up_later():
    f, t = lead_fleet()
    policy = PrefixAware()
    got = policy.route(f, t, 96, 9600, [7, 7], defer=True)
    kept = sum(n for r, n in got if r is None)
    assert kept > 0
    f.observe("b", t, ready=True, outstanding=0, done_tokens=0, window=4)
    again = policy.route(f, t, kept, kept * 100, [7, 7], defer=True)
    assert again[0][0].name == "b"


@given(
    loads=st.lists(st.integers(0, 3000), min_size=1, max_size=5),
    parts=st.lists(st.tuples(st.integers(1, 80), st.integers(1, 200)), min_size=1, max_size=4),
)
def test_deferred_routing_property(loads, parts):
    """Whatever the loads and parts: the assignments cover the batch's prompts in order,
    at least one prompt is placed when any replica is open, every replica placed was open
    and ends at most a minimum cut's cost over its cap, and the kept prompts cost nothing."""
    f = Fleet(cap_tokens=2000)
    for i, load in enumerate(loads):
        f.observe(f"r{i}", NOW, ready=True, outstanding=load, done_tokens=0, kv_blocks=0)
    before = {r.name: r.outstanding for r in f.replicas.values()}
    was_open = {r.name for r in f.open(NOW)}
    route = [(n, n * per, [k + 1, k + 2]) for k, (n, per) in enumerate(parts)]
    policy = PrefixAware()
    got = policy.route_parts(f, NOW, route, defer=True)
    if not was_open:
        assert got is None
        return
    assert sum(n for _, n in got) == sum(n for n, _ in parts)
    assert any(r is not None for r, _ in got)
    assert all(c == 0 for (r, _), c in zip(got, policy.last_costs, strict=True) if r is None)
    most = max(per for _, per in parts)
    for r in f.replicas.values():
        grew = r.outstanding - before[r.name]
        if grew:
            assert r.name in was_open
            assert r.outstanding <= 2000 + MIN_CUT_PROMPTS * most
    # What was charged is what was placed (no prefix cached, output not told: n x per prompt).
    per_prompt = [per for n, per in parts for _ in range(n)]
    placed, i = 0, 0
    for r, n in got:
        if r is not None:
            placed += sum(per_prompt[i : i + n])
        i += n
    assert placed == sum(r.outstanding - before[r.name] for r in f.replicas.values())


def test_make_policy():
    assert isinstance(make_policy("round-robin"), RoundRobin)
    assert isinstance(make_policy("least-loaded"), LeastLoaded)
    assert isinstance(make_policy("daft"), Daft)
    p = make_policy("prefix-aware", slack_tokens=7, split_factor=3.0)
    assert isinstance(p, PrefixAware) and p.slack_tokens == 7 and p.split_factor == 3.0
    with pytest.raises(ValueError):
        make_policy("random")


# --- round robin / least loaded --------------------------------------------------------


def test_round_robin_alternates():
    f = fleet(("a", 0), ("b", 900))
    p = RoundRobin()
    assert [one(p, f) for _ in range(6)] == ["a", "b", "a", "b", "a", "b"]
    f3 = fleet(("c", 0), ("a", 0), ("b", 0))
    p = RoundRobin()
    assert [one(p, f3, tokens=0) for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_picks_min_outstanding():
    f = fleet(("a", 300), ("b", 100), ("c", 200))
    p = LeastLoaded()
    assert one(p, f, tokens=150) == "b"  # b -> 250
    assert one(p, f, tokens=150) == "c"  # c -> 350
    assert one(p, f, tokens=10) == "b"  # b 250 < a 300
    assert {r.name: r.outstanding for r in f.replicas.values()} == {"a": 300, "b": 260, "c": 350}
    assert one(LeastLoaded(), fleet(("z", 5), ("y", 5))) == "y"  # ties: by name


# --- prefix aware ----------------------------------------------------------------------


def test_prefix_aware_prefers_longest_match_within_slack():
    f = fleet(("a", 0), ("b", 50), ("c", 100))
    f.assign(f.replicas["b"], 1, 0, [1, 2])
    f.assign(f.replicas["c"], 1, 0, [1, 2, 3, 4])
    p = PrefixAware(slack_tokens=100, split_factor=NO_SPLIT)
    assert names(p.choose(f, NOW, 1, 10, [1, 2, 3, 9])) == [("c", 1)]
    assert names(p.choose(f, NOW, 1, 10, [1, 2, 8])) == [("c", 1)]  # equal match: most recent
    assert names(p.choose(f, NOW, 1, 10, [9])) == [("a", 1)]


def test_prefix_aware_ignores_match_outside_slack():
    f = fleet(("a", 0), ("b", 50), ("c", 101))
    f.assign(f.replicas["c"], 1, 0, [1, 2, 3, 4])
    f.assign(f.replicas["b"], 1, 0, [1])
    p = PrefixAware(slack_tokens=100, split_factor=NO_SPLIT)
    # c has the better match but is 101 > 0 + 100 tokens over the floor; b is within slack
    assert names(p.choose(f, NOW, 1, 10, [1, 2, 3, 4])) == [("b", 1)]
    f.forget_history(f.replicas["b"])
    assert names(p.choose(f, NOW, 1, 10, [1, 2, 3, 4])) == [("a", 1)]  # no match within slack


def test_prefix_aware_no_match_is_least_loaded():
    f = fleet(("a", 40), ("b", 30), ("c", 35))
    f.assign(f.replicas["a"], 1, 0, [9, 9])
    p = PrefixAware(slack_tokens=1000, split_factor=NO_SPLIT)
    assert names(p.choose(f, NOW, 1, 10, [1, 2])) == [("b", 1)]
    assert names(p.choose(f, NOW, 1, 10, [])) == [("b", 1)]


def test_prefix_aware_affinity_never_starves_a_replica():
    """A replica that (re)joined with no history gets work once the best match already
    holds a window of work; before that, affinity wins."""
    f = Fleet(cap_tokens=100_000)
    for name in ("a", "b"):
        f.observe(name, NOW, ready=True, outstanding=0, done_tokens=0, window=4)
    p = PrefixAware(split_factor=NO_SPLIT)
    f.assign(f.replicas["b"], 1, 100, [1, 2])  # avg prompt 100 tokens: a window is 400
    chosen = [one(p, f, tokens=100, key=[1, 2]) for _ in range(6)]
    # b is fed to one window (400 tokens) by affinity, then the hungry a takes the rest
    assert chosen == ["b", "b", "b", "a", "a", "a"]
    assert f.hungry(f.replicas["a"]) and not f.hungry(f.replicas["b"])


@given(
    loads=st.lists(st.integers(0, 2000), min_size=2, max_size=4),
    windows=st.lists(st.integers(1, 8), min_size=4, max_size=4),
    holder=st.integers(0, 3),
)
def test_prefix_aware_feeds_hungry_replicas_property(loads, windows, holder):
    f = Fleet(cap_tokens=10**6)
    for i, load in enumerate(loads):
        f.observe(f"r{i}", NOW, ready=True, outstanding=load, done_tokens=0, window=windows[i])
    f.assign(f.replicas[f"r{holder % len(loads)}"], 1, 100, [5, 6])
    hungry_before = {r.name for r in f.replicas.values() if f.hungry(r)}
    choice = one(PrefixAware(slack_tokens=10**6, split_factor=NO_SPLIT), f, tokens=10, key=[5, 6])
    if hungry_before:
        assert choice in hungry_before  # never a fed replica while another runs dry
    else:
        assert choice == f"r{holder % len(loads)}"  # everyone fed: affinity decides


def test_prefix_aware_uses_best_entry_of_history():
    f = fleet(("a", 0), ("b", 0), cap=10_000)
    f.assign(f.replicas["a"], 1, 0, [1])
    f.assign(f.replicas["a"], 1, 0, [1, 2, 3, 4])
    f.assign(f.replicas["b"], 1, 0, [1, 2])
    f.assign(f.replicas["a"], 1, 0, [5])
    assert names(PrefixAware(slack_tokens=100, split_factor=NO_SPLIT).choose(f, NOW, 1, 10, [1, 2, 3, 4])) == [("a", 1)]


def test_prefix_aware_tie_prefers_most_recent_across_replicas():
    f = fleet(("a", 0), ("b", 0), cap=100_000)
    p = PrefixAware(slack_tokens=10_000, split_factor=NO_SPLIT)
    key = [1, 2, 3]
    f.assign(f.replicas["b"], 1, 500, [7])  # b has a longer history ...
    f.assign(f.replicas["b"], 1, 500, [8])
    f.assign(f.replicas["b"], 1, 0, key)  # ... and got the prefix first
    f.assign(f.replicas["a"], 1, 10, key)  # a got the same prefix later
    assert names(p.choose(f, NOW, 1, 10, key)) == [("a", 1)]
    # most recent beats least loaded
    f.assign(f.replicas["b"], 1, 0, key)
    assert names(p.choose(f, NOW, 1, 10, key)) == [("b", 1)]


def test_prefix_aware_route_records_history():
    f = fleet(("a", 0), ("b", 0), history=2, cap=10**9)
    p = PrefixAware(slack_tokens=10**6, split_factor=NO_SPLIT)
    first = one(p, f, tokens=10, key=[5, 6])
    assert [k for k, _ in f.replicas[first].history] == [(5, 6)]
    # the same prefix follows its first replica although the other is now less loaded
    n = MIN_HISTORY + 3
    assert [one(p, f, tokens=10, key=[5, 6, 7]) for _ in range(n)] == [first] * n
    # bounded by `history` (kv_blocks unknown), but never below MIN_HISTORY
    assert len(f.replicas[first].history) == max(2, MIN_HISTORY)
    assert f.replicas[first].outstanding == 10 * (n + 1)
    other = "b" if first == "a" else "a"
    assert one(p, f, tokens=1, key=[]) == other
    assert list(f.replicas[other].history) == []  # an empty key is not remembered


def test_history_bounded_by_kv_blocks():
    f = Fleet(cap_tokens=10**9, history=1000)
    kv = 3 * MIN_HISTORY
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=kv)
    r = f.replicas["r"]
    for i in range(MIN_HISTORY):  # MIN_HISTORY keys of 4 blocks: over the budget, all kept
        f.assign(r, 1, 0, [i] * 4)
    assert len(r.history) == MIN_HISTORY and r.history_blocks == 4 * MIN_HISTORY
    f.assign(r, 1, 0, [99] * 4)  # one more: the oldest goes
    assert [k[0] for k, _ in r.history] == list(range(1, MIN_HISTORY)) + [99]
    assert r.history_blocks == sum(len(k) for k, _ in r.history)
    f.forget_history()
    assert not r.history and r.history_blocks == 0


@pytest.mark.parametrize(
    ("kv_blocks", "engine_block_size", "hash_block_size", "budget"),
    [
        (256, 16, 128, 32),  # a GPU: 256 blocks of 16 tokens = 4096 tokens = 32 hash blocks
        (32, 128, 128, 32),  # a CPU engine: its blocks are as long as the hash blocks
        (256, 16, 64, 64),  # shorter prefix-key blocks: more of them fit
        (32, 0, 128, 32),  # block size not reported: kv_blocks taken as hash blocks
    ],
)
def test_history_budget_counts_hash_blocks_not_engine_blocks(kv_blocks, engine_block_size, hash_block_size, budget):
    """kv_blocks are engine blocks; the history is kept in hash blocks. A GPU replica
    reporting 256 blocks of 16 tokens caches 32 prefix-key blocks of 128, not 256."""
    f = Fleet(cap_tokens=10**9, history=1000, hash_block_size=hash_block_size)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=kv_blocks, engine_block_size=engine_block_size)
    r = f.replicas["r"]
    assert (r.kv_blocks, r.engine_block_size, r.history_budget) == (kv_blocks, engine_block_size, budget)
    for i in range(10 * budget):  # one-block keys: the history holds `budget` of them
        f.assign(r, 1, 0, [i])
    assert r.history_blocks == len(r.history) == budget
    assert [k for k, _ in r.history] == [(i,) for i in range(9 * budget, 10 * budget)]
    # What was evicted no longer matches; what is kept does.
    assert f.best_match(r, [0]) == (0, 0) and f.best_match(r, [10 * budget - 1])[0] == 1


def test_history_budget_of_a_tiny_cache_keeps_min_history():
    """Under one hash block of KV cache (4 x 16 tokens < 128): a zero budget, not an
    unknown one, so the history falls back to MIN_HISTORY keys, not `history` keys."""
    f = Fleet(cap_tokens=10**9, history=1000)
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=4, engine_block_size=16)
    r = f.replicas["r"]
    assert r.history_budget == 0
    for i in range(50):
        f.assign(r, 1, 0, [i])
    assert len(r.history) == MIN_HISTORY
    f.observe("r", NOW, ready=True, outstanding=0, done_tokens=0)  # no KV capacity reported
    assert r.history_budget is None


def test_best_match():
    f = fleet(("a", 0))
    r = f.replicas["a"]
    assert f.best_match(r, [1, 2]) == (0, 0)
    for key in ([1, 2, 3], [1, 9], [1, 2, 7]):
        f.assign(r, 1, 0, key)
    stamps = [s for _, s in r.history]
    assert stamps == sorted(stamps) and len(set(stamps)) == 3
    assert f.best_match(r, [1, 2, 3, 4]) == (3, stamps[0])
    assert f.best_match(r, [1, 2, 5]) == (2, stamps[2])  # ties: most recent
    assert f.best_match(r, [4]) == (0, 0)


def test_prefix_aware_splits_a_large_bucket():
    f = fleet(("a", 0), ("b", 0), ("c", 0), cap=10**9)
    p = PrefixAware(slack_tokens=100, split_factor=2.0)
    out = p.route(f, NOW, 40, 1000, [1])
    # an idle fleet: split over every replica
    assert sorted(n for _, n in out) == [13, 13, 14]
    assert len({r.name for r, _ in out}) == 3
    assert sum(r.outstanding for r in f.replicas.values()) in range(998, 1001)
    # ~333 tokens held each: a bucket within 2 x that is not split, a larger one is,
    # into pieces of about that
    assert len(p.route(f, NOW, 40, 600, [1])) == 1
    assert len(p.route(f, NOW, 40, 2000, [2])) == 3


def test_two_idle_replicas_share_one_large_bucket():
    """The whole job in one bucket (say, every row shares a system prompt) must not go to
    one replica of two while the other idles."""
    f = fleet(("a", 0), ("b", 0), cap=10**9)
    out = PrefixAware(split_factor=2.0).route(f, NOW, 1024, 1024 * 600, [1, 2])
    assert sorted(n for _, n in out) == [512, 512]


def test_split_conserves_tokens():
    f = fleet(("a", 0), ("b", 0), ("c", 0), cap=10**9)
    out = PrefixAware(split_factor=1.0).route(f, NOW, 24, 10, [1])
    assert len(out) == 3
    assert sum(r.outstanding for r in f.replicas.values()) == 10


@given(
    loads=st.lists(st.integers(0, 10**6), min_size=1, max_size=8),
    prompts=st.integers(1, 5000),
    tokens=st.integers(1, 10**7),
    factor=st.floats(0.5, 8.0),
)
def test_split_pieces_are_never_below_the_minimum(loads, prompts, tokens, factor):
    f = fleet(*((f"r{i}", load) for i, load in enumerate(loads)), cap=10**12)
    out = PrefixAware(split_factor=factor).route(f, NOW, prompts, tokens, [1])
    assert sum(n for _, n in out) == prompts and len({r.name for r, _ in out}) == len(out)
    if len(out) > 1:
        assert min(n for _, n in out) >= MIN_SPLIT_PROMPTS
        # split only when the bucket outweighs split_factor x the average held
        assert tokens > factor * sum(loads) / len(loads)


# --- daft (the reference) ----------------------------------------------------------------


def test_daft_exact_key_most_recent_within_load_slack():
    f = fleet(("a", 0), ("b", 0), ("c", 0), cap=10**9)
    p = Daft()
    assert one(p, f, key=[1, 2]) == "a"  # no match: least routed prompts, by name
    assert one(p, f, key=[3]) == "b"
    assert one(p, f, key=[1, 2]) == "a"  # exact key held by a
    assert one(p, f, key=[1]) == "c"  # a partial match does not count
    f.replicas["a"].routed_prompts += 300  # a is now >= floor + 256: not eligible
    assert one(p, f, key=[1, 2]) == "b"
    f.replicas["a"].routed_prompts -= 300
    for k in range(Daft.HISTORY):  # push [1, 2] out of a's last 8 keys
        f.assign(f.replicas["a"], 0, 0, [100 + k])
    assert one(p, f, key=[1, 2]) == "b"  # b's own entry for [1, 2] (routed just above)


# --- observe ----------------------------------------------------------------------------


def test_observe_decreases_by_completed_and_respects_reported():
    f = Fleet()
    f.observe("r", 1.0, ready=True, outstanding=0, done_tokens=0, kv_blocks=5)
    r = f.replicas["r"]
    f.assign(r, 1, 1000, [1])
    assert r.outstanding == 1000
    f.observe("r", 2.0, ready=True, outstanding=100, done_tokens=300, kv_blocks=5)
    assert r.outstanding == 700  # 1000 - 300 newly completed
    f.observe("r", 3.0, ready=True, outstanding=100, done_tokens=800, kv_blocks=5)
    assert r.outstanding == 200
    f.observe("r", 4.0, ready=True, outstanding=150, done_tokens=1000, kv_blocks=5)
    assert r.outstanding == 150  # never below what the replica reports
    f.observe("r", 5.0, ready=True, outstanding=0, done_tokens=1000, kv_blocks=5)
    assert r.outstanding == 150  # nothing newly completed
    f.observe("r", 6.0, ready=True, outstanding=0, done_tokens=5000, kv_blocks=7, window=3)
    assert r.outstanding == 0  # never negative
    assert (r.last_seen, r.ready, r.kv_blocks, r.window, r.done_tokens) == (6.0, True, 7, 3, 5000)


def test_observe_counter_reset_after_restart():
    f = Fleet()
    f.observe("r", 1.0, ready=True, outstanding=0, done_tokens=10_000)
    r = f.replicas["r"]
    f.assign(r, 1, 1000, [])
    f.observe("r", 2.0, ready=False, outstanding=300, done_tokens=200)  # restarted
    # The old incarnation's work is redelivered or moved by failover: the new worker's
    # own in-flight count is the truth.
    assert r.outstanding == 300
    assert not r.ready and f.live(2.0) == []


@given(st.lists(st.tuples(st.integers(0, 500), st.integers(0, 2000), st.integers(0, 2000)), max_size=20))
def test_observe_property(steps):
    f = Fleet()
    f.observe("r", 0.0, ready=True, outstanding=0, done_tokens=0)
    r = f.replicas["r"]
    for assigned, reported, done in steps:
        f.assign(r, 1, assigned, [])
        before, prev_done = r.outstanding, r.done_tokens
        f.observe("r", 1.0, ready=True, outstanding=reported, done_tokens=done)
        if done >= prev_done:
            assert r.outstanding == max(before - (done - prev_done), reported, 0)
            assert reported <= r.outstanding <= max(before, reported)
        else:  # restarted worker: its report is the truth
            assert r.outstanding == reported


def test_a_new_cache_epoch_forgets_the_replicas_history():
    """Its engine was rebuilt, reset or its worker restarted: the prefixes routed there
    are gone, so the router no longer prefers it for them (the other replica keeps its)."""
    f = Fleet()
    for name in ("a", "b"):
        f.observe(name, 1.0, ready=True, outstanding=0, done_tokens=0, cache_epoch="e1")
    a, b = f.replicas["a"], f.replicas["b"]
    f.assign(a, 1, 10, [1, 2])
    f.assign(b, 1, 10, [3])
    f.observe("a", 2.0, ready=True, outstanding=0, done_tokens=10, cache_epoch="e1")
    assert f.best_match(a, [1, 2])[0] == 2
    f.observe("a", 3.0, ready=True, outstanding=0, done_tokens=10, cache_epoch="e2")
    assert f.best_match(a, [1, 2]) == (0, 0) and not a.history and f.matches([1, 2]) == {}
    assert f.best_match(b, [3])[0] == 1
    f.observe("b", 3.0, ready=True, outstanding=0, done_tokens=10)  # no epoch reported: kept
    assert f.best_match(b, [3])[0] == 1


def test_work_that_never_arrived_is_written_off_once_the_replica_drains():
    """A route reply the bucketer missed (it asked again) leaves work counted on a replica
    that never gets it; over the cap, the replica would never be routed to again."""
    f = Fleet(cap_tokens=1000, settle=3.0)
    f.observe("r", 0.0, ready=True, outstanding=0, done_tokens=0)
    r = f.replicas["r"]
    f.assign(r, 10, 5000, [1])  # lost on its way
    for t in (1.0, 2.0, 3.9):
        f.observe("r", t, ready=True, outstanding=0, done_tokens=0)
        assert r.outstanding == 5000 and not f.is_open(r, t)
    f.observe("r", 4.0, ready=True, outstanding=0, done_tokens=0)
    assert r.outstanding == 0 and f.written_off == 5000 and f.is_open(r, 4.0)


@pytest.mark.parametrize("interrupt", ["routed", "holds", "not-ready"])
def test_write_off_waits_for_a_quiet_drained_replica(interrupt):
    """Work routed to it, work it holds, or not being ready (rebuilding: its queue waits)
    restarts the wait."""
    f = Fleet(cap_tokens=1000, settle=3.0)
    f.observe("r", 0.0, ready=True, outstanding=0, done_tokens=0)
    r = f.replicas["r"]
    f.assign(r, 10, 5000, [1])
    f.observe("r", 1.0, ready=True, outstanding=0, done_tokens=0)
    if interrupt == "routed":
        f.assign(r, 1, 100, [2])
    f.observe("r", 2.0, ready=interrupt != "not-ready", outstanding=100 if interrupt == "holds" else 0, done_tokens=0)
    f.observe("r", 4.5, ready=True, outstanding=0, done_tokens=0)  # 3.5 s after the first drained status
    assert f.written_off == 0 and r.outstanding >= 5000
    f.observe("r", 7.5, ready=True, outstanding=0, done_tokens=0)  # 3 s of quiet after it
    assert f.written_off > 0 and r.outstanding == 0


@given(
    steps=st.lists(
        st.tuples(st.floats(0.05, 1.0), st.one_of(st.just(0), st.integers(1, 800)), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.booleans()),
        min_size=1, max_size=40,
    ),
    lossy=st.booleans(),
)
def test_write_off_property(steps, lossy):
    """A worker that gets what is routed to it within a second and reports what it holds:
    nothing is ever written off and the count never falls below what is really on the
    way or held. When some routed work is lost instead, the count is back to the truth
    (zero) once the worker has drained and nothing was routed for `settle` seconds."""
    f = Fleet(settle=3.0)
    f.observe("r", 0.0, ready=True, outstanding=0, done_tokens=0)
    r = f.replicas["r"]
    now, held, done = 0.0, 0, 0
    transit: list[tuple[float, int]] = []  # (arrival time, tokens)
    for dt, routed, delay, finish, lose in steps:
        now += dt
        if routed:
            f.assign(r, 1, routed, [])
            if not (lossy and lose):
                transit.append((now + delay, routed))
        held += sum(n for t, n in transit if t <= now)
        transit = [(t, n) for t, n in transit if t > now]
        finished = int(held * finish)
        held, done = held - finished, done + finished
        f.observe("r", now, ready=True, outstanding=held, done_tokens=done)
        if not lossy:
            assert f.written_off == 0
            assert r.outstanding >= held + sum(n for _, n in transit)
    for _ in range(8):  # the worker drains; nothing more is routed
        now += 0.5
        held += sum(n for _, n in transit)
        transit = []
        done, held = done + held, 0
        f.observe("r", now, ready=True, outstanding=0, done_tokens=done)
    assert r.outstanding == 0


# --- property: prefix-aware choices -----------------------------------------------------

replica_specs = st.lists(
    st.tuples(
        st.integers(0, 3000),  # outstanding
        st.sampled_from([True, True, True, False]),  # ready
        st.one_of(st.sampled_from([0.0, 0.0, 1.0, 4.999, 5.0]), st.floats(0.0, 10.0)),  # age of last status
        st.lists(st.lists(st.integers(0, 1), min_size=1, max_size=4), max_size=6),  # keys routed (small alphabet)
    ),
    min_size=1,
    max_size=6,
)


def build(specs, cap):
    f = Fleet(dead_after=5.0, cap_tokens=cap)
    order = []
    for i, (outstanding, ready, age, hist) in enumerate(specs):
        f.observe(f"r{i}", NOW - age, ready=ready, outstanding=outstanding, done_tokens=0)
        order += [(j, f"r{i}", h) for j, h in enumerate(hist)]
    # interleave the histories (deterministically) so the routing clock mixes replicas
    for _, name, h in sorted(order, key=lambda x: (x[0], x[1])):
        f.assign(f.replicas[name], 0, 0, h)
    return f


@THOROUGH
@given(
    specs=replica_specs,
    key=st.lists(st.integers(0, 1), max_size=4),
    slack=st.one_of(st.just(10**6), st.integers(1, 3000)),
    cap=st.one_of(st.just(10**6), st.integers(1, 6000)),
    tokens=st.integers(0, 500),
)
def test_prefix_aware_choice_property(specs, key, slack, cap, tokens):
    f = build(specs, cap)
    open_ = [r for r in f.replicas.values() if r.ready and NOW - r.last_seen < 5.0 and r.outstanding < cap]
    before = {r.name: r.outstanding for r in f.replicas.values()}
    scores = {r.name: max((matched_blocks(key, h) for h, _ in r.history), default=0) for r in f.replicas.values()}
    out = PrefixAware(slack, split_factor=NO_SPLIT).route(f, NOW, 1, tokens, key)
    if not open_:
        assert out is None
        assert before == {r.name: r.outstanding for r in f.replicas.values()}
        return
    assert out is not None and len(out) == 1 and out[0][1] == 1
    choice = out[0][0]
    assert choice in open_  # live, ready, under the cap
    floor = min(before[r.name] for r in open_)
    assert before[choice.name] <= floor + slack
    eligible = [r for r in open_ if before[r.name] <= floor + slack]
    best = max(scores[r.name] for r in eligible) if key else 0
    assert scores[choice.name] == best  # no eligible replica has a strictly longer match
    if best == 0:
        assert before[choice.name] == floor  # no match: the least loaded
    assert choice.outstanding == before[choice.name] + tokens
    if key:
        assert choice.history[-1][0] == tuple(key)


@given(
    specs=replica_specs,
    key=st.lists(st.integers(0, 1), max_size=4),
    prompts=st.integers(1, 50),
    tokens=st.integers(0, 20_000),
    split=st.floats(0.5, 4.0),
    name=st.sampled_from(POLICIES),
)
def test_any_policy_assignments_property(specs, key, prompts, tokens, split, name):
    f = build(specs, 10**6)
    open_ = {r.name for r in f.replicas.values() if r.ready and NOW - r.last_seen < 5.0}
    p = PrefixAware(split_factor=split) if name == "prefix-aware" else make_policy(name)
    out = p.route(f, NOW, prompts, tokens, key)
    if not open_:
        assert out is None
        return
    assert out
    got = [r.name for r, _ in out]
    assert set(got) <= open_ and len(got) == len(set(got))  # live replicas, each once
    assert sum(n for _, n in out) == prompts and all(n >= 1 for _, n in out)
    assert max(n for _, n in out) - min(n for _, n in out) <= 1  # an even split


# --- pooled batches: route_parts ----------------------------------------------------------


@pytest.mark.parametrize("name", ["round-robin", "least-loaded", "daft"])
def test_baselines_route_parts_as_one_keyless_batch(name):
    f = fleet(("a", 10), ("b", 0), cap=10**9)
    out = make_policy(name).route_parts(f, NOW, [(2, 20, [1]), (3, 30, [2])])
    assert len(out) == 1 and out[0][1] == 5
    r = out[0][0]
    assert r.outstanding == (10 if r.name == "a" else 0) + 50
    assert not r.history  # keyless


def test_prefix_aware_route_parts_follows_each_prefix():
    f = fleet(("a", 0), ("b", 0), cap=10**9)
    f.assign(f.replicas["a"], 1, 0, [1, 1])
    f.assign(f.replicas["b"], 1, 0, [2, 2])
    p = PrefixAware(slack_tokens=10**6, split_factor=NO_SPLIT)
    out = p.route_parts(f, NOW, [(2, 20, [1, 1]), (1, 10, [1, 1, 5]), (3, 30, [2, 2]), (1, 5, [1])])
    # consecutive parts for one replica are merged; prompts stay in order and all covered
    assert names(out) == [("a", 3), ("b", 3), ("a", 1)]
    assert f.replicas["a"].outstanding == 35 and f.replicas["b"].outstanding == 30
    assert [k for k, _ in f.replicas["a"].history][-3:] == [(1, 1), (1, 1, 5), (1,)]


@pytest.mark.parametrize("name", POLICIES)
def test_route_parts_nowhere_when_all_capped(name):
    f = fleet(("a", 1000), ("b", 0, False), cap=1000)
    before = f.replicas["a"].outstanding
    assert make_policy(name).route_parts(f, NOW, [(1, 10, [1]), (1, 10, [])]) is None
    assert f.replicas["a"].outstanding == before


def test_route_parts_prefers_open_replicas_and_admits_the_batch_whole():
    # The cap admits a pooled batch as a whole (like a single bucket, which may also take a
    # replica past its cap): parts go to replicas with room while any has room; once none
    # has, the rest of the admitted batch is ranked among all live replicas.
    f = fleet(("a", 0), ("b", 0), cap=100)
    p = PrefixAware(slack_tokens=10**6, split_factor=NO_SPLIT)
    out = p.route_parts(f, NOW, [(1, 100, [1]), (1, 100, [2]), (1, 100, [3])])
    assert sum(n for _, n in out) == 3
    assert sorted(r.outstanding for r in f.replicas.values()) == [100, 200]
    # A batch arriving when every replica is at its cap is refused.
    assert p.route_parts(f, NOW, [(1, 10, [4])]) is None


def test_route_parts_past_the_caps_still_follows_each_prefix():
    # Once an admitted batch has filled every replica's cap, its remaining parts still go
    # where their prefix is (they used to go to the least loaded, scattering prefixes).
    f = fleet(("a", 0), ("b", 0), cap=100)
    f.assign(f.replicas["a"], 1, 0, [1])
    f.assign(f.replicas["b"], 1, 0, [2])
    p = PrefixAware(slack_tokens=10**6, split_factor=NO_SPLIT)
    out = p.route_parts(f, NOW, [(1, 100, [1]), (1, 100, [2]), (1, 50, [2]), (1, 10, [1])])
    assert names(out) == [("a", 1), ("b", 2), ("a", 1)]
    assert f.replicas["a"].outstanding == 110 and f.replicas["b"].outstanding == 150


route_parts_specs = st.lists(
    st.tuples(st.integers(1, 5), st.integers(0, 500), st.lists(st.integers(0, 1), max_size=3)), min_size=1, max_size=6
)


@given(specs=replica_specs, parts=route_parts_specs, name=st.sampled_from(POLICIES))
def test_route_parts_property(specs, parts, name):
    f = build(specs, 10**6)
    open_ = {r.name for r in f.replicas.values() if r.ready and NOW - r.last_seen < 5.0}
    total_before = sum(r.outstanding for r in f.replicas.values())
    p = PrefixAware(split_factor=NO_SPLIT) if name == "prefix-aware" else make_policy(name)
    out = p.route_parts(f, NOW, parts)
    if not open_:
        assert out is None
        return
    assert out
    assert {r.name for r, _ in out} <= open_
    assert sum(n for _, n in out) == sum(pp[0] for pp in parts)  # every prompt, once
    assert all(n >= 1 for _, n in out)
    assert all(a[0] is not b[0] for a, b in zip(out, out[1:]))  # consecutive parts merged
    assert sum(r.outstanding for r in f.replicas.values()) == total_before + sum(pp[1] for pp in parts)
