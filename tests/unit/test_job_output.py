"""prefixflow.services.sink.writer at job scale: small parts merged into files of a target size
(crash-safe, every row once), totals kept as parts are written (a summary reads no file),
and a reopened output that restores them from the files."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.services.sink import parts as files
from prefixflow.services.sink.writer import OUTPUT_TYPES, JobOutput
from prefixflow.shared.wire.messages import FinishReason, JobSpec, Result

pytestmark = pytest.mark.unit

TARGET = 64 << 10
SPEC = JobSpec("j", "out", created_at=1000.0)


@pytest.fixture(autouse=True)
def no_fsync(monkeypatch):
    """fsync costs ~7 ms on a test machine's disk and proves nothing here (a crash is
    simulated by what is left on disk, not by power loss)."""
    monkeypatch.setattr(os, "fsync", lambda fd: None)


def result(i: int, replica: str = "") -> Result:
    """Row `i`: every 7th an error; ~300 bytes of incompressible output."""
    replica = replica or f"r{i % 3}"
    if i % 7 == 0:
        return Result(i, finish_reason=FinishReason.ERROR, prompt_tokens=3, replica=replica, error=f"boom {i % 2}")
    return Result(
        i, output=os.urandom(150).hex(), finish_reason=FinishReason.LENGTH, prompt_tokens=10 + i % 5,
        cached_tokens=i % 4, output_tokens=5, replica=replica, finished_at=1000.0 + i, started_at=999.0 + i,
    )


def write(out: JobOutput, start: int, flushes: int, per_flush: int) -> int:
    """`flushes` parts of `per_flush` new rows (and a duplicate each); the next id."""
    i = start
    for _ in range(flushes):
        for _ in range(per_flush):
            assert out.add(result(i), finished_at=2000.0)
            i += 1
        assert not out.add(result(start))  # a redelivery
        assert out.flush() == per_flush
    return i


def ids_on_disk(d: Path) -> list:
    return pq.read_table(d).column("id").to_pylist()


def state(out: JobOutput) -> tuple:
    return out.rows, out.errors, out.tokens, len(out.seen), out.next_part


def test_many_small_flushes_end_in_about_bytes_over_target_files(tmp_path, monkeypatch):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    written: list[int] = []
    write_part = files.write_part

    def counting(table, out_dir, n):
        part = write_part(table, out_dir, n)
        written.append(files.data_bytes(part.path))
        return part

    monkeypatch.setattr(files, "write_part", counting)
    end = write(out, 0, 300, 7)
    small_bytes = sum(written)
    assert small_bytes > 10 * TARGET
    out.write_summary(SPEC)  # the tail is merged too
    got = out.parts()
    expected = small_bytes / TARGET + 1
    assert abs(len(got) - expected) <= 1.5, (len(got), expected)
    assert all(files.PART_NAME.fullmatch(p.name).group(2) for p in got)  # every file merged
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left
    ids = ids_on_disk(tmp_path)
    assert ids == list(range(end))  # every row once, in order
    first = pq.read_schema(got[0])
    for p in got:
        assert pq.read_schema(p) == first
        meta = pq.read_metadata(p)
        assert meta.num_row_groups <= 2  # tiny parts combined into row groups
    assert first.field("output").type == OUTPUT_TYPES["output"]
    assert out.rows == end and out.errors == sum(1 for i in range(end) if i % 7 == 0)


def test_a_file_is_merged_once_the_small_parts_hold_the_target(tmp_path):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    i = 0
    while len([p for p in out.parts() if "-" not in p.stem[5:]]) == len(out.parts()):
        i = write(out, i, 1, 40)  # ~12 KiB a part: the per-part overhead is small
    merged = [p for p in out.parts() if "-" in p.stem[5:]]
    assert len(merged) == 1 and merged[0].stat().st_size >= TARGET * 0.8
    assert len(out.parts()) == 1  # the small parts it replaced are gone
    assert ids_on_disk(tmp_path) == list(range(i))


def test_crash_leftovers_are_cleaned_on_reopen(tmp_path):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    end = write(out, 0, 60, 7)
    merged = [p for p in out.parts() if "-" in p.stem[5:]]
    assert merged
    first, last = (int(x) for x in merged[0].stem.split("-")[1:])
    # a crash between the merged file's rename and its small parts' deletion: one back
    stray = tmp_path / files.small_name(first + 1)
    pq.write_table(pq.read_table(merged[0]).slice(7, 7), stray)
    # a crash while writing: torn temporary files (old and new names)
    (tmp_path / f".{files.small_name(last + 500)}.tmp").write_bytes(b"PAR1 torn")
    (tmp_path / "part-000999.tmp").write_bytes(b"torn")
    before = state(out)

    again = JobOutput("j", tmp_path, target_bytes=TARGET)
    assert not stray.exists() and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert sorted(ids_on_disk(tmp_path)) == list(range(end))
    assert state(again) == before


def test_crash_while_a_merge_deletes_its_small_parts(tmp_path, monkeypatch):
    out = JobOutput("j", tmp_path, target_bytes=TARGET, compact_in_flush=False)
    end = write(out, 0, 40, 7)
    unlinked = []
    real_unlink = Path.unlink

    def crash_after_two(self, missing_ok=False):
        if len(unlinked) == 2:
            raise KeyboardInterrupt("crash")
        unlinked.append(self)
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        out.compact()
    monkeypatch.setattr(Path, "unlink", real_unlink)
    assert list(tmp_path.glob(".part-*.ready"))
    assert len(set(ids_on_disk(tmp_path))) == len(ids_on_disk(tmp_path))  # no row twice, ever

    again = JobOutput("j", tmp_path, target_bytes=TARGET)
    assert not list(tmp_path.glob(".part-*"))
    assert sorted(ids_on_disk(tmp_path)) == list(range(end))
    assert again.rows == end


def test_reopen_restores_totals_seen_and_summary(tmp_path):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    end = write(out, 0, 50, 6)
    before = out.summarize(SPEC, finished_at=5000.0)
    again = JobOutput("j", tmp_path, target_bytes=TARGET)
    assert state(again) == state(out)
    assert again.summarize(SPEC, finished_at=5000.0) == before
    assert before["rows"] == end and before["first_result_seconds"] == 1.0
    assert set(before["replicas"]) == {"r0", "r1", "r2"}
    assert all(i in again.seen for i in range(end)) and end not in again.seen
    assert not again.add(result(3)) and again.add(result(end))
    again.flush()
    assert again.write_summary(SPEC, finished_at=5000.0)["rows"] == end + 1
    assert JobOutput("j", tmp_path).summarize(SPEC, finished_at=5000.0) == again.summarize(SPEC, finished_at=5000.0)


def test_summary_after_1000_flushes_opens_no_file(tmp_path, monkeypatch):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    end = write(out, 0, 1000, 2)

    def no(*args, **kwargs):
        raise AssertionError("a summary read a part")

    for name in ("read_table", "ParquetFile", "read_schema", "read_metadata", "ParquetDataset"):
        monkeypatch.setattr(pq, name, no)
    s = out.summarize(SPEC, finished_at=3000.0)
    monkeypatch.undo()
    assert s["rows"] == end and s == JobOutput("j", tmp_path).summarize(SPEC, finished_at=3000.0)
    assert len(out.parts()) < 1000 / 10


def test_first_result_of_a_rerun_read_from_the_one_part_that_straddles(tmp_path):
    out = JobOutput("j", tmp_path)
    for i, t in enumerate([500.0, 900.0, 1003.0, 1001.5]):  # a part from before and after created_at
        out.add(Result(i, output="x", replica="r0", finished_at=t))
    out.flush()
    out.add(Result(9, output="x", replica="r0", finished_at=1002.0))
    out.flush()
    assert out.summarize(SPEC, finished_at=1010.0)["first_result_seconds"] == 1.5
    assert JobOutput("j", tmp_path).summarize(SPEC, finished_at=1010.0)["first_result_seconds"] == 1.5


def test_merge_in_another_thread_while_flushing(tmp_path):
    out = JobOutput("j", tmp_path, target_bytes=TARGET, compact_in_flush=False)
    stop = threading.Event()
    merged = []

    def merger():
        while not stop.is_set():
            if out.compact_due():
                merged.append(out.compact())

    t = threading.Thread(target=merger)
    t.start()
    try:
        end = write(out, 0, 120, 7)
    finally:
        stop.set()
        t.join()
    out.write_summary(SPEC)
    assert sum(merged) >= 2
    assert sorted(ids_on_disk(tmp_path)) == list(range(end))


def test_a_failed_merge_loses_nothing_and_is_retried(tmp_path, monkeypatch):
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    real = files.merge
    monkeypatch.setattr(files, "merge", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    end = write(out, 0, 40, 7)  # flush still writes and counts its part
    assert out.rows == end and len(out.parts()) == 40
    monkeypatch.setattr(files, "merge", real)
    end = write(out, end, 1, 7)
    assert len(out.parts()) < 40 and sorted(ids_on_disk(tmp_path)) == list(range(end))


def test_legacy_directory_of_many_small_parts_is_merged_by_size(tmp_path):
    old = JobOutput("j", tmp_path, target_bytes=1 << 40)  # a sink that never merged
    end = write(old, 0, 60, 7)
    copy = tmp_path.parent / "copy"
    shutil.copytree(tmp_path, copy)
    out = JobOutput("j", copy, target_bytes=TARGET)
    out.write_summary(SPEC)
    sizes = [p.stat().st_size for p in out.parts()]
    assert len(sizes) >= 3 and max(sizes) < 2 * TARGET
    assert ids_on_disk(copy) == list(range(end))
    assert pa.types.is_int64(pq.read_schema(out.parts()[0]).field("id").type)


def test_a_merged_file_of_a_narrower_schema_is_rewritten_when_the_job_completes(tmp_path):
    """Issue 39: files merged (and small parts written) before the schema grew are
    rewritten under the final schema at the end; ids keep their type across it."""
    out = JobOutput("j", tmp_path, target_bytes=TARGET)
    end = write(out, 0, 60, 7)  # int ids: merged files with an int64 id column
    assert any(p.merged for p in files.scan(tmp_path))
    for i in (end, "x", str(end - 1)):  # a text id, and an int id's text: another row
        assert out.add(Result(i, output="late", finish_reason=FinishReason.LENGTH))
    out.flush()
    assert pq.read_schema(tmp_path / "_common_metadata").field("id").type == pa.string()
    before = [p.path for p in files.scan(tmp_path)]
    out.write_summary(SPEC)
    assert all(pq.read_schema(p).field("id").type == pa.string() for p in out.parts())
    assert len(out.parts()) <= len(before)
    ids = ids_on_disk(tmp_path)
    assert sorted(ids) == sorted([str(i) for i in range(end + 1)] + ["x", str(end - 1)])
    again = JobOutput("j", tmp_path, target_bytes=TARGET)  # a restart reads the ids with their types
    assert again.seen == set(range(end + 1)) | {"x", str(end - 1)}
    assert state(again)[:4] == state(out)[:4]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
