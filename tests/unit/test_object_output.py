"""A job's output in an object store (`prefixflow/services/sink/objstore.py`), driven through
the writer over a local pyarrow file system used as an object store (the store never
renames): parts committed by the manifest, merges that write the merged file, then
the manifest, then delete the parts; a reopen that deletes whatever a crash left and
the manifest does not name; and the output roots for URIs (`roots.py`, `store.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from prefixflow.services.sink.binding import Action, bind, clear_output
from prefixflow.services.sink.objstore import ObjectStore
from prefixflow.services.sink.parts import merged_name, small_name
from prefixflow.services.sink.roots import OutsideRoot, Roots
from prefixflow.services.sink.store import LocalStore, confine_store
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.outputs import FILES_MANIFEST, OutputLocationError, canonical, within
from tests.unit.test_job_output import SPEC, result

pytestmark = pytest.mark.unit

TARGET = 32 << 10


def store(d: Path) -> ObjectStore:
    return ObjectStore("s3://bucket/out", fs=pafs.LocalFileSystem(), base=str(d))


def manifest(d: Path) -> list[str]:
    return json.loads((d / FILES_MANIFEST).read_text())["files"]


def fill(out: JobOutput, start: int, flushes: int, per_flush: int = 40) -> int:
    i = start
    for _ in range(flushes):
        for _ in range(per_flush):
            out.add(result(i))
            i += 1
        out.flush()
    return i


def data_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("part-"))


def test_parts_and_merges_are_committed_by_the_manifest_and_a_plain_read_sees_each_row_once(tmp_path):
    out = JobOutput("j", store(tmp_path), target_bytes=TARGET)
    n = fill(out, 0, 12)
    assert data_files(tmp_path) == manifest(tmp_path), "every data object is committed, nothing else is there"
    assert any("-" in name[len("part-"):] for name in manifest(tmp_path)), "small parts were merged"
    out.write_summary(SPEC)
    names = manifest(tmp_path)
    assert data_files(tmp_path) == names and all("-" in name[len("part-"):] for name in names), names
    assert sorted(pq.read_table(tmp_path).column("id").to_pylist()) == list(range(n))
    assert json.loads((tmp_path / "_summary.json").read_text())["rows"] == n
    # Reopened from the store: the same ids and totals, nothing written twice.
    again = JobOutput("j", store(tmp_path), target_bytes=TARGET)
    assert again.rows == n and not again.add(result(5)) and again.add(result(n))


def test_a_reopen_deletes_what_a_crash_left_and_the_manifest_does_not_name(tmp_path):
    out = JobOutput("j", store(tmp_path), target_bytes=1 << 30)
    n = fill(out, 0, 3)
    committed = manifest(tmp_path)
    assert committed == [small_name(0), small_name(1), small_name(2)]
    # A crash after a merged file's PUT, before the manifest named it; a part PUT whose
    # manifest never came; a large upload left in `_pending/`.
    (tmp_path / merged_name(0, 2)).write_bytes((tmp_path / small_name(0)).read_bytes())
    (tmp_path / small_name(3)).write_bytes((tmp_path / small_name(1)).read_bytes())
    (tmp_path / "_pending.part-000004.parquet.1234").write_bytes(b"torn")
    again = JobOutput("j", store(tmp_path), target_bytes=1 << 30)
    assert data_files(tmp_path) == committed and not list(tmp_path.glob("_pending*"))
    assert again.rows == n and sorted(pq.read_table(tmp_path).column("id").to_pylist()) == list(range(n))
    # A crash after a merge's manifest, before its small parts were deleted.
    again.compact(final=True)
    assert manifest(tmp_path) == [merged_name(0, 2)]
    for i in range(3):
        (tmp_path / small_name(i)).write_bytes(b"left over")
    third = JobOutput("j", store(tmp_path))
    assert data_files(tmp_path) == [merged_name(0, 2)] and third.rows == n


def test_an_object_too_large_for_one_put_is_copied_whole_from_pending(tmp_path, monkeypatch):
    from prefixflow.services.sink import objstore

    monkeypatch.setattr(objstore, "SINGLE_PUT_BYTES", 1000)
    out = JobOutput("j", store(tmp_path))
    n = fill(out, 0, 2)
    assert data_files(tmp_path) == manifest(tmp_path) == [small_name(0), small_name(1)]
    assert (tmp_path / small_name(0)).stat().st_size > 1000 and not list(tmp_path.glob("_pending*"))
    assert sorted(pq.read_table(tmp_path).column("id").to_pylist()) == list(range(n))


def test_binding_and_overwrite_in_an_object_store(tmp_path):
    s = store(tmp_path)
    assert bind("a", s, overwrite=False).action is Action.BIND
    JobOutput("a", s)
    fill(JobOutput("a", store(tmp_path)), 0, 2)
    assert bind("b", store(tmp_path), overwrite=False).action is Action.REFUSE
    assert bind("b", store(tmp_path), overwrite=True).action is Action.REPLACE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["_job.json"]
    assert json.loads((tmp_path / "_job.json").read_text())["job"] == "b"
    assert clear_output(store(tmp_path)) == ["_job.json"] and list(tmp_path.iterdir()) == []


def test_output_roots_for_uris_and_local_directories(tmp_path):
    roots = Roots.parse(f"{tmp_path}, s3://pfx-data/out/ ,gs://other")
    assert roots.local == tmp_path.resolve() and roots.uris == ("s3://pfx-data/out", "gs://other")
    assert confine_store(roots, "s3://pfx-data/out/job1/").where == "s3://pfx-data/out/job1"
    assert confine_store(roots, "s3://pfx-data/out").where == "s3://pfx-data/out"
    assert confine_store(roots, "gs://other/x").where == "gs://other/x"
    assert isinstance(confine_store(roots, str(tmp_path / "job")), LocalStore)
    assert confine_store(roots, "s3://pfx-data/out/t1/j", tenant="t1").where == "s3://pfx-data/out/t1/j"
    for bad, why in {"s3://pfx-data/outside/j": "outside the sink's allowed output URIs",
                     "s3://pfx-data/output": "outside", "s3://other-bucket/out/j": "outside",
                     "s3://pfx-data/out/../x": "'..'", "s3://pfx-data/out//x": "empty segments"}.items():
        with pytest.raises(OutsideRoot, match=why):
            confine_store(roots, bad)
    with pytest.raises(OutsideRoot, match="outside"):
        confine_store(roots, "s3://pfx-data/out/t2/j", tenant="t1")
    with pytest.raises(OutsideRoot, match="lists no s3"):
        confine_store(Roots.parse(str(tmp_path)), "s3://pfx-data/out/j")
    with pytest.raises(ValueError, match="one local directory"):
        Roots.parse("/a,/b")
    assert within("s3://b/out/x", "s3://b/out/") and not within("s3://b/outer", "s3://b/out")
    with pytest.raises(OutputLocationError):
        canonical("http://b/out")
