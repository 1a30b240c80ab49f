"""prefixflow.services.router.policies.Daft: the reference policy (Daft's vllm-prefix-caching provider).

Reference rules, as the tests below spell them out step by step:
- load = cumulative prompts ever routed to a replica (never decremented, even when the
  replica reports completed work);
- eligible replicas: load < min load + 256 (the minimum over the open replicas);
- among eligible replicas, the one whose last 8 routed prefix keys contain this exact key,
  most recently (global recency: the routing clock is shared across replicas);
- a keyless batch, or a key found in no eligible replica's last 8, goes to the least
  loaded replica (ties by name).
Flow control (dead, not ready, capped: never chosen) is the project's, common to every
policy.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import Daft, make_policy

pytestmark = pytest.mark.unit

NOW = 100.0
SLACK = 256
WINDOW = 8
K = (11, 22, 33)


def make_fleet(*names: str, now: float = NOW, **kw) -> Fleet:
    f = Fleet(**kw)
    for n in names:
        f.observe(n, now, ready=True, outstanding=0, done_tokens=0)
    return f


def route(policy, f: Fleet, prompts: int, key=(), *, tokens: int | None = None, now: float = NOW) -> str | None:
    """Route one batch; the chosen replica's name (None: nowhere). Daft never splits."""
    out = policy.route(f, now, prompts, prompts * 10 if tokens is None else tokens, list(key) if key else [])
    if out is None:
        return None
    assert len(out) == 1 and out[0][1] == prompts
    return out[0][0].name


def probe(policy, f: Fleet, key=(), prompts: int = 1, now: float = NOW) -> str | None:
    """Where a batch *would* go, without recording it (Policy.choose has no side effects)."""
    out = policy.choose(f, now, prompts, prompts * 10, list(key) if key else [])
    return None if out is None else out[0][0].name


def loads(f: Fleet) -> dict[str, int]:
    return {n: r.routed_prompts for n, r in f.replicas.items()}


def test_make_policy_daft_constants():
    p = make_policy("daft")
    assert isinstance(p, Daft) and p.name == "daft"
    assert p.LOAD_SLACK == SLACK and p.HISTORY == WINDOW


# --- (a) stickiness within the load slack -------------------------------------------------


def test_a_key_sticks_to_its_replica_while_within_slack():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    # loads {r0: 0, r1: 0}; K nowhere -> least loaded, tie by name -> r0.
    assert route(p, f, 10, K) == "r0"
    # loads {r0: 10, r1: 0}; r0 eligible (10 < 0 + 256) and holds K -> r0, though more loaded.
    assert route(p, f, 10, K) == "r0"
    # loads {r0: 20, r1: 0}; 20 < 256 -> still r0.
    assert route(p, f, 200, K) == "r0"
    # loads {r0: 220, r1: 0}; 220 < 256 -> r0 again.
    assert route(p, f, 35, K) == "r0"
    assert loads(f) == {"r0": 255, "r1": 0}
    # loads {r0: 255, r1: 0}; 255 < 256 is the last eligible load -> r0.
    assert route(p, f, 1, K) == "r0"
    assert loads(f) == {"r0": 256, "r1": 0}


# --- (b) leaving the slack -----------------------------------------------------------------


def test_b_key_moves_to_least_loaded_once_load_reaches_min_plus_slack():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    J = (9, 9)
    # loads {0, 0}: J nowhere -> least loaded, tie by name -> r0.
    assert route(p, f, 1, J) == "r0"
    # loads {1, 0}: keyless -> least loaded -> r1.
    assert route(p, f, 1) == "r1"
    # loads {1, 1}: K nowhere -> tie by name -> r0.
    assert route(p, f, 256, K) == "r0"
    # loads {r0: 257, r1: 1}: 257 < 1 + 256 is false -> r0 ineligible; only r1 eligible,
    # K not there -> least loaded among eligible -> r1 (and J too).
    assert probe(p, f, K) == "r1"
    assert probe(p, f, J) == "r1"
    assert route(p, f, 10, K) == "r1"
    # loads {r0: 257, r1: 11}: min is now 11, r0 eligible again (257 < 267).
    # K: both hold it, r1 received it most recently -> r1.
    assert probe(p, f, K) == "r1"
    # J: only r0 holds it -> r0, though r0 is far more loaded.
    assert route(p, f, 1, J) == "r0"
    assert loads(f) == {"r0": 258, "r1": 11}


def test_b_match_on_an_ineligible_replica_does_not_count():
    p, f = make_policy("daft"), make_fleet("r0", "r1", "r2")
    # loads {0,0,0}: K nowhere -> r0 by name.
    assert route(p, f, 300, K) == "r0"
    # loads {r0: 300, r1: 0, r2: 0}: r0 holds K but 300 >= 0 + 256; r1, r2 tie -> r1.
    assert route(p, f, 1, (5,)) == "r1"
    # loads {300, 1, 0}: min 0; r0 ineligible; K nowhere eligible -> least loaded -> r2.
    assert route(p, f, 1, K) == "r2"


# --- (c) load is cumulative -----------------------------------------------------------------


def test_c_completed_work_never_decreases_load():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    # loads {0, 0}: K nowhere -> r0 by name.
    assert route(p, f, 300, K, tokens=3000) == "r0"
    # r0 reports all of its work done and nothing in flight.
    f.observe("r0", NOW, ready=True, outstanding=0, done_tokens=3000)
    r0 = f.replicas["r0"]
    assert r0.outstanding == 0  # the project's own load measure drops ...
    assert r0.routed_prompts == 300  # ... the reference's does not
    # loads {r0: 300, r1: 0}: r0 still ineligible (300 >= 256) despite holding K and having
    # no outstanding work -> r1.
    assert route(p, f, 1, K) == "r1"
    # Keyless: least by cumulative prompts -> r1 (1 < 300), not r0 (outstanding 0 < 10).
    assert route(p, f, 1) == "r1"
    # A restarted replica (done_tokens counter reset) keeps its cumulative load too.
    f.observe("r0", NOW, ready=True, outstanding=0, done_tokens=5)
    assert f.replicas["r0"].routed_prompts == 300
    assert loads(f) == {"r0": 300, "r1": 2}


# --- (d) exact key only ----------------------------------------------------------------------


def test_d_exact_key_only_unlike_prefix_aware():
    daft, f = make_policy("daft"), make_fleet("r0", "r1")
    # loads {0, 0}: K nowhere -> r0 by name.
    assert route(daft, f, 10, K) == "r0"
    # loads {r0: 10, r1: 0}: K + one block shares K's 3 blocks but is not equal -> no match
    # -> least loaded -> r1.
    assert route(daft, f, 1, K + (44,)) == "r1"
    # loads {10, 1}: a strict prefix of K is not K either -> least loaded -> r1.
    assert route(daft, f, 1, K[:2]) == "r1"
    # loads {10, 2}: K itself still matches r0.
    assert route(daft, f, 1, K) == "r0"

    # Contrast: prefix-aware counts the partial match and sends K + (44,) to r0.
    pa, g = make_policy("prefix-aware"), make_fleet("r0", "r1")
    assert route(pa, g, 10, K) == "r0"
    assert route(pa, g, 1, K + (44,)) == "r0"


# --- (e) only the last 8 keys ------------------------------------------------------------


def test_e_only_the_last_8_keys_count():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    # loads {0, 0}: K nowhere -> r0 by name.
    assert route(p, f, 1, K) == "r0"
    for i in range(1, 8):
        # loads {r0: i, r1: i - 1}: keyless -> least loaded -> r1.
        assert route(p, f, 1) == "r1"
        # loads {i, i}: fresh key A_i nowhere -> tie -> r0 by name.
        assert route(p, f, 1, (100 + i,)) == "r0"
    # r0's keys: K, A1..A7 (8 keys, K the oldest); loads {r0: 8, r1: 7}.
    assert [k for k, _ in f.replicas["r0"].history] == [K] + [(100 + i,) for i in range(1, 8)]
    # K is still in r0's last 8 -> r0, though r1 is less loaded.
    assert probe(p, f, K) == "r0"
    # loads {8, 7}: keyless -> r1; loads {8, 8}: A8 nowhere -> tie -> r0.
    assert route(p, f, 1) == "r1"
    assert route(p, f, 1, (108,)) == "r0"
    # r0's last 8 are A1..A8: K fell out of the window (the fleet still stores it: the
    # window is the policy's, not a history trim) -> K nowhere -> least loaded r1 (8 < 9).
    assert K in [k for k, _ in f.replicas["r0"].history]
    assert probe(p, f, K) == "r1"


def test_e_keyless_batches_do_not_push_keys_out_of_the_window():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    assert route(p, f, 1, K) == "r0"  # loads {0, 0}: -> r0 by name
    # 20 keyless batches alternate by least load (r1 first: 0 < 1) and record no key.
    for _ in range(20):
        route(p, f, 1)
    assert [k for k, _ in f.replicas["r0"].history] == [K]
    # loads {r0: 11, r1: 10}: K still in r0's last 8 -> r0.
    assert loads(f) == {"r0": 11, "r1": 10}
    assert probe(p, f, K) == "r0"


def test_e_window_is_8_even_when_the_fleet_history_is_trimmed_by_kv_budget():
    p = make_policy("daft")
    f = Fleet()
    for n in ("r0", "r1"):
        f.observe(n, NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=1)  # tiny KV cache
    assert route(p, f, 1, K) == "r0"  # loads {0, 0}: -> r0 by name
    for i in range(1, 8):
        assert route(p, f, 1) == "r1"  # keyless -> least loaded
        assert route(p, f, 1, (100 + i,)) == "r0"  # tie -> r0 by name
    # The fleet keeps at least 8 keys whatever the KV budget, so K still matches.
    assert probe(p, f, K) == "r0"


# --- (f) global recency ------------------------------------------------------------------------


def test_f_most_recent_holder_wins():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    # loads {0, 0}: K nowhere -> r0 by name.
    assert route(p, f, 300, K) == "r0"
    # loads {300, 0}: r0 ineligible (300 >= 256) -> least loaded eligible -> r1.
    assert route(p, f, 1, K) == "r1"
    # loads {300, 1}: keyless -> least loaded -> r1.
    assert route(p, f, 100) == "r1"
    # loads {r0: 300, r1: 101}: min 101, both eligible (300 < 357); both hold K,
    # r1 received it last -> r1.
    assert probe(p, f, K) == "r1"
    # keyless 500 -> least loaded r1; loads {300, 601}: min 300, r1 ineligible (601 >= 556).
    assert route(p, f, 500) == "r1"
    # Only r0 eligible, it holds K -> r0; K's most recent holder is now r0.
    assert route(p, f, 1, K) == "r0"
    # loads {301, 601}: keyless 400 -> least loaded -> r0; loads {701, 601}, both eligible
    # (701 < 857), both hold K, r0 most recently -> r0, though r0 is the more loaded.
    assert route(p, f, 400) == "r0"
    assert probe(p, f, K) == "r0"
    assert loads(f) == {"r0": 701, "r1": 601}


def test_f_recency_is_per_key_not_per_replica():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    J = (9, 9)
    assert route(p, f, 300, K) == "r0"  # loads {0, 0}: K nowhere -> r0 by name
    assert route(p, f, 1, K) == "r1"  # loads {300, 0}: r0 ineligible -> r1
    assert route(p, f, 600) == "r1"  # keyless -> least loaded r1; loads {300, 601}
    # r1 ineligible (601 >= 300 + 256): J nowhere -> least loaded eligible -> r0.
    assert route(p, f, 1, J) == "r0"
    assert route(p, f, 400) == "r0"  # keyless -> least loaded r0; loads {701, 601}
    # Both eligible (701 < 857). r0 holds the most recent entry overall (J), but K's most
    # recent entry is on r1 -> r1; J only on r0 -> r0.
    assert probe(p, f, K) == "r1"
    assert probe(p, f, J) == "r0"


# --- (g) keyless and pooled batches ------------------------------------------------------------


@pytest.mark.parametrize("empty", [(), [], None])
def test_g_keyless_goes_to_least_loaded(empty):
    p, f = make_policy("daft"), make_fleet("r0", "r1", "r2")
    assert route(p, f, 10, K) == "r0"  # loads {0,0,0}: -> r0 by name
    out = p.route(f, NOW, 4, 40, empty)  # loads {10,0,0}: -> least loaded, tie -> r1
    assert [(r.name, n) for r, n in out] == [("r1", 4)]
    out = p.route(f, NOW, 4, 40, empty)  # loads {10,4,0}: -> r2
    assert [(r.name, n) for r, n in out] == [("r2", 4)]
    assert all(not f.replicas[n].history for n in ("r1", "r2"))  # nothing recorded


def test_g_pooled_batch_is_one_keyless_batch_to_least_loaded():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    assert route(p, f, 10, K) == "r0"  # loads {0, 0}: -> r0 by name
    assert route(p, f, 1) == "r1"  # keyless -> least loaded r1; loads {10, 1}
    # Every part has key K (held by eligible r0), but the pool goes as one keyless batch of
    # 5 prompts to the least loaded -> r1.
    out = p.route_parts(f, NOW, [(3, 30, K), (2, 20, list(K))])
    assert [(r.name, n) for r, n in out] == [("r1", 5)]
    r1 = f.replicas["r1"]
    assert r1.routed_prompts == 6 and r1.outstanding == 10 + 50
    assert not r1.history
    # loads {10, 6}: pooled again -> r1; loads {10, 11}: pooled -> r0 (least loaded now).
    assert p.route_parts(f, NOW, [(5, 50, K)])[0][0].name == "r1"
    assert p.route_parts(f, NOW, [(1, 10, K)])[0][0].name == "r0"


# --- (h) flow control --------------------------------------------------------------------------


def test_h_dead_replica_never_chosen():
    p, f = make_policy("daft"), make_fleet("r0", "r1", now=0.0, dead_after=5.0)
    assert route(p, f, 1, K, now=1.0) == "r0"  # loads {0, 0}: -> r0 by name
    # Only r1 keeps reporting; r0 last seen at 0.0.
    f.observe("r1", 4.0, ready=True, outstanding=0, done_tokens=0)
    assert probe(p, f, K, now=4.9) == "r0"  # 4.9 - 0.0 < 5: r0 live, holds K
    assert probe(p, f, K, now=5.0) == "r1"  # 5.0 - 0.0 >= 5: r0 dead
    assert route(p, f, 1, K, now=8.0) == "r1"
    assert route(p, f, 1, now=8.0) == "r1"  # keyless: r0 would be least loaded, but dead
    # Not even a dead replica's lower load sets the eligibility floor: r1 at 1000 is fine.
    assert route(p, f, 1000, K, now=8.0) == "r1"
    assert route(p, f, 1, K, now=8.0) == "r1"
    # All dead -> nowhere.
    assert route(p, f, 1, K, now=100.0) is None


def test_h_not_ready_replica_never_chosen():
    p, f = make_policy("daft"), make_fleet("r0", "r1")
    assert route(p, f, 1, K) == "r0"  # loads {0, 0}: -> r0 by name
    f.observe("r0", NOW, ready=False, outstanding=0, done_tokens=0)
    assert route(p, f, 1, K) == "r1"  # r0 holds K and is least loaded, but not ready
    assert route(p, f, 1) == "r1"
    f.observe("r1", NOW, ready=False, outstanding=0, done_tokens=0)
    assert route(p, f, 1, K) is None
    f.observe("r0", NOW, ready=True, outstanding=0, done_tokens=0)
    assert route(p, f, 1, K) == "r0"


def test_h_capped_replicas_never_chosen_and_all_capped_is_none():
    p, f = make_policy("daft"), make_fleet("r0", "r1", cap_tokens=100)
    # loads {0, 0}: -> r0 by name; r0 outstanding 100 = cap: closed.
    assert route(p, f, 1, K, tokens=100) == "r0"
    # r0 holds K and is eligible by load (1 < 256), but capped -> r1.
    assert route(p, f, 1, K, tokens=10) == "r1"
    # r1 holds K now -> r1; outstanding 100: capped too.
    assert route(p, f, 1, K, tokens=90) == "r1"
    before = {n: (r.routed_prompts, r.outstanding, len(r.history)) for n, r in f.replicas.items()}
    assert route(p, f, 1, K) is None
    assert route(p, f, 1) is None
    assert p.route_parts(f, NOW, [(1, 10, K)]) is None
    after = {n: (r.routed_prompts, r.outstanding, len(r.history)) for n, r in f.replicas.items()}
    assert after == before  # a refusal records nothing
    # r0 completes its work: open again. K's most recent holder r1 is capped -> r0 (holds K).
    f.observe("r0", NOW, ready=True, outstanding=0, done_tokens=100)
    assert route(p, f, 1, K, tokens=10) == "r0"


def test_h_eligibility_floor_is_over_open_replicas_only():
    # r0 reports a full engine (outstanding >= cap) with no prompts routed through us: it
    # must neither be chosen nor hold the floor at 0 (which would leave r1 ineligible and
    # no replica at all to choose from).
    p, f = make_policy("daft"), make_fleet("r0", "r1", cap_tokens=100)
    f.observe("r0", NOW, ready=True, outstanding=1000, done_tokens=0)
    assert route(p, f, 300, K, tokens=30) == "r1"
    assert route(p, f, 1, (5,), tokens=1) == "r1"
    assert route(p, f, 1, K, tokens=1) == "r1"


# --- property: the reference, rule for rule ---------------------------------------------------

KEYS = [(), (1,), (2,), (1, 2), (3,)]

steps_st = st.lists(
    st.one_of(
        # Small batches keep several replicas eligible (so the 8-key window and recency
        # decide); 255-257 prompts land loads right on the min + 256 boundary.
        st.tuples(st.just("route"), st.one_of(st.integers(1, 3), st.integers(1, 300), st.sampled_from([255, 256, 257])), st.sampled_from(KEYS)),
        st.tuples(st.just("done"), st.integers(0, 3), st.integers(0, 10_000)),
    ),
    min_size=30,  # long enough for keys to fall out of an 8-key window
    max_size=80,
)


@given(n=st.integers(2, 4), kv=st.sampled_from([0, 1, 1000]), steps=steps_st)
def test_property_matches_reference_rules(n, kv, steps):
    names = [f"r{i}" for i in range(n)]
    p = make_policy("daft")
    f = Fleet()
    done = dict.fromkeys(names, 0)
    for name in names:
        f.observe(name, NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=kv)
    # Independent model of the reference.
    load = dict.fromkeys(names, 0)
    keys: dict[str, list[tuple[tuple[int, ...], int]]] = {name: [] for name in names}
    clock = 0
    for step in steps:
        if step[0] == "done":  # completed work: must not change the reference's load
            _, i, more = step
            name = names[i % n]
            done[name] += more
            f.observe(name, NOW, ready=True, outstanding=0, done_tokens=done[name], kv_blocks=kv)
            continue
        _, prompts, key = step
        floor = min(load.values())
        eligible = [x for x in names if load[x] < floor + SLACK]
        least = min(eligible, key=lambda x: (load[x], x))
        holders = {x: max((s for k, s in keys[x][-WINDOW:] if k == key), default=0) for x in eligible} if key else {}
        holders = {x: s for x, s in holders.items() if s}
        expected = max(holders, key=holders.get) if holders else least

        chosen = route(p, f, prompts, key)
        # The two stated properties ...
        assert load[chosen] < floor + SLACK
        if holders:
            assert chosen == max(holders, key=holders.get)
        # ... and the whole rule.
        assert chosen == expected, (load, keys, key)

        load[chosen] += prompts
        if key:
            clock += 1
            keys[chosen].append((key, clock))
        assert loads(f) == load
