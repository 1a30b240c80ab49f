"""prefixflow.services.sink.binding: a job owns its output directory. The pure rule (`decide`: bind,
adopt, owned, replace, refuse from a directory's state and the spec's overwrite), the
state read from a real directory (`inspect`), and carrying decisions out (`bind`): a
refusal writes nothing, a replace deletes the other job's output and nothing else."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.services.sink import binding
from prefixflow.services.sink.binding import MANIFEST, Action, DirState, decide
from prefixflow.services.sink import lifecycle
from prefixflow.services.sink.lifecycle import Reconciler, status_summary
from prefixflow.services.sink.parts import write_empty_part
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.fingerprint import Fingerprint

pytestmark = pytest.mark.unit


# --- the rule ---------------------------------------------------------------------------


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_empty_or_missing_directory_is_bound(overwrite):
    assert decide("j2", DirState(), overwrite).action is Action.BIND


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_directory_bound_to_the_same_job_is_owned_and_nothing_is_deleted(overwrite):
    # A resumed job (or one reopened after eviction) keeps its parts, overwrite or not.
    assert decide("j1", DirState(owner="j1", has_output=True), overwrite).action is Action.OWNED


def test_parts_without_a_manifest_are_adopted():
    assert decide("j1", DirState(has_output=True), overwrite=False).action is Action.ADOPT


def test_parts_without_a_manifest_are_replaced_when_the_job_asks_to_overwrite():
    d = decide("j1", DirState(has_output=True), overwrite=True)
    assert d.action is Action.REPLACE and d.previous is None


def test_another_jobs_directory_is_refused_with_the_reason():
    d = decide("j2", DirState(owner="j1", has_output=True), overwrite=False, out_dir="/data/out")
    assert d.action is Action.REFUSE and d.previous == "j1"
    assert d.error == ("out_dir /data/out is bound to job j1 (its _job.json); submit with --overwrite to "
                       "replace that output, or choose another --out")


def test_another_jobs_directory_is_refused_even_before_it_holds_parts():
    # Bound as soon as the other job opened it: its first part may be on its way.
    assert decide("j2", DirState(owner="j1"), overwrite=False).action is Action.REFUSE


def test_another_jobs_directory_is_replaced_with_overwrite():
    d = decide("j2", DirState(owner="j1", has_output=True), overwrite=True)
    assert d.action is Action.REPLACE and d.previous == "j1" and d.error is None


def test_an_unreadable_manifest_is_refused_without_overwrite_and_replaced_with_it():
    state = DirState(unreadable="not JSON", has_output=True)
    refused = decide("j2", state, overwrite=False, out_dir="/o")
    assert refused.action is Action.REFUSE and "unreadable" in refused.error and "--overwrite" in refused.error
    assert decide("j2", state, overwrite=True).action is Action.REPLACE


# --- a directory's state ----------------------------------------------------------------


def part(path, ids=(1, 2)) -> None:
    pq.write_table(pa.table({"id": pa.array(list(ids), pa.int64())}), path)


def test_inspect_reads_owner_and_output(tmp_path):
    assert binding.inspect(tmp_path / "missing") == DirState()
    assert binding.inspect(tmp_path) == DirState()
    part(tmp_path / "part-000000.parquet")
    assert binding.inspect(tmp_path) == DirState(has_output=True)
    (tmp_path / MANIFEST).write_text(json.dumps({"job": "j1", "created_at": 1.0}))
    assert binding.inspect(tmp_path) == DirState(owner="j1", has_output=True)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"job": ""}', '{"created_at": 1}'])
def test_inspect_reports_an_unreadable_manifest(tmp_path, text):
    (tmp_path / MANIFEST).write_text(text)
    state = binding.inspect(tmp_path)
    assert state.owner is None and state.unreadable


# --- carrying it out --------------------------------------------------------------------


def files(path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def manifest(path) -> dict:
    return json.loads((path / MANIFEST).read_text())


def test_bind_creates_the_directory_and_writes_the_manifest(tmp_path):
    out = tmp_path / "a" / "b"
    d = binding.bind("j1", out, overwrite=False)
    assert d.action is Action.BIND
    assert manifest(out)["job"] == "j1" and manifest(out)["created_at"] > 0
    assert files(out) == [MANIFEST], "no temporary file left"
    assert binding.bind("j1", out, overwrite=True).action is Action.OWNED


def test_bind_adopts_parts_from_before_manifests_and_keeps_them(tmp_path):
    part(tmp_path / "part-000000.parquet")
    assert binding.bind("j1", tmp_path, overwrite=False).action is Action.ADOPT
    assert files(tmp_path) == [MANIFEST, "part-000000.parquet"] and manifest(tmp_path)["job"] == "j1"


def other_jobs_output(path) -> list[str]:
    path.mkdir(parents=True, exist_ok=True)
    binding.write_manifest(path, "j1")
    part(path / "part-000000.parquet")
    part(path / "part-000001-000004.parquet")  # a merged part
    part(path / "other.parquet")
    (path / ".part-000005-000006.ready").write_bytes(b"x")  # a merge caught half-way
    (path / ".part-000007.parquet.tmp").write_bytes(b"x")
    (path / "_summary.json").write_text("{}")
    (path / "_report").mkdir()
    (path / "_report" / "timeline.png").write_bytes(b"png")
    (path / "notes.txt").write_text("the user's own file")
    return files(path)


def test_bind_refuses_another_jobs_directory_and_touches_nothing(tmp_path):
    before = other_jobs_output(tmp_path)
    mtime = (tmp_path / MANIFEST).stat().st_mtime_ns
    d = binding.bind("j2", tmp_path, overwrite=False, shown="/shown/out")
    assert d.action is Action.REFUSE and d.error.startswith("out_dir /shown/out is bound to job j1")
    assert files(tmp_path) == before and manifest(tmp_path)["job"] == "j1"
    assert (tmp_path / MANIFEST).stat().st_mtime_ns == mtime


def test_bind_with_overwrite_deletes_the_other_jobs_output_only(tmp_path):
    other_jobs_output(tmp_path)
    d = binding.bind("j2", tmp_path, overwrite=True)
    assert d.action is Action.REPLACE and d.previous == "j1"
    assert files(tmp_path) == [MANIFEST, "notes.txt"], "only the user's own file stays"
    assert manifest(tmp_path)["job"] == "j2"


def test_a_replace_interrupted_before_the_new_manifest_is_finished_by_the_next_bind(tmp_path):
    other_jobs_output(tmp_path)
    # A crash after the parts went but before the manifest did: the old owner still shows,
    # so the next bind replaces again rather than adopting what is left.
    for p in tmp_path.glob("*.parquet"):
        p.unlink()
    assert binding.inspect(tmp_path).owner == "j1"
    assert binding.bind("j2", tmp_path, overwrite=True).action is Action.REPLACE
    assert manifest(tmp_path)["job"] == "j2"


# --- a job is what it was asked to do: the manifest's fingerprint ------------------------

ASKED = Fingerprint(input={"kind": "jsonl", "scheme": 1, "size": 10, "digest": "aa"}, spec={"sampling.max_tokens": "4"})
OTHER = Fingerprint(input={"kind": "jsonl", "scheme": 1, "size": 12, "digest": "bb"}, spec={"sampling.max_tokens": "4"})


def test_the_same_job_asked_something_else_is_refused_unless_overwrite():
    state = DirState(owner="j1", has_output=True, fingerprint=ASKED)
    assert decide("j1", state, False, "/o", ASKED).action is Action.OWNED
    refused = decide("j1", state, False, "/o", OTHER)
    assert refused.action is Action.REFUSE and "another input (12 bytes, not 10)" in refused.error
    replaced = decide("j1", state, True, "/o", OTHER)
    assert replaced.action is Action.REPLACE and replaced.previous is None, "nothing of another job to release"
    # Unknown on either side (a manifest or a spec from before fingerprints): the same job.
    assert decide("j1", DirState(owner="j1", has_output=True), False, "/o", OTHER).action is Action.OWNED
    assert decide("j1", state, False, "/o", None).action is Action.OWNED


def test_bind_writes_the_fingerprint_and_gives_an_older_manifest_one(tmp_path):
    binding.write_manifest(tmp_path, "j1")  # before fingerprints
    part(tmp_path / "part-000000.parquet")
    assert binding.bind("j1", tmp_path, overwrite=False, fingerprint=ASKED).action is Action.OWNED
    assert binding.inspect(tmp_path).fingerprint == ASKED
    assert files(tmp_path) == [MANIFEST, "part-000000.parquet"]
    d = binding.bind("j1", tmp_path, overwrite=False, fingerprint=OTHER)
    assert d.action is Action.REFUSE and files(tmp_path) == [MANIFEST, "part-000000.parquet"]
    assert binding.bind("j1", tmp_path, overwrite=True, fingerprint=OTHER).action is Action.REPLACE
    assert files(tmp_path) == [MANIFEST] and binding.inspect(tmp_path).fingerprint == OTHER


# --- what completion writes (prefixflow/services/sink/lifecycle.py) ----------------------


def test_an_empty_part_reads_back_as_an_empty_table_with_the_output_columns(tmp_path):
    write_empty_part(tmp_path)
    binding.write_manifest(tmp_path, "j0")
    (tmp_path / "_summary.json").write_text("{}")
    table = pq.read_table(tmp_path)
    assert table.num_rows == 0
    assert table.column_names[:3] == ["id", "output", "finish_reason"] and "error" in table.column_names


def test_the_status_summary_has_no_per_replica_totals():
    summary = {"job": "j", "rows": 3, "replicas": {"r0": {"rows": 3}}}
    assert status_summary(summary) == {"job": "j", "rows": 3} and "replicas" in summary
    assert status_summary(None) is None


def spec(job: str, total: int | None) -> bytes:
    return m.encode_json(m.JobSpec(job, f"/o/{job}", total=total))


def test_the_reconciler_keeps_sealed_jobs_and_drops_deleted_unsealed_and_dir_keys():
    r = Reconciler()
    assert r.note("a", spec("a", 3), None) == "a" and "a" in r
    assert r.note("b", spec("b", None), None) == "b" and "b" not in r, "not sealed: nothing to complete"
    assert r.note("c", spec("c", 0), None) == "c" and "c" in r, "an empty job still completes"
    assert r.note(subjects.dir_key("/o/a"), b"a", None) is None and len(r) == 2
    assert r.note("d", b"{garbage", None) is None and "d" not in r
    r.note("a", b"", "DEL")
    r.note("c", b"", "PURGE")
    assert len(r) == 0


def test_the_reconciler_checks_each_job_once_per_period_and_a_bounded_number_per_round():
    r = Reconciler()
    for i in range(5):
        r.note(f"j{i}", spec(f"j{i}", 1), None)
    assert r.take_due(100.0, limit=3) == ["j0", "j1", "j2"]
    assert r.take_due(100.0, limit=3) == ["j3", "j4"]
    assert r.take_due(101.0) == [], "pushed back"
    r.note("j1", spec("j1", 1), None)  # sealed again: due now
    assert r.take_due(101.0) == ["j1"]
    r.forget("j2")
    assert sorted(r.take_due(10_000.0)) == ["j0", "j1", "j3", "j4"]


def test_a_cancelled_job_is_checked_like_a_sealed_one():
    r = Reconciler()
    cancelled = m.JobSpec("c", "/o/c", cancelled_at=50.0)
    assert r.note("c", m.encode_json(cancelled), None) == "c" and "c" in r, "unsealed, cancelled: it completes"


def test_the_reconciler_hands_out_each_expired_job_once():
    r = Reconciler()
    r.note("soon", m.encode_json(m.JobSpec("soon", "/o/s", expires_at=100.0)), None)
    r.note("later", m.encode_json(m.JobSpec("later", "/o/l", expires_at=200.0)), None)
    r.note("never", m.encode_json(m.JobSpec("never", "/o/n")), None)
    r.note("gone", m.encode_json(m.JobSpec("gone", "/o/g", expires_at=50.0, cancelled_at=40.0)), None)
    assert r.take_expired(99.0) == []
    assert r.take_expired(150.0) == [("soon", 100.0)]
    assert r.take_expired(150.0) == [], "handed out once"
    r.note("later", b"", "DEL")
    assert r.take_expired(1e9) == []


@pytest.mark.parametrize(
    "spec_kw, rows, pending, quiet, now, want",
    [
        ({"total": 10}, 10, False, 0.0, 0.0, True),  # sealed, every row on disk
        ({"total": 10}, 10, True, 9.0, 9.0, False),  # rows still queued
        ({"total": 10}, 9, False, 99.0, 99.0, False),  # one missing, not cancelled
        ({"cancelled_at": 100.0}, 3, False, 99.0, 102.0, False),  # cancelled 2 s ago: prompts may still land
        ({"cancelled_at": 100.0}, 3, False, 1.0, 110.0, False),  # a row came 1 s ago
        ({"cancelled_at": 100.0}, 3, False, 99.0, 104.0, True),  # settled
        ({"cancelled_at": 100.0, "total": 5}, 0, False, 99.0, 104.0, True),  # cancelled before any row
    ],
)
def test_when_a_job_is_complete(spec_kw, rows, pending, quiet, now, want):
    assert lifecycle.complete(m.JobSpec("j", "/o", **spec_kw), rows, pending, quiet, now) is want


@pytest.mark.parametrize(
    "cancelled_at, expires_at, now, ended, expired",
    [
        (0.0, 0.0, 100.0, 0.0, False),  # runs
        (0.0, 200.0, 100.0, 0.0, False),  # deadline ahead
        (0.0, 50.0, 100.0, 50.0, True),  # deadline passed
        (40.0, 50.0, 100.0, 40.0, False),  # cancelled before its deadline
        (60.0, 50.0, 100.0, 50.0, True),  # cancelled after it expired: expired
    ],
)
def test_when_a_job_ended(cancelled_at, expires_at, now, ended, expired):
    spec = m.JobSpec("j", "/o", cancelled_at=cancelled_at, expires_at=expires_at)
    assert spec.ended_at(now) == ended and spec.expired(now) is expired
