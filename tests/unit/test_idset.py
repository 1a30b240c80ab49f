"""The sink's id set behaves exactly like a set of ids compared as text."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.wire.ids import CHUNK, IdSet

pytestmark = pytest.mark.unit

ids = st.one_of(
    st.integers(-5, 3 * CHUNK),
    st.integers(0, 2**64),
    st.sampled_from(["0", "00", "1", "01", "-1", "a", "", "١٢", str(2**62), str(CHUNK)]),
    st.text(max_size=4),
)


@given(st.lists(ids, max_size=200), st.lists(ids, max_size=50))
def test_matches_a_set_of_strings(added, probes):
    model: set[str] = set()
    s = IdSet()
    for pid in added:
        assert s.add(pid) == (str(pid) not in model)
        model.add(str(pid))
        assert len(s) == len(model)
    for pid in added + probes:
        assert (pid in s) == (str(pid) in model)


def test_int_ids_use_little_memory():
    s = IdSet()
    s.update(range(200_000))
    assert len(s) == 200_000 and 199_999 in s and "199999" in s and 200_000 not in s
    assert len(s._other) == 0 and sum(len(c) for c in s._chunks.values()) <= 4 * CHUNK // 8
