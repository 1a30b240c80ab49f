"""A job's lifecycle in the sink (the real `prefixflow serve sink` process on a real
nats-server): completion is durable (a failed done-status put is retried; a sink that
exits between the last part and completion finishes the job when it is started again,
with nothing left to redeliver); a job of no rows completes with an empty output; a job
owns its output directory (another job is refused over it unless it overwrites); done
queries tell which ids are on disk, also after a restart."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.services.sink.binding import MANIFEST
from prefixflow.services.sink.lifecycle import EXIT_BEFORE_DONE_CODE, EXIT_MARKER
from prefixflow.services.sink.writer import OUTPUT_TYPES
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.nats.test_sink import SinkProcess

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]


def results(job: str, ids: list[int | str], tag: str = "o") -> bytes:
    return m.encode(m.ResultBatch(job, [m.Result(i, output=f"{tag}{i}", replica="r0", prompt_tokens=4, output_tokens=2)
                                        for i in ids]))


async def wait_status(client: Submitter, job: str, ok: Callable[[m.JobStatus], bool], timeout: float = 60) -> m.JobStatus:
    deadline = time.monotonic() + timeout
    while True:
        st = await client.status(job)
        if st is not None and ok(st):
            return st
        assert time.monotonic() < deadline, f"{job}: status {st}"
        await asyncio.sleep(0.1)


def done(st: m.JobStatus) -> bool:
    return st.done


def log_lines(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == event:
            out.append(rec)
    return out


def test_a_failed_done_put_is_retried_and_the_status_stays_small(tmp_path, nats_server):
    job, out = "retry-done", tmp_path / "out"
    log = tmp_path / "sink.log"
    sink = SinkProcess(nats_server.url, log, PFX_FAIL_DONE_PUTS="1")

    async def go() -> m.JobStatus:
        await sink.ready()
        async with Submitter(nats_server.url) as client:
            await client.create(m.JobSpec(job=job, out_dir=str(out), total=3, created_at=time.time()))
            await client.js.publish(subjects.results("r0", job), results(job, [0, 1, 2]))
            return await wait_status(client, job, done)

    try:
        st = asyncio.run(go())
    finally:
        sink.kill()
    failed = [r for r in log_lines(log, "status update failed") if r.get("done")]
    assert len(failed) == 1 and "fail-done-puts" in failed[0]["error"], failed
    assert len(log_lines(log, "job complete")) == 1, "done once, after the retried put"
    assert st.rows == 3 and st.total == 3 and st.errors == 0
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == 3 and "r0" in summary["replicas"], "the file keeps per-replica totals"
    assert st.summary["rows"] == 3 and "replicas" not in st.summary, "the status does not"
    assert 6 * 24 * 3600 < st.expires_at - st.updated_at <= 7 * 24 * 3600 + 1, "expires with the job's retention"
    assert json.loads((out / MANIFEST).read_text())["job"] == job


def test_a_sink_that_exits_before_completion_completes_the_job_when_restarted(tmp_path, nats_server):
    job, out = "crash-done", tmp_path / "out"
    log = tmp_path / "sink.log"
    # The hook exits once per output root: the restarted sink has it on too, and completes.
    env = {"PFX_EXIT_BEFORE_DONE": "true", "PFX_OUT_ROOT": str(tmp_path)}
    first = SinkProcess(nats_server.url, log, **env)
    second = None

    async def go() -> tuple[m.JobStatus | None, m.JobStatus]:
        nonlocal second
        await first.ready()
        async with Submitter(nats_server.url) as client:
            await client.create(m.JobSpec(job=job, out_dir=str(out), total=4))
            await client.js.publish(subjects.results("r0", job), results(job, [0, 1, 2, 3]))
            deadline = time.monotonic() + 60
            while first.proc.poll() is None:
                assert time.monotonic() < deadline, "the hook did not exit"
                await asyncio.sleep(0.1)
            before = await client.status(job)
            # Its messages were acked with the part: nothing will be redelivered, so only
            # the restarted sink's reconciling can complete the job.
            info = await client.js.consumer_info(subjects.RESULTS_STREAM.name, subjects.sink_consumer().durable)
            assert (info.num_ack_pending, info.num_pending) == (0, 0), info
            assert sorted(pq.read_table(out).column("id").to_pylist()) == [0, 1, 2, 3]
            assert not (out / "_summary.json").exists()
            second = SinkProcess(nats_server.url, log, **env)
            return before, await wait_status(client, job, done)

    try:
        before, st = asyncio.run(go())
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert first.proc.returncode == EXIT_BEFORE_DONE_CODE
    assert before is None or not before.done
    assert st.rows == 4 and st.total == 4
    assert (tmp_path / EXIT_MARKER).exists()
    assert any(r["job"] == job for r in log_lines(log, "reconcile: sealed job not done, checking it"))
    assert json.loads((out / "_summary.json").read_text())["rows"] == 4
    assert sorted(pq.read_table(out).column("id").to_pylist()) == [0, 1, 2, 3], "every row once"


def test_a_job_of_no_rows_completes_with_an_empty_output(tmp_path, nats_server):
    job, out = "empty-job", tmp_path / "out"
    sink = SinkProcess(nats_server.url, tmp_path / "sink.log")

    async def go() -> m.JobStatus:
        await sink.ready()
        async with Submitter(nats_server.url) as client:
            await client.create(m.JobSpec(job=job, out_dir=str(out), total=0))  # sealed at once, no results ever
            return await wait_status(client, job, done)

    try:
        st = asyncio.run(go())
    finally:
        sink.kill()
    assert (st.rows, st.total, st.errors) == (0, 0, 0)
    table = pq.read_table(out)
    assert table.num_rows == 0 and table.column_names == ["id", *OUTPUT_TYPES]
    assert json.loads((out / "_summary.json").read_text())["rows"] == 0
    assert json.loads((out / MANIFEST).read_text())["job"] == job


def snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def test_a_job_is_refused_over_another_jobs_output_unless_it_overwrites(tmp_path, nats_server):
    out = tmp_path / "shared-out"
    sink = SinkProcess(nats_server.url, tmp_path / "sink.log")

    async def go() -> tuple[dict, m.JobStatus, m.DoneReply, dict, m.JobStatus]:
        await sink.ready()
        async with Submitter(nats_server.url) as client:
            await client.create(m.JobSpec(job="first", out_dir=str(out), total=2))
            await client.js.publish(subjects.results("r0", "first"), results("first", [0, 1], tag="first"))
            await wait_status(client, "first", done)
            kept = snapshot(out)

            await client.create(m.JobSpec(job="second", out_dir=str(out), total=2))
            await client.js.publish(subjects.results("r0", "second"), results("second", [0, 1], tag="second"))
            refused = await wait_status(client, "second", lambda st: st.failed)
            await asyncio.sleep(1.5)  # anything the sink would still write for it
            after = snapshot(out)
            asked = await query(client, "second", [0, 1])

            await client.create(m.JobSpec(job="third", out_dir=str(out), total=3, overwrite=True))
            await client.js.publish(subjects.results("r0", "third"), results("third", [5, 6, 7], tag="third"))
            replaced = await wait_status(client, "third", done)
            return kept, refused, asked, after, replaced

    try:
        kept, refused, asked, after, replaced = asyncio.run(go())
    finally:
        sink.kill()
    expected = (f"out_dir {out} is bound to job first (its _job.json); submit with --overwrite to replace that "
                "output, or choose another --out")
    assert refused.error == expected and not refused.done and refused.rows == 0
    assert after == kept, "the first job's files are intact"
    assert asked == m.DoneReply(error=expected), "a refused job's done query says why"
    assert replaced.rows == 3
    rows = pq.read_table(out).to_pylist()
    assert sorted((r["id"], r["output"]) for r in rows) == [(5, "third5"), (6, "third6"), (7, "third7")]
    assert json.loads((out / MANIFEST).read_text())["job"] == "third"
    assert json.loads((out / "_summary.json").read_text())["job"] == "third"


async def query(client: Submitter, job: str, ids: list[int | str]) -> m.DoneReply:
    reply = await client.nc.request(subjects.done_query(job), msgspec.msgpack.encode(m.DoneQuery(ids)), timeout=10)
    return msgspec.msgpack.decode(reply.data, type=m.DoneReply)


def test_done_queries_answer_which_ids_are_on_disk_also_after_a_restart(tmp_path, nats_server):
    log = tmp_path / "sink.log"
    first = SinkProcess(nats_server.url, log)
    second = None
    ints, strs = list(range(0, 3000, 3)), ["a", "b", "c"]  # 1000 ids on disk: 0, 3, 6, ...
    asked_ints = list(range(4096))  # a full chunk
    want_ints = [i % 3 == 0 and i < 3000 for i in asked_ints]
    asked_strs, want_strs = ["a", "zz", "c", "b", "A"], [True, False, True, True, False]

    async def go() -> list[list[m.DoneReply]]:
        nonlocal second
        await first.ready()
        answers = []
        async with Submitter(nats_server.url) as client:
            for job, ids in (("ints", ints), ("strs", strs)):  # not sealed: still running
                await client.create(m.JobSpec(job=job, out_dir=str(tmp_path / job)))
                await client.js.publish(subjects.results("r0", job), results(job, ids))
                await wait_status(client, job, lambda st, n=len(ids): st.rows == n)
            answers.append([await query(client, "ints", asked_ints), await query(client, "strs", asked_strs),
                            await query(client, "nosuchjob", [1])])
            first.kill()
            second = SinkProcess(nats_server.url, tmp_path / "sink2.log")  # opens the jobs from disk to answer
            await second.ready()
            answers.append([await query(client, "ints", asked_ints), await query(client, "strs", asked_strs),
                            await query(client, "nosuchjob", [1])])
        return answers

    try:
        answers = asyncio.run(go())
    finally:
        first.kill()
        if second is not None:
            second.kill()
    for ints_reply, strs_reply, unknown in answers:
        assert ints_reply.error is None and ints_reply.done == want_ints
        assert strs_reply.error is None and strs_reply.done == want_strs
        assert unknown == m.DoneReply(error="unknown job")
