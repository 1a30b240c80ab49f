"""prefixflow.services.router.block_index.BlockIndex against a naive model (a set of blocks per
replica): after any sequence of stored / removed / cleared / touch events its contents are
the stored minus the removed blocks (while under its bound), `longest_match` is the
naive leading-run count, and it never holds more than its bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.router.block_index import BlockIndex
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit

REPLICAS = ["r0", "r1", "r2"]
# A tiny alphabet so that events collide: the same block stored, removed, re-stored,
# held by several replicas, keys sharing and diverging.
blocks = st.integers(min_value=0, max_value=11)
runs = st.lists(blocks, max_size=6)
replica = st.sampled_from(REPLICAS)
event = st.one_of(
    st.tuples(st.just("stored"), replica, runs),
    st.tuples(st.just("removed"), replica, runs),
    st.tuples(st.just("cleared"), replica, st.just([])),
    st.tuples(st.just("touch"), replica, runs),
)


def apply(index: BlockIndex, ref: dict[str, set[int]], op: str, r: str, run: list[int]) -> None:
    match op:
        case "stored":
            index.stored(r, run)
            ref.setdefault(r, set()).update(run)
        case "removed":
            index.removed(r, run)
            ref.setdefault(r, set()).difference_update(run)
        case "cleared":
            index.cleared(r)
            ref[r] = set()
        case "touch":
            index.touch(r, run)


def naive_match(ref: dict[str, set[int]], key: list[int]) -> dict[str, int]:
    out = {}
    for r, held in ref.items():
        n = 0
        while n < len(key) and key[n] in held:
            n += 1
        if n:
            out[r] = n
    return out


@THOROUGH
@given(st.lists(event, max_size=60), st.lists(runs, min_size=1, max_size=5))
def test_contents_are_stored_minus_removed_and_match_is_naive(events, keys):
    index = BlockIndex(max_entries=10_000)  # never reached: nothing is evicted
    ref: dict[str, set[int]] = {}
    for op, r, run in events:
        apply(index, ref, op, r, run)
        assert {x: index.blocks_of(x) for x in REPLICAS} == {x: frozenset(ref.get(x, ())) for x in REPLICAS}
        assert len(index) == sum(len(v) for v in ref.values())
    for key in keys:
        assert index.longest_match(key) == naive_match(ref, key)
    assert index.evicted == 0


@THOROUGH
@given(st.integers(min_value=1, max_value=12), st.lists(event, max_size=80), runs)
def test_never_grows_past_its_bound_and_never_invents_blocks(bound, events, key):
    index = BlockIndex(max_entries=bound)
    ref: dict[str, set[int]] = {}
    for op, r, run in events:
        apply(index, ref, op, r, run)
        assert len(index) <= bound
        for x in REPLICAS:  # eviction only forgets: what it holds was stored, not removed
            assert index.blocks_of(x) <= ref.get(x, set())
        if op == "stored" and len(set(run)) <= bound:
            assert set(run) <= index.blocks_of(r)  # what was just stored survives its own eviction
    # The match never credits a block the replica does not hold.
    for r, n in index.longest_match(key).items():
        assert set(key[:n]) <= index.blocks_of(r)


def test_eviction_takes_the_least_recently_touched_and_a_prefix_tail_first():
    index = BlockIndex(max_entries=4)
    index.stored("a", [1, 2])  # LRU: (a,2) (a,1)
    index.stored("b", [1, 2])  # LRU: (a,2) (a,1) (b,2) (b,1)
    index.touch("a", [1, 2])  # LRU: (b,2) (b,1) (a,2) (a,1)
    index.stored("c", [7])  # evicts (b,2): b's tail, not its head
    assert index.blocks_of("b") == {1}
    assert index.longest_match([1, 2]) == {"a": 2, "b": 1}
    index.stored("c", [8])  # evicts (b,1)
    assert index.blocks_of("b") == frozenset()
    assert index.evicted == 2
    assert index.longest_match([1, 2, 3]) == {"a": 2}


def test_longest_match_stops_at_the_first_block_nobody_holds():
    index = BlockIndex(max_entries=100)
    index.stored("a", [1, 2, 3])
    index.stored("b", [1, 9])
    index.stored("b", [3])  # b holds block 3 but not 2: no run through it
    assert index.longest_match([1, 2, 3]) == {"a": 3, "b": 1}
    assert index.longest_match([5, 1]) == {}
    assert index.longest_match([]) == {}
    index.removed("a", [2])
    assert index.longest_match([1, 2, 3]) == {"a": 1, "b": 1}
    index.cleared("a")
    assert index.longest_match([1, 2, 3]) == {"b": 1}
    assert index.replicas() == ["b"]


def test_real_block_keys_share_their_common_prefix():
    """With real keys, prompts sharing a system prompt match as far as they share it."""
    system = list(range(1000, 1000 + 256))
    a = block_hashes(tk.pack(system + list(range(128))), 128)
    b = block_hashes(tk.pack(system + list(range(5000, 5128))), 128)
    index = BlockIndex(max_entries=100)
    index.stored("r0", a)
    assert index.longest_match(b) == {"r0": 2}
    assert index.longest_match(a) == {"r0": 3}
