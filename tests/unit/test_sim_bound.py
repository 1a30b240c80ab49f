"""`prefixflow.sim.cluster.work_bound`: the earliest end of a run's engine work spread perfectly over
replicas that come up at different times (the simulator's "bound s" column)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.sim.cluster import Options, simulate, work_bound
from prefixflow.sim.cost import load_profile
from prefixflow.sim.workload import prefix_repetition

pytestmark = pytest.mark.unit

starts = st.lists(st.floats(0, 500, allow_nan=False), min_size=1, max_size=64)
work = st.floats(0, 1e5, allow_nan=False)


@given(starts, work)
def test_the_bound_spends_exactly_the_work(up, busy):
    t = work_bound(up, busy)
    assert t >= min(up)
    assert sum(max(0.0, t - s) for s in up) == pytest.approx(busy, rel=1e-9, abs=1e-6)


@given(starts, work, st.floats(0, 1e4, allow_nan=False))
def test_more_work_or_later_replicas_never_end_earlier(up, busy, more):
    t = work_bound(up, busy)
    assert work_bound(up, busy + more) >= t - 1e-9
    assert work_bound([s + 1.0 for s in up], busy) == pytest.approx(t + 1.0)


def test_all_up_together_share_the_work_evenly():
    assert work_bound([10.0] * 4, 100.0) == 35.0
    assert work_bound([0.0, 100.0], 50.0) == 50.0  # the second replica comes up too late to help
    assert work_bound([0.0, 10.0], 50.0) == 30.0


def test_a_simulated_run_ends_no_earlier_than_its_bound():
    wl = prefix_repetition(num_prompts=2000, prefix_len=256, suffix_len=128, num_prefixes=40, output_len=32, seed=1)
    profile = load_profile("l4-8b")
    for method in ("daft", "prefix-aware"):
        r = simulate(wl, profile, 8, method, Options(stagger=(5.0, 20.0))).row()
        assert r["wall_seconds"] >= r["bound_seconds"] - 1e-6, r
        assert r["bound_seconds"] > 0.5 * r["wall_seconds"], r  # a bound of the run, not a trivial one
