"""`prefixflow bench peers`: the pure parts (per-row lengths, result parsing, medians, the
ratio table) and the peer runners' own pure helpers. Needs neither the peers' virtualenv
nor an engine: the runners import Daft, Ray and vLLM only inside `main`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.bench import peer_runs as bp

pytestmark = pytest.mark.unit

sys.path.insert(0, str(bp.PEERS_DIR))
import common as peer_common  # prefixflow/bench/peers, on the path just above
import daft_hook
import daft_provider


def run(method: str, round_: int = 0, run_seconds: float = 10.0, wall_seconds: float = 40.0, hit_rate: float = 0.5) -> bp.Run:
    return bp.Run(method=method, round=round_, rows=64, errors=0, prompt_tokens=1000, cached_tokens=int(1000 * hit_rate),
                  output_tokens=2048, hit_rate=hit_rate, run_seconds=run_seconds, wall_seconds=wall_seconds)


# --- per-row lengths ---------------------------------------------------------------------


def test_lengths_come_from_the_sampling_column_first():
    cols = {"sampling": [{"max_tokens": 7, "min_tokens": 3}, None], "max_tokens": [9, 9], "output_len": [5, 6]}
    assert bp.row_lengths(cols, 128, 0) == ([7, 9], [3, 0])


def test_output_len_is_a_fixed_length():
    assert bp.row_lengths({"output_len": [32, 16]}, 128, 0) == ([32, 16], [32, 16])


def test_rows_without_lengths_get_the_flags():
    assert bp.row_lengths({"id": [1, 2, 3]}, 64, 8) == ([64] * 3, [8] * 3)


@given(st.lists(st.tuples(st.integers(1, 512), st.integers(0, 600)), min_size=1, max_size=30))
def test_min_never_exceeds_max(pairs):
    cols = {"max_tokens": [a for a, _ in pairs], "min_tokens": [b for _, b in pairs]}
    hi, lo = bp.row_lengths(cols, 128, 0)
    assert len(hi) == len(lo) == len(pairs)
    assert all(0 <= m <= x for x, m in zip(hi, lo))
    assert hi == [a for a, _ in pairs]
    mhi, mlo = bp.mean_lengths(hi, lo)  # --mean-lengths: one setting, the same total within rounding
    assert len(set(mhi)) == len(set(mlo)) == 1 and 0 <= mlo[0] <= mhi[0]
    assert abs(sum(mhi) - sum(hi)) <= len(hi) / 2


def test_inputs_carry_the_same_rows_to_every_method(tmp_path):
    varied = pa.table({"id": [10, 11, 12], "prompt": ["a b", "a c", "d"],
                       "sampling": pa.array([{"max_tokens": 4, "min_tokens": 4}, {"max_tokens": 8, "min_tokens": 2},
                                             {"max_tokens": 4, "min_tokens": 4}])})
    pq.write_table(varied, tmp_path / "varied.parquet")
    info = bp.prepare_inputs(tmp_path / "varied.parquet", tmp_path / "w1", 128, 0)
    peers = pq.read_table(tmp_path / "w1" / "peers.parquet").to_pylist()
    own = pq.read_table(tmp_path / "w1" / "prefixflow.parquet").to_pylist()
    assert [r["id"] for r in peers] == [r["id"] for r in own] == [10, 11, 12]
    assert [(r["max_tokens"], r["min_tokens"]) for r in peers] == [(4, 4), (8, 2), (4, 4)]
    assert [r["sampling"] for r in own] == [{"max_tokens": 4, "min_tokens": 4}, {"max_tokens": 8, "min_tokens": 2},
                                            {"max_tokens": 4, "min_tokens": 4}]
    assert info["uniform_lengths"] is None and info["output_tokens_asked"] == 16

    # --mean-lengths: every method gets the rows' rounded means (Daft's provider's one setting)
    info = bp.prepare_inputs(tmp_path / "varied.parquet", tmp_path / "w3", 128, 0, mean=True)
    assert info["uniform_lengths"] == (5, 3) and info["output_tokens_asked"] == 15
    assert [(r["max_tokens"], r["min_tokens"]) for r in pq.read_table(tmp_path / "w3" / "peers.parquet").to_pylist()] == [(5, 3)] * 3
    assert pq.read_table(tmp_path / "w3" / "prefixflow.parquet").column_names == ["id", "prompt"]  # lengths go as flags

    fixed = pa.table({"id": [0, 1], "prompt": ["x", "y"], "output_len": pa.array([32, 32], pa.int32())})
    pq.write_table(fixed, tmp_path / "fixed.parquet")
    info = bp.prepare_inputs(tmp_path / "fixed.parquet", tmp_path / "w2", 128, 0)
    assert info["uniform_lengths"] == (32, 32)
    assert pq.read_table(tmp_path / "w2" / "prefixflow.parquet").column_names == ["id", "prompt"]  # lengths go as flags


# --- parsing -----------------------------------------------------------------------------


def test_peer_result_is_the_last_marker_line():
    noise = "INFO vllm started\nPEER_RESULT {\"rows\": 1}\n(pid=3) PEER_RESULT not mine\nPEER_RESULT {\"rows\": 2}\nbye\n"
    assert bp.parse_peer_output(noise) == {"rows": 2}
    with pytest.raises(ValueError):
        bp.parse_peer_output("Traceback (most recent call last):\n")


def test_marker_matches_the_runners():
    assert bp.RESULT_MARKER == peer_common.RESULT_MARKER


def test_runner_result_line_round_trips(capsys):
    peer_common.emit({"method": "vllm-sorted", "rows": 3, **peer_common.token_totals(300, 150, 30)})
    parsed = bp.parse_peer_output(capsys.readouterr().out)
    assert parsed["rows"] == 3 and parsed["hit_rate"] == 0.5 and "python" in parsed["versions"]


def test_prefixflow_summary_and_startup_line():
    summary = {"rows": 64, "errors": 0, "prompt_tokens": 24576, "cached_tokens": 14336, "output_tokens": 2048,
               "prefix_cache_hit_rate": 0.5833, "wall_seconds": 12.5, "replicas": {"r0": {"prefix_cache_hit_rate": 0.6}}}
    stdout = "starting local cluster ...\n2 replicas ready in 31.4 s (not counted in the job's wall time)\n"
    got = bp.parse_prefixflow(summary, stdout)
    assert got["run_seconds"] == 12.5 and got["startup_seconds"] == 31.4 and got["hit_rate"] == 0.5833
    assert got["extra"] == {"replicas": {"r0": 0.6}}
    assert bp.parse_prefixflow(summary, "")["startup_seconds"] is None


def test_preemptions_and_output_token_costs_from_the_engines_line_run_prints():
    """`prefixflow run` prints the engines' line from their last statuses
    (`prefixflow.client.progress.engines_note`); the benchmark reads it back."""
    from prefixflow.client.progress import FleetProgress, engines_note
    from prefixflow.shared.wire import messages as m

    fleet = FleetProgress()
    fleet.update(m.EngineStatus("r0", 1.0, preemptions=36, decode_cost=11.394), 1.0)
    fleet.update(m.EngineStatus("r1", 1.0, preemptions=50, decode_cost=12.6), 1.0)
    fleet.update(m.EngineStatus("r2", 1.0), 1.0)  # reported nothing (an echo engine): left out
    stdout = f"2 replicas ready in 31.4 s\n{engines_note(fleet)}\n"
    assert engines_note(fleet) == ("engines: r0 36 preempted, an output token costs 11.39 prompt tokens; "
                                   "r1 50 preempted, an output token costs 12.60 prompt tokens")
    assert bp.parse_engines(stdout) == (86, {"r0": 11.39, "r1": 12.6})
    summary = {"rows": 8, "errors": 0, "prompt_tokens": 80, "cached_tokens": 0, "output_tokens": 8,
               "prefix_cache_hit_rate": 0.0, "wall_seconds": 4.0, "replicas": {}}
    assert bp.parse_prefixflow(summary, stdout)["preemptions"] == 86
    assert bp.parse_prefixflow(summary, "")["preemptions"] is None
    fleet.update(m.EngineStatus("r0", 2.0, preemptions=0), 2.0)
    assert bp.parse_engines(engines_note(fleet))[0] == 50
    assert engines_note(FleetProgress()) == ""


def test_prefixflow_time_without_start_up_counts_from_the_last_replica_ready():
    """The job is submitted while the engines start: what ran before the last one was
    ready is not counted (as for Daft), and the time from the job's creation is kept."""
    summary = {"rows": 8, "errors": 0, "prompt_tokens": 80, "cached_tokens": 0, "output_tokens": 8,
               "prefix_cache_hit_rate": 0.0, "wall_seconds": 40.0, "replicas": {}}
    stdout = ("services ready in 2.0 s: ...\nr1 ready in 26.5 s: it takes work now\nr0 ready in 31.4 s: it takes work now\n"
              "2 replicas ready in 31.5 s (the job was submitted at 2.5 s)\n")
    got = bp.parse_prefixflow(summary, stdout)
    assert got["startup_seconds"] == 31.5 and got["run_seconds"] == 11.0
    assert got["extra"]["run_seconds_from_first_engine"] == 16.0  # from r1 ready
    # Every replica ready before the job was submitted: nothing overlapped.
    late = bp.parse_prefixflow(summary, "2 replicas ready in 31.5 s (the job was submitted at 35.0 s)\n")
    assert late["run_seconds"] == 40.0 and "run_seconds_from_first_engine" not in late["extra"]


# --- medians and ratios ------------------------------------------------------------------


def test_medians_per_method_over_rounds():
    runs = [run("prefixflow", k, run_seconds=s) for k, s in enumerate((12.0, 10.0, 30.0))]
    runs += [run("vllm-sorted", k, run_seconds=s) for k, s in enumerate((9.0, 11.0))]
    med = bp.medians(runs)
    assert list(med) == ["prefixflow", "vllm-sorted"]
    assert med["prefixflow"]["run_seconds"] == 12.0 and med["prefixflow"]["rounds"] == 3
    assert med["vllm-sorted"]["run_seconds"] == 10.0  # even count: the mean of the middle two


def test_ratio_against_the_best_peer_per_column():
    runs = [run("prefixflow", run_seconds=9.0, wall_seconds=50.0), run("daft-ray", run_seconds=10.0, wall_seconds=70.0),
            run("vllm-sorted", run_seconds=12.0, wall_seconds=40.0)]
    rows = {r["method"]: r for r in bp.ratio_table(bp.medians(runs))}
    assert rows["prefixflow"]["run_seconds_vs_best_peer"] == 0.9
    assert rows["prefixflow"]["best_peer_run_seconds"] == "daft-ray"
    assert rows["prefixflow"]["wall_seconds_vs_best_peer"] == 1.25
    assert rows["prefixflow"]["best_peer_wall_seconds"] == "vllm-sorted"


def test_no_peer_no_ratio():
    rows = bp.ratio_table(bp.medians([run("prefixflow"), run("prefixflow-round-robin")]))
    assert all(r["run_seconds_vs_best_peer"] is None for r in rows)


@given(st.dictionaries(st.sampled_from(bp.METHODS), st.floats(0.5, 500, allow_nan=False), min_size=1))
def test_best_peer_is_one_and_no_peer_beats_it(times):
    rows = bp.ratio_table(bp.medians([run(m, run_seconds=t) for m, t in times.items()]))
    peer_ratios = [r["run_seconds_vs_best_peer"] for r in rows if r["method"] in bp.PEER_METHODS]
    if peer_ratios:
        assert min(peer_ratios) == 1.0
        assert all(x >= 1.0 for x in peer_ratios)
    else:
        assert all(r["run_seconds_vs_best_peer"] is None for r in rows)


def test_ideal_hit_rate_at_the_engines_block_size():
    meta = {"ideal_hit_rate": {"16": {"formula": 0.61, "exact": 0.6}, "128": {"formula": 0.55, "exact": 0.5}}}
    assert bp.ideal_hit_rate(meta, 128) == 0.5
    assert bp.ideal_hit_rate(meta, 64) is None
    assert bp.ideal_hit_rate({}, 128) is None


# --- the runners' pure helpers ----------------------------------------------------------


def test_core_sets_one_per_engine():
    assert daft_provider.core_sets([0, 1], 2) == ["0", "1"]
    assert daft_provider.core_sets([0, 1, 2, 3], 2) == ["0-1", "2-3"]
    assert daft_provider.core_sets([0, 1], 3) == ["0", "1", "0"]
    assert daft_provider.core_sets([0, 1], 1) == ["0-1"]


def test_daft_gets_one_sampling_and_says_so_when_rows_differ():
    rows = [{"id": 0, "max_tokens": 32, "min_tokens": 32}, {"id": 1, "max_tokens": 32, "min_tokens": 32}]
    assert daft_provider.uniform_sampling(rows) == (rows[0], None)
    rows[1] = {"id": 1, "max_tokens": 64, "min_tokens": 0}
    row, note = daft_provider.uniform_sampling(rows)
    assert (row["max_tokens"], row["min_tokens"]) == (48, 16) and "one SamplingParams" in note


@given(st.lists(st.tuples(st.integers(1, 512), st.integers(0, 512)), min_size=1, max_size=30))
def test_mean_lengths_give_every_method_what_the_daft_runner_runs(pairs):
    """`bench peers --mean-lengths` (product venv) and the Daft runner (peers venv, which
    cannot import the product) compute the same means: this keeps the two equal."""
    hi, lo = bp.row_lengths({"max_tokens": [a for a, _ in pairs], "min_tokens": [b for _, b in pairs]}, 128, 0)
    rows = [{"id": i, "max_tokens": a, "min_tokens": b} for i, (a, b) in enumerate(zip(hi, lo))]
    row, _ = daft_provider.uniform_sampling(rows)
    mhi, mlo = bp.mean_lengths(hi, lo)
    assert (mhi[0], mlo[0]) == (row["max_tokens"], row["min_tokens"])


def test_each_engine_claims_its_own_cores(tmp_path):
    held = len(daft_hook._held)
    try:
        assert daft_hook.claim(tmp_path, ["0", "1"]) == "0"
        assert daft_hook.claim(tmp_path, ["0", "1"]) == "1"  # the first lock is still held
        with pytest.raises(RuntimeError):
            daft_hook.claim(tmp_path, ["0", "1"])
    finally:
        while len(daft_hook._held) > held:
            os.close(daft_hook._held.pop())
    assert daft_hook.claim(tmp_path, ["0", "1"]) == "0"  # released with its process (here: its fd)
    os.close(daft_hook._held.pop())


def test_engine_records_in_ready_order(tmp_path):
    lines = [{"pid": 2, "cores": "1", "started": 0.0, "ready": 9.0}, {"pid": 1, "cores": "0", "started": 0.0, "ready": 7.0}]
    (tmp_path / daft_hook.RECORDS).write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r["pid"] for r in daft_hook.records(tmp_path)] == [1, 2]
    assert daft_hook.records(Path(tmp_path) / "absent") == []


def test_vllm_cpu_bind_syntax():
    assert peer_common.id_list([0, 1]) == "0-1"
    assert peer_common.id_list([3]) == "3"
    assert peer_common.id_list([0, 2]) == "0,2"
