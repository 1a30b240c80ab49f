"""prefixflow.report.analysis (prefix groups, split groups, misses) and prefixflow.report.job_report (the plots of a job's
output), on a synthetic job written by the sink's own writer."""

from __future__ import annotations

import random

import pyarrow.parquet as pq
import pytest

from prefixflow.report.analysis import engine_block_size, group_stats, group_table, prefix_groups
from prefixflow.report.job_report import bin_width, busy_intervals, idle_times, load, write_report
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def test_prefix_groups_by_first_block_with_their_shared_prefix():
    a = tk.pack([1] * 8 + [5, 6, 7])
    b = tk.pack([1] * 8 + [5, 9])
    c = tk.pack([2] * 8)
    short = tk.pack([1, 1])
    groups, shared = prefix_groups([a, c, b, short], block_size=4)
    assert groups == [0, 1, 0, None]
    assert shared == {0: 9, 1: 8}


def test_group_table_split_and_misses():
    rows = [(1, "r0", 0, 300, True), (2, "r0", 256, 300, True), (3, "r1", 128, 300, True), (4, "r1", 0, 300, False)]
    table = group_table(rows, {1: "g", 2: "g", 3: "g", 4: "g"}, {"g": 256})
    g = table["g"]
    assert g.prompts == 3 and g.split and g.misses == 2 and dict(g.replicas) == {"r0": 2, "r1": 1}
    assert g.hit_rate == pytest.approx(384 / 900)
    # the bench's view, from Result objects
    results = [m.Result(i, replica=r, cached_tokens=c, prompt_tokens=p, error=None if ok else "x") for i, r, c, p, ok in rows]
    assert group_stats(results, {1: 0, 2: 0, 3: 0, 4: 0}, 256) == (1, 2)


def test_engine_block_size_from_the_hits():
    assert engine_block_size([0, 256, 128, 384, 0]) == (128, True)
    assert engine_block_size([32, 48]) == (16, True)
    assert engine_block_size([0, 0], default=64) == (64, False)


def test_busy_intervals_merge_and_bins():
    import numpy as np

    assert busy_intervals(np.array([5.0, 0.0, 1.0, 9.0]), np.array([6.0, 2.0, 3.0, 9.5])) == [(0.0, 3.0), (5.0, 6.0), (9.0, 9.5)]
    assert bin_width(20) == 0.25 and bin_width(800) == 10 and bin_width(10**7) == 3600


def synthetic_job(tmp_path, tiny_model, *, with_start: bool, n_prefixes: int = 6, n: int = 240):
    """A job's output as the sink writes it: prefix groups mostly kept on one replica,
    one group split, r1 idle for a while in the middle."""
    from prefixflow.datagen.dataset import prefix_repetition

    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=n, prefix_len=256, suffix_len=32, num_prefixes=n_prefixes, seed=2)
    out = JobOutput("synth", tmp_path)
    kept = table.select(["prompt"])  # the input column the client keeps aside, joined by the sink
    rnd = random.Random(0)
    t0 = 1_700_000_000.0
    clock = {"r0": t0 + 0.5, "r1": t0 + 0.7}
    warm = set()
    for k, r in enumerate(table.to_pylist()):
        g = r["prefix_id"]
        rep = "r1" if g % 2 or (g == 2 and k % 4 == 0) else "r0"
        start = clock[rep] + (8.0 if rep == "r1" and k == n // 2 else 0.0)
        dur = rnd.uniform(0.1, 0.3)
        clock[rep] = start + dur / 3
        cached = 256 if (rep, g) in warm else 0
        warm.add((rep, g))
        out.add(m.Result(r["id"], b"", "o", m.FinishReason.LENGTH,
                         int(r["prompt_len"]), cached, 16, rep, None, f"b{g}-{k // 25}",
                         start if with_start else 0.0, start + dur, src=0, row=k))
        if k % 50 == 49:
            out.flush(lambda src: kept)
    out.add(m.error_result(n, "empty prompt"), finished_at=t0 + 1.0)
    out.flush(lambda src: kept)
    out.write_summary(m.JobSpec("synth", str(tmp_path), created_at=t0, total=n + 1, model=str(tiny_model)),
                      finished_at=max(clock.values()) + 0.3)
    return table


def test_report_of_a_synthetic_job(tmp_path, tiny_model):
    synthetic_job(tmp_path, tiny_model, with_start=True)
    index = write_report(tmp_path)
    report = tmp_path / "_report"
    assert index == report / "index.html"
    for name in ("throughput.png", "hit_rate.png", "idle.png", "bucket_sizes.png"):
        assert (report / name).read_bytes()[:4] == b"\x89PNG", name
    lines = (report / "groups.csv").read_text().splitlines()
    assert lines[0].startswith("group,first_id,prompts,prefix_tokens,replicas")
    groups = [line.split(",") for line in lines[1:]]
    assert len(groups) == 6 and sum(int(g[2]) for g in groups) == 240
    split = [g for g in groups if g[6] == "True"]
    assert len(split) == 1 and split[0][5].startswith("r0:") and "r1:" in split[0][5]
    assert all(int(g[3]) == 256 for g in groups)  # the shared prefix, block-aligned
    assert "estimated" not in index.read_text() and "bucket ids" not in index.read_text()
    assert pq.read_table(tmp_path).num_rows == 241  # the report does not disturb the output

    job = load(tmp_path)
    idle = {i.replica: i for i in idle_times(job)}
    gaps = [b[0] - a[1] for a, b in zip(idle["r1"].busy, idle["r1"].busy[1:])]
    assert max(gaps) >= 7.5 and idle["r1"].idle_seconds >= 7.5  # r1's gap in the middle
    assert len(idle["r0"].busy) == 1 and idle["r0"].busy[0][1] < job.t1 - 8.0  # r0 idles at the end
    assert not idle["r1"].estimated


def test_report_without_start_times_or_buckets_says_it_estimates(tmp_path, tiny_model):
    synthetic_job(tmp_path, tiny_model, with_start=False)
    # an output written before bucket ids: drop them
    import pyarrow as pa

    for part in tmp_path.glob("part-*.parquet"):
        t = pq.read_table(part)
        pq.write_table(t.set_column(t.column_names.index("bucket"), "bucket", pa.nulls(t.num_rows, pa.string())), part)
    html = write_report(tmp_path).read_text()
    assert "idle time is estimated" in html and "prefix-group sizes instead" in html
    job = load(tmp_path)
    assert all(i.estimated for i in idle_times(job))


def test_report_of_a_running_job_without_summary_and_prompts(tmp_path):
    out = JobOutput("j", tmp_path)
    for i in range(20):
        out.add(m.Result(i, prompt_tokens=10, cached_tokens=5, output_tokens=3, replica=f"r{i % 3}"), finished_at=100.0 + i / 10)
    out.flush()
    html = write_report(tmp_path, groups=False).read_text()
    assert "not finished" in html
    assert (tmp_path / "_report" / "throughput.png").exists()
