"""`prefixflow bench soak`'s pure parts: the memory checks, the streamed input generator,
the part-count expectation and the output check."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.bench import soak

pytestmark = pytest.mark.unit


def test_flat_allows_ten_percent_growth_after_warm_up_and_any_shrinking():
    assert soak.is_flat(100.0, 110.0)
    assert not soak.is_flat(100.0, 110.5)
    assert soak.is_flat(100.0, 40.0)  # freed memory is no leak
    assert soak.is_flat(None, 50.0) is None and soak.is_flat(50.0, None) is None
    assert soak.is_flat(100.0, 120.0, tolerance=0.25)


def test_verdicts_check_every_process_for_flatness_and_the_limit():
    procs = {
        "sink": {"peak_rss_mib": 300.0, "last_rss_mib": 260.0, "peak_after_warm_mib": 300.0, "rss_mib_at": {"10%": 250.0}},
        "nats": {"peak_rss_mib": 1600.0, "last_rss_mib": 1600.0, "rss_mib_at": {"10%": 200.0}},
        "router": {"peak_rss_mib": 100.0, "last_rss_mib": 100.0, "rss_mib_at": {}},  # the job ended before 10 %
    }
    v = soak.verdicts(procs)
    assert v["per_process"]["sink"] == {"flat": True, "peak_after_warm_over_warm": 1.2, "under_limit": True}
    assert v["per_process"]["nats"] == {"flat": False, "peak_after_warm_over_warm": None, "under_limit": False}
    assert v["per_process"]["router"] == {"flat": None, "peak_after_warm_over_warm": None, "under_limit": True}
    assert not v["all_flat"] and not v["all_under_limit"]
    assert soak.verdicts({"sink": procs["sink"], "router": procs["router"]}) == {
        "per_process": {"sink": {"flat": True, "peak_after_warm_over_warm": 1.2, "under_limit": True},
                        "router": {"flat": None, "peak_after_warm_over_warm": None, "under_limit": True}},
        "all_flat": True, "all_under_limit": True,
    }


def test_expected_files_is_one_part_per_128_mib_started():
    mib = 2**20
    assert soak.expected_files(0) == 1
    assert soak.expected_files(100 * mib) == 1
    assert soak.expected_files(128 * mib) == 2
    assert soak.expected_files(10 * 1024 * mib) == 81
    assert soak.expected_files(300, part_bytes=100) == 4


def test_input_is_streamed_in_row_groups_and_deterministic(tmp_path, monkeypatch):
    sizes: list[int] = []
    real = soak.input_batch

    def spy(start, rows, *a, **kw):
        sizes.append(rows)
        return real(start, rows, *a, **kw)

    monkeypatch.setattr(soak, "input_batch", spy)
    a = soak.generate_input(tmp_path / "a.parquet", 2500, prompt_len=16, prefix_len=8, num_prefixes=4, rows_per_group=1000)
    assert sizes == [1000, 1000, 500]  # never more than one row group in memory
    meta = pq.read_metadata(tmp_path / "a.parquet")
    assert a["row_groups"] == meta.num_row_groups == 3 and meta.num_rows == 2500
    assert [meta.row_group(i).num_rows for i in range(3)] == [1000, 1000, 500]

    soak.generate_input(tmp_path / "b.parquet", 2500, prompt_len=16, prefix_len=8, num_prefixes=4, rows_per_group=1000)
    ta, tb = pq.read_table(tmp_path / "a.parquet"), pq.read_table(tmp_path / "b.parquet")
    assert ta.equals(tb)
    assert ta.schema == pa.schema([("id", pa.int64()), ("prompt_token_ids", pa.list_(pa.int32()))])
    assert ta.column("id").to_pylist() == list(range(2500))
    rows = ta.column("prompt_token_ids").to_pylist()
    assert all(len(r) == 16 and all(soak.TOKEN_RANGE[0] <= t < soak.TOKEN_RANGE[1] for t in r) for r in rows)
    prefixes = {tuple(r[:8]) for r in rows}
    assert len(prefixes) <= 4  # shared prefixes: bucketing has something to group
    assert len({tuple(r[8:]) for r in rows}) == 2500  # unique suffixes

    soak.generate_input(tmp_path / "c.parquet", 2500, prompt_len=16, prefix_len=8, num_prefixes=4, rows_per_group=1000, seed=1)
    assert not pq.read_table(tmp_path / "c.parquet").equals(ta)
    assert not list(tmp_path.glob("*.tmp"))


def test_generate_input_rejects_a_prefix_as_long_as_the_prompt(tmp_path):
    with pytest.raises(ValueError):
        soak.generate_input(tmp_path / "x.parquet", 10, prompt_len=8, prefix_len=8)


def test_check_output_counts_rows_duplicates_and_strays(tmp_path):
    pq.write_table(pa.table({"id": pa.array([0, 1, 2], pa.int64()), "output": ["a", "b", "c"]}), tmp_path / "part-000000.parquet")
    pq.write_table(pa.table({"id": pa.array([3, 4], pa.int64()), "output": ["d", "e"]}), tmp_path / "part-000001.parquet")
    (tmp_path / "_summary.json").write_text("{}")
    ok = soak.check_output(tmp_path, 5)
    assert ok["files"] == 2 and ok["expected_files"] == 1 and ok["rows"] == 5
    assert ok["rows_ok"] and ok["ids_ok"] and ok["unique_ids"] == 5 and ok["duplicate_ids"] == 0

    pq.write_table(pa.table({"id": pa.array([4, 9], pa.int64()), "output": ["e", "x"]}), tmp_path / "part-000002.parquet")
    bad = soak.check_output(tmp_path, 5)
    assert bad["rows"] == 7 and not bad["rows_ok"] and not bad["ids_ok"]
    assert bad["duplicate_ids"] == 1 and bad["ids_outside"] == 1 and bad["unique_ids"] == 5


def test_downsample_keeps_the_ends_and_bounds_the_length():
    pts = list(range(1001))
    d = soak.downsample(pts, keep=100)
    assert d[0] == 0 and d[-1] == 1000 and len(d) <= 101
    assert soak.downsample([1, 2, 3], keep=100) == [1, 2, 3]
