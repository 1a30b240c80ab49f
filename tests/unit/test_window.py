"""The in-flight window (`prefixflow/client/window.py`): a publisher runs at most `limit` rows ahead
of what the sink accounts for, and never waits for good."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.client.window import STALL_SECONDS, Window
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit


def test_waits_for_the_sink_to_catch_up():
    w = Window(1000)
    w.observe(0, 0.0)
    assert w.may_send(600, 0.0)
    w.sent += 600
    assert not w.may_send(600, 1.0)  # 1,200 would be in flight
    w.observe(300, 1.5)  # 300 written
    assert w.in_flight() == 300 and w.may_send(600, 2.0)


def test_counts_from_what_was_written_before_it_started():
    w = Window(100)
    w.observe(5000, 0.0)  # a resume: 5,000 rows were on disk already
    w.sent += 100
    assert w.in_flight() == 100 and not w.may_send(1, 0.5)
    w.observe(5060, 1.0)
    assert w.in_flight() == 40 and w.may_send(60, 1.0)


def test_a_sink_that_counts_afresh_lowers_the_base():
    w = Window(100)
    w.observe(5000, 0.0)
    w.sent += 100
    w.observe(10, 1.0)  # output replaced, or duplicates counted from 0 by a restarted sink
    assert w.base == 10 and w.in_flight() == 100
    w.observe(110, 2.0)
    assert w.in_flight() == 0


def test_a_chunk_larger_than_the_window_goes_when_nothing_is_in_flight():
    w = Window(10)
    w.observe(0, 0.0)
    assert w.may_send(64, 0.0)
    w.sent += 64
    assert not w.may_send(64, 1.0)
    w.observe(64, 2.0)
    assert w.may_send(64, 2.0)


def test_a_stalled_count_lets_one_chunk_through_per_stall():
    w = Window(100)
    w.observe(0, 0.0)
    w.sent += 100
    assert not w.may_send(50, STALL_SECONDS - 1)
    assert w.may_send(50, STALL_SECONDS)  # nothing moved for STALL_SECONDS: go
    w.sent += 50
    assert not w.may_send(50, STALL_SECONDS + 1)  # the clock restarted
    assert w.may_send(50, 2 * STALL_SECONDS)


@THOROUGH
@given(limit=st.integers(1, 5000), steps=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000), st.floats(0, 40)), max_size=40))
def test_in_flight_stays_bounded_while_the_sink_keeps_up(limit, steps):
    """Sending only when allowed: never more than the limit in flight, except a single
    chunk sent with nothing in flight or after the sink's count stood still for
    STALL_SECONDS; and whatever the sink does, a chunk is allowed within STALL_SECONDS."""
    w, now, written, moved = Window(limit), 0.0, 0, 0.0
    w.observe(0, now)
    for rows, progress, dt in steps:
        now += dt
        if min(w.sent, written + progress) != written:
            written, moved = min(w.sent, written + progress), now
        w.observe(written, now)
        if w.may_send(rows, now):
            before = w.in_flight()
            w.sent += rows
            assert w.in_flight() <= limit or before == 0 or now - moved >= STALL_SECONDS
        assert 0 <= w.in_flight() <= w.sent
        assert copy.copy(w).may_send(rows, now + STALL_SECONDS + 1e-6)  # never waits for good
