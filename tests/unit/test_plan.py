"""`prefixflow plan`'s pure parts: fleet and price parsing, the reservoir sample, how a
sample stands for the input (`prefixflow/sim/plan.py`) and the workload's limit
(`prefixflow/sim/limit.py`)."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared.outcomes import CommandError
from prefixflow.sim import plan as P
from prefixflow.sim.cluster import Options, simulate
from prefixflow.sim.cost import load_profile
from prefixflow.sim.cluster import replica_ready_times
from prefixflow.sim.limit import ideal_prefill_tokens, workload_limit
from prefixflow.planner.sample import Reservoir
from prefixflow.sim.workload import prefix_repetition


@pytest.mark.parametrize(("text", "want"), [
    ("16xL4", (16, "L4", "l4-8b")), ("8xh100", (8, "H100", "h100-8b")), (" 2 x CPU ", (2, "CPU", "cpu-tiny")),
    ("4*L4", (4, "L4", "l4-8b")), ("3xl4-8b", (3, "l4-8b", "l4-8b")),
])
def test_fleets_parse_to_the_simulators_profiles(text, want):
    f = P.parse_fleet(text)
    assert (f.replicas, f.gpu, f.profile) == want
    assert f.load().name == want[2]


@pytest.mark.parametrize("text", ["16xA100", "L4", "0xL4", "16x", "x16L4"])
def test_a_bad_fleet_is_a_usage_error_naming_the_known_gpus(text):
    with pytest.raises(CommandError) as err:
        P.parse_fleet(text)
    assert err.value.code == 2
    if "A100" in text:
        assert "L4" in str(err.value) and "H100" in str(err.value) and "CPU" in str(err.value)


@pytest.mark.parametrize(("text", "want"), [("0.80/h", 0.8), ("$1.5/h", 1.5), ("2", 2.0), (".5/hour", 0.5)])
def test_prices_per_gpu_hour(text, want):
    assert P.parse_price(text) == want


def test_bad_prices_and_price_counts_are_usage_errors():
    with pytest.raises(CommandError):
        P.parse_price("cheap")
    fleets = [P.parse_fleet("16xL4"), P.parse_fleet("8xH100")]
    assert P.prices_for(fleets, []) == [None, None]
    assert P.prices_for(fleets, [1.0]) == [1.0, 1.0]
    assert P.prices_for(fleets, [1.0, 3.0]) == [1.0, 3.0]
    with pytest.raises(CommandError):
        P.prices_for(fleets, [1.0, 2.0, 3.0])


@given(st.lists(st.integers(1, 200), min_size=1, max_size=6), st.integers(1, 120), st.integers(0, 2**16))
def test_the_reservoir_keeps_min_k_n_distinct_items_in_stream_order(batches, k, seed):
    res = Reservoir(k, seed)
    for n in batches:
        base = res.seen
        for i, slot in res.offer(n):
            res.put(slot, base + i, base + i)  # the item is its index
    items = res.items()
    assert len(items) == min(k, sum(batches))
    assert items == sorted(set(items))
    assert all(0 <= x < sum(batches) for x in items)


def test_the_reservoir_is_uniform():
    counts = collections.Counter()
    for seed in range(400):
        res = Reservoir(5, seed)
        for n in (7, 3, 10):
            base = res.seen
            for i, slot in res.offer(n):
                res.put(slot, base + i, base + i)
        counts.update(res.items())
    # 20 items, 5 kept: each kept 1/4 of the time (400 draws -> 100 each)
    assert len(counts) == 20
    assert all(60 <= c <= 140 for c in counts.values()), counts


@given(st.integers(1, 10**6), st.integers(1, 20000), st.integers(1, 1024))
def test_a_sample_keeps_rows_per_replica(rows, sampled, replicas):
    sc = P.scale(rows, sampled, replicas)
    assert 1 <= sc.sample_replicas <= replicas
    assert 1 <= sc.sample_rows <= min(rows, max(sampled, 1))
    if sc.exact:
        assert sc.sample_replicas == replicas and sc.sample_rows == rows
    else:
        # the same rows per replica as the job, within a row's rounding
        assert abs(sc.sample_rows / sc.sample_replicas - rows / replicas) <= 1 / sc.sample_replicas + 1e-9 \
            or sc.sample_rows == sampled or sc.sample_replicas == 1
    assert "row" in sc.describe()


@given(st.floats(1, 1e5), st.integers(1, 1024), st.one_of(st.none(), st.floats(0.01, 50)))
def test_gpu_hours_are_wall_times_gpus_and_cost_is_hours_times_price(wall, gpus, price):
    fleet = P.Fleet(gpus, "L4", "l4-8b")
    p = P.predict(fleet, "naive", wall, 0.5, price)
    assert p.gpu_hours == pytest.approx(wall * gpus / 3600)
    assert p.cost == (None if price is None else pytest.approx(p.gpu_hours * price))


def test_a_scaled_profile_pays_once_per_input_work_for_every_row():
    sc = P.scale(200_000, 20_000, 128)
    base = load_profile("l4-8b")
    p = P.scaled_profile(base, sc)
    f = sc.rows / sc.sample_rows
    assert p.ingest_rate == pytest.approx(base.ingest_rate / f)
    assert p.sort_s_per_1k == pytest.approx(base.sort_s_per_1k * f)
    assert (p.c0, p.c_pf, p.kv_blocks) == (base.c0, base.c_pf, base.kv_blocks)


def test_the_ideal_computes_each_shared_block_once():
    wl = prefix_repetition(num_prompts=64, prefix_len=256, suffix_len=100, num_prefixes=4, output_len=8, seed=3)
    # 4 prefixes of 16 blocks computed once; every suffix (100 tokens) always
    assert ideal_prefill_tokens(wl, 16) == 4 * 256 + 64 * 100
    lim = workload_limit(wl, load_profile("l4-8b"), 4)
    assert lim.ideal_hit_rate == pytest.approx(1 - (4 * 256 + 64 * 100) / (64 * 356))


@pytest.mark.parametrize("seed", range(8))
def test_no_method_beats_the_workloads_limit(seed):
    # Random shapes (a fixed set: each case simulates every method on two profiles).
    rng = np.random.default_rng(seed)
    n, prefixes, replicas, output = int(rng.integers(20, 200)), int(rng.integers(1, 12)), int(rng.integers(1, 8)), 32
    wl = prefix_repetition(num_prompts=n, prefix_len=128, suffix_len=64, num_prefixes=prefixes, output_len=output, seed=seed)
    wl.output_len = rng.integers(1, output + 1, size=n).astype(np.int32)
    for name in ("l4-8b", "cpu-tiny"):
        profile = load_profile(name)
        lim = workload_limit(wl, profile, replicas)
        for method in P.PLAN_METHODS:
            r = simulate(wl, profile, replicas, method, Options())
            assert lim.wall_seconds <= r.wall_seconds + 1e-6, (name, method, lim, r.wall_seconds)
            assert r.hit_rate <= lim.ideal_hit_rate + 1e-9
        assert lim.wall_seconds > 0.3 * min(simulate(wl, profile, replicas, m, Options()).wall_seconds
                                            for m in P.PLAN_METHODS)  # a bound, not a trivial one
        # A staggered fleet (`simulate --stagger`, the limit `simulate` prints): each GPU from when it is up.
        staggered = Options(stagger=(float(rng.uniform(0, 30)), float(rng.uniform(30, 120))))
        slim = workload_limit(wl, profile, replicas, replica_ready_times(profile, staggered, replicas))
        assert slim.wall_seconds >= lim.wall_seconds - 1e-9 or min(staggered.stagger) < profile.startup_s
        for method in P.PLAN_METHODS:
            r = simulate(wl, profile, replicas, method, staggered)
            assert slim.wall_seconds <= r.wall_seconds + 1e-6, (name, method, "staggered", slim, r.wall_seconds)


@given(st.integers(1, 64), st.integers(1, 100_000))
def test_the_calibration_job_fills_the_replicas_and_stays_short_of_the_input(replicas, rows):
    """192 rows per replica (a replica's window fills as in a long job), never more than half
    the input when that is larger than the 96-row floor, never more rows than there are."""
    from prefixflow.planner.calibrate import MIN_ROWS, ROWS_PER_REPLICA, calibration_rows

    n = calibration_rows(replicas, rows)
    assert 1 <= n <= rows
    assert n >= min(MIN_ROWS, rows)
    assert n <= max(rows // 2, min(MIN_ROWS, rows))
    if rows >= 2 * ROWS_PER_REPLICA * replicas:
        assert n == ROWS_PER_REPLICA * replicas
