"""Re-runs, pure parts (issue #23): what `run` decides from OUT's manifest and summary,
the done queries of a resumed job, and the report's bounded sample."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats.errors
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import DONE_QUERY_FAILURES, DoneQueries, OutputConflict
from prefixflow.launch.run import Plan, plan
from prefixflow.report.rows import bucket_sizes, load
from prefixflow.shared.wire import messages as m

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _input(tmp_path, n: int = 10):
    data = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": list(range(n)), "prompt": ["p"] * n}), data)
    return data


def _out(tmp_path, job: str | None, rows: int | None = None):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    if job is not None:
        (out / "_job.json").write_text(json.dumps({"job": job, "created_at": 1.0}))
    if rows is not None:
        (out / "_summary.json").write_text(json.dumps({"job": job, "rows": rows, "errors": 0}))
    return out


def test_plan_without_a_manifest_is_a_new_job(tmp_path):
    data = _input(tmp_path)
    assert plan(tmp_path / "nothing", data, None, "new-1") == Plan("new-1", False)
    assert plan(_out(tmp_path, None), data, "mine", "new-1") == Plan("mine", False)


def test_plan_reports_a_finished_job_and_resumes_an_unfinished_one(tmp_path):
    data = _input(tmp_path, 10)
    done = plan(_out(tmp_path, "j", rows=10), data, None, "new")
    assert done.job == "j" and done.done is not None and done.done["rows"] == 10
    assert plan(_out(tmp_path, "j", rows=7), data, "j", "new") == Plan("j", True), "fewer rows than the input"
    (tmp_path / "out" / "_summary.json").unlink()
    assert plan(tmp_path / "out", data, None, "new") == Plan("j", True)


def test_plan_refuses_another_job_unless_overwrite(tmp_path):
    data = _input(tmp_path)
    out = _out(tmp_path, "j", rows=10)
    with pytest.raises(OutputConflict) as exc:
        plan(out, data, "other", "new")
    assert exc.value.code == 2
    assert "holds the output of job j" in str(exc.value)
    assert plan(out, data, "other", "new", overwrite=True) == Plan("other", False)


def _asked(data, max_tokens: int = 4):
    from prefixflow.client.fingerprint import of_job

    return of_job(data, m.JobSpec(job="x", out_dir="", sampling=m.SamplingSpec(max_tokens=max_tokens)))


def test_plan_refuses_the_same_directory_asked_another_input_or_spec(tmp_path):
    data = _input(tmp_path, 10)
    out = _out(tmp_path, "j", rows=10)
    doc = json.loads((out / "_job.json").read_text())
    (out / "_job.json").write_text(json.dumps({**doc, "fingerprint": msgspec.to_builtins(_asked(data))}))
    assert plan(out, data, None, "new", asked=_asked(data)).done is not None, "the same: done"
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"id": list(range(20)), "prompt": ["q"] * 20}), other)
    for job in (None, "j"):
        with pytest.raises(OutputConflict) as exc:
            plan(out, other, job, "new", asked=_asked(other))
        assert exc.value.code == 2
        assert "holds the output of job j, which was asked something else (input: another input" in str(exc.value)
    with pytest.raises(OutputConflict) as exc:
        plan(out, data, None, "new", asked=_asked(data, max_tokens=8))
    assert "spec: sampling.max_tokens 4 -> 8" in str(exc.value)
    assert plan(out, other, None, "new", overwrite=True, asked=_asked(other)) == Plan("new", False)
    assert plan(out, other, "j", "new", overwrite=True, asked=_asked(other)) == Plan("j", False), "the sink replaces"


def test_plan_takes_a_manifest_without_a_fingerprint_as_the_same_job(tmp_path, capsys):
    data = _input(tmp_path, 10)
    out = _out(tmp_path, "j", rows=10)
    assert plan(out, data, None, "new", asked=_asked(data, max_tokens=8)).done is not None
    assert "records no fingerprint" in capsys.readouterr().out


class FakeNc:
    """Answers done queries: ids in `done` are done; `fail` raises that instead."""

    max_payload = 1024 * 1024

    def __init__(self, done=(), fail: Exception | None = None) -> None:
        self.done, self.fail, self.asked = set(done), fail, 0

    async def request(self, subject, data, timeout):
        self.asked += 1
        if self.fail is not None:
            raise self.fail
        ids = msgspec.msgpack.decode(data, type=m.DoneQuery).ids

        class Msg:
            pass

        msg = Msg()
        msg.data = m.encode(m.DoneReply([i in self.done for i in ids], on_disk=len(self.done)))
        return msg


def test_done_queries_keep_only_the_missing_rows():
    rows = [{"id": i} for i in range(6)]
    q = DoneQueries(FakeNc(done={1, 2, 5}), "j")
    assert asyncio.run(q.missing(rows)) == [{"id": 0}, {"id": 3}, {"id": 4}]


def test_done_queries_unanswered_send_everything_and_stop_asking():
    nc = FakeNc(fail=nats.errors.NoRespondersError())
    q = DoneQueries(nc, "j", wait_for_sink=0)
    rows = [{"id": i} for i in range(3)]
    for _ in range(DONE_QUERY_FAILURES + 3):
        assert asyncio.run(q.missing(rows)) == rows
    assert nc.asked == DONE_QUERY_FAILURES and q.problem


def test_done_queries_wait_for_a_sink_that_is_not_listening_yet():
    """A cluster that just started: the first queries find no sink listening; the client
    asks again until it answers (then no row done before is sent again), but only the
    first time: a sink gone later costs no wait."""

    class LateSink(FakeNc):
        async def request(self, subject, data, timeout):
            if self.asked < 3:
                self.asked += 1
                raise nats.errors.NoRespondersError()
            return await super().request(subject, data, timeout)

    nc = LateSink(done={0, 2})
    q = DoneQueries(nc, "j", wait_for_sink=5)
    rows = [{"id": i} for i in range(4)]
    assert asyncio.run(q.missing(rows)) == [{"id": 1}, {"id": 3}] and nc.asked == 4
    gone = FakeNc(fail=nats.errors.NoRespondersError())
    q.nc = gone
    assert asyncio.run(q.missing(rows)) == rows and gone.asked == 1


def test_done_queries_end_once_the_sink_has_nothing_of_the_job():
    """A new job (or one whose directory is empty) costs one round trip, not one per chunk."""
    nc = FakeNc(done=())
    q = DoneQueries(nc, "j")
    for k in range(5):
        rows = [{"id": 10 * k + i} for i in range(10)]
        assert asyncio.run(q.missing(rows)) == rows
    assert nc.asked == 1
    nc, q = FakeNc(done={3}), None
    q = DoneQueries(nc, "j")
    for k in range(3):
        asyncio.run(q.missing([{"id": 10 * k + i} for i in range(10)]))
    assert nc.asked == 3, "something is on disk: every chunk is asked about"


def test_done_queries_split_ids_over_the_message_limit():
    nc = FakeNc(done={"b" * 3000})
    nc.max_payload = 8 * 1024  # message_limit: 4 KiB after headroom... at least 1 KiB
    rows = [{"id": c * 3000} for c in "abcd"]
    assert asyncio.run(DoneQueries(nc, "j").missing(rows)) == [rows[0], rows[2], rows[3]]
    assert nc.asked > 1


def test_report_reads_a_seeded_sample_and_says_so(tmp_path):
    n = 5000
    for k in range(2):
        ids = np.arange(k * n, (k + 1) * n)
        pq.write_table(pa.table({
            "id": ids, "prompt": [f"p{i}" for i in ids], "replica": ["r0"] * n, "error": pa.nulls(n, pa.string()),
            "prompt_tokens": np.full(n, 10), "cached_tokens": np.full(n, 5), "output_tokens": np.full(n, 2),
            "finished_at": np.linspace(1.0, 2.0, n), "started_at": np.linspace(0.5, 1.5, n),
            "bucket": [f"b{i // 100}" for i in ids],  # 100 buckets of 100
        }), tmp_path / f"part-{k:05d}.parquet", row_group_size=1000)
    job = load(tmp_path, sample=500)
    assert job.table.num_rows == 500 and job.total == 2 * n and job.sampled and job.scale == 20
    assert any("sampled 500 of 10,000 rows" in note for note in job.notes)
    assert load(tmp_path, sample=500).table.column("id").to_pylist() == job.table.column("id").to_pylist(), "seeded"
    sizes, weights = bucket_sizes(job)
    assert set(sizes) == {100}, "exact sizes of the sampled buckets"
    assert sum(weights) == pytest.approx(100), "about 100 buckets"
    full = load(tmp_path, sample=0)
    assert full.table.num_rows == 2 * n and not full.sampled
