"""The sink's id set behaves exactly like a set of ids that keep their type (5 and "5"
are two ids: issue 39, item 1)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared.wire import ids as ids_module
from prefixflow.shared.wire.ids import CHUNK, IdSet

pytestmark = pytest.mark.unit

ids = st.one_of(
    st.integers(-5, 3 * CHUNK),
    st.integers(0, 2**64),
    st.sampled_from(["0", "00", "1", "01", "-1", "a", "", "١٢", str(2**62), str(CHUNK)]),
    st.text(max_size=4),
)


def key(pid) -> tuple[bool, str]:
    """An id as the model keeps it: its text and whether it is an integer."""
    return isinstance(pid, int), str(pid)


@given(st.lists(ids, max_size=200), st.lists(ids, max_size=50))
def test_matches_a_set_of_typed_ids(added, probes):
    model: set[tuple[bool, str]] = set()
    s = IdSet()
    for pid in added:
        assert s.add(pid) == (key(pid) not in model)
        model.add(key(pid))
        assert len(s) == len(model)
    for pid in added + probes:
        assert (pid in s) == (key(pid) in model)


def test_an_int_id_and_its_text_are_two_ids():
    s = IdSet()
    for pid in (5, "5", -1, "-1", 2**63, str(2**63)):
        assert s.add(pid)
    assert len(s) == 6 and 5 in s and "5" in s and "6" not in s


def test_int_ids_use_little_memory():
    s = IdSet()
    s.update(range(200_000))
    assert len(s) == 200_000 and 199_999 in s and "199999" not in s and 200_000 not in s
    assert len(s._sorted) == 0 and not s._new and sum(len(c) for c in s._chunks.values()) <= 4 * CHUNK // 8


# --- string ids: digests in a sorted array plus small buffers --------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), ids),
        st.tuples(st.just("discard"), ids),
        st.tuples(st.just("contains"), ids),
        st.tuples(st.just("update"), st.lists(ids, max_size=12)),
    ),
    max_size=120,
)


@pytest.mark.parametrize("merge_every", [1, 3, 4096])
@given(program=ops)
def test_add_discard_update_match_a_set_model(merge_every, program):
    # merge_every: how many digests are buffered before a merge (1: every add merges)
    with mock.patch.object(ids_module, "MIN_MERGE", merge_every):
        model: dict[tuple[bool, str], object] = {}
        s = IdSet()
        for op, arg in program:
            if op == "add":
                assert s.add(arg) == (key(arg) not in model)
                model[key(arg)] = arg
            elif op == "discard":
                s.discard(arg)
                model.pop(key(arg), None)
            elif op == "update":
                s.update(arg)
                model.update((key(a), a) for a in arg)
            else:
                assert (arg in s) == (key(arg) in model)
            assert len(s) == len(model)
        assert s == set(model.values())
        for pid in model.values():
            assert pid in s


@given(st.lists(st.integers(-3, 3 * CHUNK), max_size=300), st.lists(st.integers(0, 3 * CHUNK), max_size=50))
def test_update_from_an_int_array_matches_adding_one_by_one(values, before):
    one, many = IdSet(), IdSet()
    for v in before + values:
        one.add(v)
    many.update(before)
    many.update(np.array(values, np.int64))
    assert len(one) == len(many) == len(set(before + values))
    assert all(v in many for v in before + values) and not any(str(v) in many for v in values)


def test_update_many_strings_at_once_matches_a_set():
    s = IdSet()
    first = [f"doc-{i}" for i in range(10_000)]
    s.update(first)
    s.discard("doc-5")
    s.update([f"doc-{i}" for i in range(5_000, 15_000)] + ["7", 7, "doc-5"])  # overlaps, revives doc-5
    assert len(s) == 15_002 and "doc-5" in s and "doc-14999" in s and "doc-15000" not in s and "7" in s and 7 in s
    assert not s.add("doc-0") and s.add("doc-15000")


def test_string_ids_use_about_12_bytes_each():
    s = IdSet()
    n = 200_000
    s.update(f"row-{i:08d}-{'x' * 20}" for i in range(n))
    for i in range(n, n + 50_000):  # one at a time: through the buffer and its merges
        s.add(f"row-{i:08d}")
    n += 50_000
    assert len(s) == n and "row-00000000-xxxxxxxxxxxxxxxxxxxx" in s and "row-00249999" in s
    assert s.nbytes() <= 13 * n + 80 * ids_module.MIN_MERGE
    assert s.nbytes() <= 15 * n
