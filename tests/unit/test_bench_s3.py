"""`prefixflow bench s3`'s pure parts: the input split into shards (ids in order across
them, every row once) and the medians of interleaved rounds."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from prefixflow.bench import object_store, soak


@pytest.mark.parametrize("n,group,shards", [(1000, 100, 4), (1000, 300, 4), (50, 100, 4), (1000, 100, 1)])
def test_shards_hold_every_row_once_in_order(tmp_path, n, group, shards):
    single = tmp_path / "in.parquet"
    soak.generate_input(single, n, rows_per_group=group, prompt_len=8, prefix_len=4, num_prefixes=3)
    files = object_store.split_shards(single, shards, tmp_path / "shards")
    groups = -(-n // group)
    assert len(files) == min(shards, groups) and files == sorted(files)
    ids = [i for f in files for i in pq.read_table(f).column("id").to_pylist()]
    assert ids == list(range(n))
    assert [pq.read_table(f).equals(pq.read_table(single).slice(0, 0)) for f in files] == [False] * len(files)


def test_medians_of_rounds():
    def row(job, rate, run_peak, sink_peak):
        return {"job_s": job, "run_s": job + 5, "prompts_per_s": rate, "peak_rss_mib": {"run": run_peak, "sink": sink_peak},
                "cpu_s": {"run": 1.0, "sink": None}}

    rounds = [{"local": row(10, 100, 200, 150), "s3": row(20, 50, 210, 160)},
              {"local": row(12, 80, 220, 140), "s3": row(30, 40, 190, 180)},
              {"local": row(11, 90, 210, 145), "s3": row(25, 45, 200, 170)}]
    m = object_store.medians(rounds, "s3")
    assert (m["job_s"], m["prompts_per_s"], m["run_s"]) == (25, 45, 30)
    assert m["peak_rss_mib"] == {"run": 200, "sink": 170} and m["cpu_s"] == {"run": 1.0, "sink": None}
    assert object_store.medians(rounds, "local")["prompts_per_s"] == 90
