"""The sink's job boundary (prefixflow/services/sink/boundary.py, `Failures.job_fault`): a fault of one
job's own fails that job with the reason and settles its messages, a missing resource
pauses it (its messages parked), NATS being away retries them, and the other jobs go on;
nothing raises out of the sink."""

from __future__ import annotations

import asyncio
import errno

import nats.errors
import pytest
from nats.js.errors import InvalidKeyError

from prefixflow.services.sink import boundary
from prefixflow.services.sink import service as sink_service
from prefixflow.services.sink.boundary import Fault
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.bus.poison import PRIOR_DELIVERIES
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.messages import JobSpec
from tests.unit.test_writer import FakeMsg, Recorder, fake_sink, ok, read_dir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize("exc,kind", [
    (OSError(errno.ENOSPC, "No space left on device"), Fault.RESOURCE),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), Fault.RESOURCE),
    (OSError(errno.EROFS, "Read-only file system"), Fault.RESOURCE),
    (PermissionError(errno.EACCES, "Permission denied"), Fault.RESOURCE),
    (FileExistsError(errno.EEXIST, "File exists"), Fault.JOB),
    (NotADirectoryError(errno.ENOTDIR, "Not a directory"), Fault.JOB),
    (OSError(errno.ENAMETOOLONG, "File name too long"), Fault.JOB),
    (InvalidKeyError(), Fault.JOB),
    (ValueError("bad part"), Fault.JOB),
    (nats.errors.TimeoutError(), Fault.TRANSPORT),
    (nats.errors.ConnectionClosedError(), Fault.TRANSPORT),
    (asyncio.TimeoutError(), Fault.TRANSPORT),
])
def test_faults_are_classified(exc, kind):
    assert boundary.classify(exc) is kind


def test_the_reason_says_where_and_why():
    exc = FileExistsError(errno.EEXIST, "File exists", "/out/f")
    assert boundary.reason("open the job's output", exc) == \
        "the sink could not open the job's output: [Errno 17] File exists: '/out/f'"
    assert boundary.reason("finish the job", ValueError("x")) == "the sink could not finish the job: ValueError: x"


@pytest.mark.parametrize("where,why", [
    ("file", "File exists"),
    ("file/sub", "Not a directory"),
    ("x" * 300, "File name too long"),
])
def test_a_job_whose_out_dir_cannot_be_a_directory_fails_alone(tmp_path, where, why):
    (tmp_path / "file").write_text("a file\n")
    good_dir = tmp_path / "good"
    rec = Recorder(good_dir)
    sink = fake_sink({"bad": JobSpec("bad", str(tmp_path / where), total=2),
                      "good": JobSpec("good", str(good_dir), total=2)})
    bad1, bad2 = FakeMsg(rec, "bad1", "bad", [ok(1)]), FakeMsg(rec, "bad2", "bad", [ok(2)])
    good = FakeMsg(rec, "good", "good", [ok(1), ok(2)])

    async def go() -> None:
        await sink.take(bad1)
        await sink.take(good)
        await sink.take(bad2)  # a later result of the failed job: dropped at once
        await sink.flush()

    asyncio.run(go())
    assert rec.settled("bad1") == {"ack": set()} and rec.settled("bad2") == {"ack": set()}
    failed = [s for s in sink.status_kv.puts if s.job == "bad"]
    assert len(failed) == 1 and failed[0].failed and why in failed[0].error, failed
    assert failed[0].error.startswith("the sink could not open the job's output: ")
    assert "bad" in sink.refused and "bad" not in sink.outputs and "bad" not in sink.held
    assert rec.settled("good") == {"ack": {1, 2}}
    assert sorted(r["id"] for r in read_dir(good_dir)) == [1, 2]
    assert [s for s in sink.status_kv.puts if s.job == "good"][-1].done
    assert (tmp_path / "file").read_text() == "a file\n"


def test_a_missing_resource_pauses_the_job_and_nats_away_retries_and_neither_fails_nor_counts(tmp_path, monkeypatch):
    """A resource fault pauses the job (its status says why and where, not failed) and
    parks its results (copied to `pfx.parked.<job>`, acked: the sink's consumer holds none
    of them), later results too; NATS away naks, and that delivery is not counted toward
    poison. Neither fails a job."""
    rec = Recorder(tmp_path / "out")
    sink = fake_sink({"j": JobSpec("j", str(tmp_path / "out"), total=2),
                      "k": JobSpec("k", str(tmp_path / "other"), total=1)})
    denied, later, away = FakeMsg(rec, "denied", "j", [ok(1)]), FakeMsg(rec, "later", "j", [ok(2)]), FakeMsg(rec, "away", "k", [ok(1)])

    def no_permission(*args):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out"))

    async def nats_away(job, *, fresh=False):
        raise nats.errors.TimeoutError

    async def go() -> None:
        monkeypatch.setattr(sink_service, "open_bound", no_permission)
        await sink.take(denied)
        await sink.take(later)  # the job is paused: parked without a try
        monkeypatch.setattr(sink.jobs, "get", nats_away)
        await sink.take(away)

    asyncio.run(go())
    assert rec.settled("denied") == {"ack": set()} and rec.settled("later") == {"ack": set()}
    parked = [(subject, headers) for subject, headers in sink.js.published if subject == subjects.parked("j")]
    assert len(parked) == 2 and all(h[PRIOR_DELIVERIES] == "0" for _, h in parked), parked
    [paused] = [s for s in sink.status_kv.puts if s.job == "j"]
    assert not paused.failed and paused.paused.startswith(f"permission denied at {tmp_path / 'out'}"), paused
    assert paused.paused_path == str(tmp_path / "out") and "j" in sink.pauses
    assert rec.settled("away") == {"nak": set()} and sink.pauses.excused.own(away) == 0
    assert "j" not in sink.refused and "k" not in sink.refused, "not the job's fault: it does not fail"


def test_a_job_whose_record_cannot_be_read_fails_alone(tmp_path):
    rec = Recorder(tmp_path / "good")
    sink = fake_sink({"good": JobSpec("good", str(tmp_path / "good"), total=1)})
    get = sink.jobs.get

    async def broken_key(job, *, fresh=False):
        if job == "bad":
            raise InvalidKeyError
        return await get(job, fresh=fresh)

    sink.jobs.get = broken_key

    async def go() -> None:
        await sink.take(FakeMsg(rec, "bad", "bad", [ok(1)]))
        await sink.take(FakeMsg(rec, "good", "good", [ok(1)]))
        await sink.flush()

    asyncio.run(go())
    assert rec.settled("bad") == {"ack": set()} and rec.settled("good") == {"ack": {1}}
    [bad] = [s for s in sink.status_kv.puts if s.job == "bad"]
    assert bad.failed and "InvalidKeyError" in bad.error


def test_error_rows_that_cannot_be_written_fail_the_job(tmp_path, monkeypatch):
    """Bare error rows (a poison message's) always write: when even they do not, the
    job's output is broken (here: its directory became a file) and the job fails, instead
    of being retried for ever."""
    out_dir = tmp_path / "out"
    rec = Recorder(out_dir)
    sink = fake_sink({"j": JobSpec("j", str(out_dir), total=2)})
    poison = FakeMsg(rec, "poison", "j", [ok(1), ok(2)], prior_deliveries=10)

    def broken_flush(self, *args):
        raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(out_dir))

    async def go() -> None:
        await sink.take(poison)
        monkeypatch.setattr(JobOutput, "flush", broken_flush)
        await sink.flush()

    asyncio.run(go())
    assert rec.settled("poison") == {"term": set()}, rec.events  # dead-lettered already: ended
    assert sink.status_kv.puts[-1].failed and "Not a directory" in sink.status_kv.puts[-1].error
    assert "j" in sink.refused and "j" not in sink.outputs


def test_a_job_that_cannot_be_finished_fails_and_the_others_finish(tmp_path, monkeypatch):
    rec_a, rec_b = Recorder(tmp_path / "a"), Recorder(tmp_path / "b")
    sink = fake_sink({"a": JobSpec("a", str(tmp_path / "a"), total=1), "b": JobSpec("b", str(tmp_path / "b"), total=1)})
    write_summary = JobOutput.write_summary

    def summary(self, spec):
        if self.job == "a":
            raise ValueError("summary cannot be written")
        return write_summary(self, spec)

    monkeypatch.setattr(JobOutput, "write_summary", summary)

    async def go() -> None:
        await sink.take(FakeMsg(rec_a, "a", "a", [ok(1)]))
        await sink.take(FakeMsg(rec_b, "b", "b", [ok(1)]))
        await sink.flush()

    asyncio.run(go())
    last = {s.job: s for s in sink.status_kv.puts}
    assert last["a"].failed and last["a"].error == "the sink could not finish the job: ValueError: summary cannot be written"
    assert last["b"].done and not last["b"].failed


def test_a_failure_that_cannot_be_recorded_is_redelivered_not_dropped(tmp_path):
    (tmp_path / "file").write_text("a file\n")
    rec = Recorder(tmp_path / "file")
    sink = fake_sink({"bad": JobSpec("bad", str(tmp_path / "file"), total=1)})

    async def put(key, value):
        raise nats.errors.TimeoutError

    sink.status_kv.put = put
    asyncio.run(sink.take(FakeMsg(rec, "bad", "bad", [ok(1)])))
    assert rec.settled("bad") == {"nak": set()} and "bad" not in sink.refused
