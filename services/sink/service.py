"""Sink: writes results to Parquet, exactly once per (job, id), and tracks job progress.

Loop: pull result batches from `pfx.results.*` -> drop ids already written -> queue rows
per job -> every `flush_seconds` (or `flush_rows`) write a part per job, then ack the
messages whose rows are now on disk -> update the job's status in the status KV bucket ->
a sealed job whose row count reached its total gets `_summary.json` and `done`.

A job owns its output directory (`services/sink/binding.py`): it is bound (`_job.json`)
before anything is written, and a job whose `out_dir` another job owns fails unless its
spec says `overwrite`. Completion is durable (`services/sink/lifecycle.py`): a job is done
once its done status is stored, retried every round until then, and every sealed job not
yet done is checked again after a restart or an eviction (a watch on the jobs bucket). Done
queries (`services/sink/queries.py`) tell a resuming client which ids are on disk.

A poison results message (written and failed too often) is copied to the dead-letter
stream at once, its rows queued as error rows, and it is terminated only once those rows
are on disk, like an ack: a crash in between redelivers it instead of losing the rows.

Output is confined to `--out-root`: a job whose `out_dir` resolves outside it (`..`,
another absolute path, a symlink out) is marked failed with the reason in its status, its
results are dropped, and nothing is created or written for it.

A bad job fails alone. Every exception on one job's path (opening and binding its
directory, reading its parts back, writing a part, finishing it, its key-value records)
ends at the job boundary (`job_fault`, kinds in `services/sink/boundary.py`): a fault of
the job's own fails that job (`fail_job`: the reason in its status, its messages acked);
a missing resource (disk full, read-only, no permission) or NATS being away retries its
messages; the sink and every other job go on. A job id outside the grammar
(`subjects.job_id_error`) on a results subject is dead-lettered with the reason on sight;
a done query for one gets an error reply.
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from collections import OrderedDict, deque
from pathlib import Path
from typing import NamedTuple

import structlog
from nats.aio.msg import Msg

from shared.wire import messages as m
from shared.wire import subjects
from shared.process.config import SinkConfig
from shared.bus.jobs import JobCache
from shared.bus.pull import DurablePull
from shared.bus.connection import close, connect
from shared.bus.provision import job_retention, provision
from shared.bus.consume import decode_or_quarantine
from shared.bus.poison import dead_letter, deliveries, is_poison, quarantine, reject
from shared.process import metrics
from services.sink import boundary, export, lifecycle, queries
from services.sink.boundary import Fault
from services.sink.binding import Action, open_bound
from services.sink.inputs import InputCache
from services.sink.large import resolve_or_hand_back
from services.sink.writer import JobOutput, OutsideRoot, confine
from shared.bus.blobs import purge_job_blobs

log = structlog.get_logger()

MAX_OPEN_JOBS = 256
"""Job outputs kept open; past it, idle ones are forgotten (reopened from disk if needed)."""
RATE_WINDOW = 30.0
"""Seconds of progress a job's rate (rows per second, hence its ETA) is measured over."""
RESOURCE_RETRY = 1.0
"""Seconds before the messages of a job whose output lacks a resource are delivered again."""
MAX_REFUSED_JOBS = 10_000
"""Refused jobs remembered (their results are dropped at once); the oldest are forgotten
first (and refused again, from their spec, if more of their results arrive)."""


class Held(NamedTuple):
    """A message whose rows are queued, settled once its job's part is on disk."""

    msg: Msg
    poison: bool
    """Dead-lettered already: terminated, not acked (and still nak'd if the write fails)."""

    def settle(self):
        """End the message: its rows are on disk, or its job failed (the coroutine to await)."""
        return self.msg.term() if self.poison else self.msg.ack()


class Sink:
    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.outputs: dict[str, JobOutput] = {}
        """Open jobs. A done job (`JobOutput.done`, its done status stored) is not checked
        again; done ones are forgotten first, so nothing here grows with the number of jobs
        ever run."""
        self.held: dict[str, list[Held]] = {}
        """Messages whose rows are queued, by job: settled once their job's part is on disk."""
        self.pending_rows = 0
        self.last_flush = time.monotonic()
        self.root = Path(os.path.realpath(cfg.out_root or os.getcwd()))
        """Every job writes under this directory (`--out-root`, default the working directory)."""
        self.refused: OrderedDict[str, str] = OrderedDict()
        """Jobs whose out_dir is outside the root or bound to another job -> why (their
        results are dropped). A new spec of the job clears its entry (checked again)."""
        self.progress: dict[str, deque[tuple[float, int]]] = {}
        """Open jobs -> (monotonic time, rows on disk) over the last RATE_WINDOW seconds."""
        self.inputs = InputCache(cfg.inputs_cache or None)
        """Local copies of the blobs of input columns the queued rows need."""
        self.unannounced: dict[str, dict] = {}
        """Open jobs whose `_summary.json` is written but whose done status is not stored
        yet -> their summary: the put is retried every round (never evicted meanwhile)."""
        self.reconciler = lifecycle.Reconciler()
        """Sealed jobs not known done or failed: checked (opened from disk) when due."""
        self.disk = asyncio.Lock()
        """Held while a job's directory is bound and opened, while parts are written and
        while a job is finished: a done query opening a job (and perhaps replacing another
        job's output) never interleaves with writes."""
        self.faults = lifecycle.Faults(cfg.fail_done_puts, cfg.exit_before_done)
        metrics.SINK_PENDING_ROWS.set_function(lambda: self.pending_rows)
        metrics.SINK_OPEN_JOBS.set_function(lambda: len(self.outputs))

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "sink")
        self.nc, self.js = nc, nc.jetstream()
        await provision(self.js)
        jobs_kv = await self.js.key_value(subjects.JOBS_KV)
        self.jobs = JobCache(jobs_kv, ttl=1.0)
        await self.jobs.follow_cancels(nc)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        sub = DurablePull(self.js, subjects.sink_consumer())
        done_queries = await nc.subscribe(subjects.ALL_DONE_QUERIES)
        await nc.flush()  # subscribed at the server before "ready"
        log.info("sink ready", out_root=str(self.root))
        # Every loop under one TaskGroup: a task that dies ends the process (its
        # supervisor restarts it, JetStream redelivers what it held).
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.reconciler.watch(jobs_kv, stop, self.spec_written))
            tg.create_task(queries.answer(self, done_queries, stop))
            await self.consume(sub, stop)
        await self.flush()
        await close(nc, sub, done_queries)
        self.inputs.close()

    async def consume(self, sub: DurablePull, stop: asyncio.Event) -> None:
        last_check = 0.0
        while not stop.is_set():
            if len(self.outputs) > MAX_OPEN_JOBS:  # done queries open jobs without evicting
                self.evict()
            msgs = await sub.fetch(self.cfg.fetch_batch, timeout=0.2)
            for msg in msgs:
                await self.take(msg)
            now = time.monotonic()
            if self.pending_rows >= self.cfg.flush_rows or (self.held and now - self.last_flush >= self.cfg.flush_seconds):
                await self.flush()
            if now - last_check >= 1.0:
                last_check = now
                await self.check_jobs()
                await self.reconcile()

    def spec_written(self, job: str) -> None:
        """A spec of `job` was written (the jobs watch): a refusal is decided again."""
        self.refused.pop(job, None)

    async def output(self, job: str, *, evict: bool = True) -> JobOutput | None:
        """The job's open output, opened (bound, read back from disk) if need be; None
        for an unknown job or one refused (out_dir outside the root, or another job's).
        `evict=False`: never forget other jobs to make room (callers outside the main
        loop, which may hold an output it is about to fill).

        A fault of the job's own on the way (its out_dir is a file or under one, a name
        too long, a part that cannot be read) fails the job here and gives None; a missing
        resource or NATS being away raises, for the caller to retry."""
        out = self.outputs.pop(job, None)
        if out is not None:
            self.outputs[job] = out  # most recently used last
            return out
        try:
            return await self.open_output(job, evict)
        except Exception as exc:  # noqa: BLE001 - the job boundary (boundary.py): the job's own fault fails it alone
            if boundary.classify(exc) is not Fault.JOB:
                raise
            await self.fail_job(job, boundary.reason("open the job's output", exc))
            return None

    async def open_output(self, job: str, evict: bool) -> JobOutput | None:
        """`output` for a job not open here: bound and read back from disk."""
        async with self.disk:
            if (out := self.outputs.get(job)) is not None:
                return out  # opened by another caller meanwhile
            if job in self.refused:
                return None
            lookup = await self.jobs.get(job, fresh=True)
            spec = lookup.spec
            if spec is None:
                return None
            try:
                # A tenant's jobs write under its own part of the root: another tenant's
                # directories are outside it.
                tenant = subjects.tenant_of(job)
                out_dir = confine(self.root / tenant if tenant else self.root, spec.out_dir)
            except OutsideRoot as exc:
                await self.refuse(job, str(exc))
                return None
            if evict and len(self.outputs) >= MAX_OPEN_JOBS:
                self.evict()
            decision, out = await asyncio.to_thread(open_bound, job, out_dir, spec)
            if out is None:
                await self.refuse(job, decision.error or "out_dir is bound to another job")
                return None
            if decision.action is Action.REPLACE and decision.previous:
                await self.release(decision.previous, job, spec.out_dir)
            self.outputs[job] = out
        log.info("job opened", job=job, out_dir=str(out_dir), rows_on_disk=out.rows, binding=decision.action.value,
                 previous_job=decision.previous)
        return out

    async def release(self, previous: str, job: str, out_dir: str) -> None:
        """`job` took over `previous`'s directory (overwrite): if `previous` is open here,
        forget it, and drop its queued rows (their messages acked, as for a refused job)."""
        old = self.outputs.pop(previous, None)
        if old is None:
            return
        self.unannounced.pop(previous, None)
        self.progress.pop(previous, None)
        self.pending_rows = max(self.pending_rows - len(old.pending), 0)
        old.drop_pending()
        held = self.held.pop(previous, [])
        await asyncio.gather(*(h.msg.ack() for h in held), return_exceptions=True)
        if not old.done:
            await self.refuse(previous, f"out_dir {out_dir} was taken over by job {job} (--overwrite): "
                                        "this job's output there is gone")

    async def fail_job(self, job: str, why: str, msgs: list[Msg] = ()) -> None:
        """Fail `job` with `why` in its status and drop what the sink holds of it: its open
        output, its queued rows, its held messages and `msgs` (the job's messages in hand),
        settled. From then on its results are dropped as they come (`refused`), until a new
        spec of the job is written. A failure that could not be recorded (the status put
        failed) naks them instead: redelivered, the job fails again then.

        NOTE: a failed job's messages are acked, not dead-lettered: they are sound results
        of a job that will not be written, not poison; the reason is in the job's status
        (once, not per message), and copying every row of a large job into the dead-letter
        stream (which keeps the newest 100,000 messages) would push out the real poison."""
        out = self.outputs.pop(job, None)
        if out is not None:
            self.pending_rows = max(self.pending_rows - len(out.pending), 0)
            out.drop_pending()
        self.unannounced.pop(job, None)
        self.progress.pop(job, None)
        held = self.held.pop(job, [])
        await self.refuse(job, why)
        if job in self.refused:
            ends = [h.settle() for h in held] + [msg.ack() for msg in msgs]
        else:
            ends = [msg.nak(delay=5.0) for msg in [h.msg for h in held] + list(msgs)]
        await asyncio.gather(*ends, return_exceptions=True)

    async def job_fault(self, job: str, stage: str, exc: Exception, msgs: list[Msg]) -> None:
        """The job boundary: `exc` was raised on `job`'s path (`stage`: what the sink was
        doing, as the reason says it); `msgs`: that job's messages in hand, not held. The
        kinds are `boundary.classify`'s; nothing here raises."""
        match boundary.classify(exc):
            case Fault.RESOURCE:
                await self.wait_for_resources(job, exc, msgs)
            case Fault.TRANSPORT:
                log.warning("nats unavailable on a job's path; its messages are retried", job=job, stage=stage,
                            error=repr(exc))
                await asyncio.gather(*(msg.nak(delay=RESOURCE_RETRY) for msg in msgs), return_exceptions=True)
            case Fault.JOB:
                log.exception("job failed at the sink", job=job, stage=stage, exc_info=exc)
                await self.fail_job(job, boundary.reason(stage, exc), msgs)

    async def wait_for_resources(self, job: str, exc: Exception, msgs: list[Msg]) -> None:
        """The job's output lacks a resource (disk full, quota, read-only file system, no
        permission: `boundary.RESOURCE_ERRNOS`). Not the job's fault, so it does not fail:
        its messages are retried after `RESOURCE_RETRY` seconds, the sink goes on.
        NOTE: the one place a later change turns into "pause the job" (issue 39, item 3)."""
        log.error("job output lacks a resource; its messages are retried", job=job, error=repr(exc))
        await asyncio.gather(*(msg.nak(delay=RESOURCE_RETRY) for msg in msgs), return_exceptions=True)

    async def refuse(self, job: str, why: str) -> None:
        """Mark `job` failed (its out_dir escapes the root, or another job owns it); its
        results get dropped."""
        log.error("job refused", job=job, error=why)
        now = time.time()
        status = m.JobStatus(job, updated_at=now, failed=True, error=why, expires_at=now + job_retention())
        try:
            await self.status_kv.put(job, m.encode_json(status))
        except Exception as exc:  # noqa: BLE001 - not remembered: the next result tries again
            log.warning("status update failed", job=job, error=repr(exc))
            return
        self.reconciler.forget(job)
        self.refused[job] = why
        while len(self.refused) > MAX_REFUSED_JOBS:
            self.refused.popitem(last=False)

    def evict(self) -> None:
        """Forget half the open outputs: finished jobs first, then the least recently
        used ones with nothing queued (an unfinished job is reopened from its parts on
        disk when its next row arrives, or by the reconciler if it is sealed, so abandoned
        jobs cannot pile up). A job whose done status is not stored yet stays."""
        idle = [j for j, o in self.outputs.items() if not o.pending and j not in self.held and j not in self.unannounced]
        for job in sorted(idle, key=lambda j: not self.outputs[j].done)[: max(len(self.outputs) // 2, 1)]:
            del self.outputs[job]
            self.progress.pop(job, None)

    async def take(self, msg: Msg) -> None:
        # The consume protocol (shared/bus/consume.py) without its ledger: the sink holds
        # results per job until they are written (`held`, settled in `flush`).
        job = subjects.job_from_subject(msg.subject)
        if (why := subjects.job_id_error(job)) is not None:  # a raw publish: no job to write or fail
            await reject(self.js, msg, why)
            return
        if (batch := await decode_or_quarantine(self.js, msg, m.result_batch_decoder, "result batch")) is None:
            return
        if batch.job != job:
            # A producer may publish results for any job: the subject (which the grants and
            # the tenants' boundaries are about) and the body must name the same one.
            await quarantine(self.js, msg, f"results for job {batch.job!r} on {msg.subject!r}")
            return
        try:
            await self.queue(batch, msg)
        except Exception as exc:  # noqa: BLE001 - the job boundary: one job's fault never stops the sink
            await self.job_fault(job, "take the job's results", exc, [msg])

    async def queue(self, batch: m.ResultBatch, msg: Msg) -> None:
        """Queue the rows of `msg` for its job's next part (held until then), or drop them
        (acked) for a refused or failed job."""
        out = None if batch.job in self.refused else await self.output(batch.job)  # may refuse it
        if batch.job in self.refused:
            # Its out_dir escapes the output root or is another job's, or the job failed
            # here (`fail_job`): the results are dropped (acked, so they are not
            # redelivered), nothing is written for the job.
            await msg.ack()
            return
        if out is None:
            if is_poison(msg):
                await quarantine(self.js, msg, f"results for unknown job {batch.job!r}")
            else:
                log.warning("results for an unknown job: retried later", job=batch.job)
                await msg.nak(delay=5.0)
            return
        if not is_poison(msg) and (batch := await resolve_or_hand_back(self.js, batch, msg)) is None:
            return  # a result stored by reference could not be read now: redelivered (services/sink/large.py)
        results = batch.results
        poison = is_poison(msg)
        if poison:
            # Writing these rows failed again and again: the original goes to the
            # dead-letter stream, and its rows become bare error rows (id, replica,
            # error), which always write, so the job still completes.
            # NOTE: the message is terminated in `flush`, once those rows are on disk: a
            # crash before then redelivers it (and dead-letters it again) instead of
            # losing its rows, and a failed write naks it.
            await dead_letter(self.js, msg, "sink failed repeatedly")
            why = f"poison message: result could not be written after {deliveries(msg)} deliveries"
            results = [m.error_result(r.id, why, replica=r.replica, src=r.src, row=r.row) for r in results]
        reached = msg.metadata.timestamp.timestamp()  # the finish time of rows that have none
        added = sum(out.add(r, reached) for r in results)
        self.pending_rows += added
        if added < len(results):
            metrics.SINK_DUPLICATES.inc(len(results) - added)
        self.held.setdefault(batch.job, []).append(Held(msg, poison))

    async def flush(self) -> None:
        written = {}
        async with self.disk:
            for job, out in list(self.outputs.items()):
                if not out.pending:
                    continue
                try:
                    t0 = time.perf_counter()
                    await self.inputs.fetch(self.js, job, out.sources())  # the rows' input columns
                    written[job] = await asyncio.to_thread(out.flush, functools.partial(self.inputs.table, job))
                    metrics.SINK_PART_SECONDS.observe(time.perf_counter() - t0)
                    count_part(out.last_part)
                except Exception as exc:  # noqa: BLE001 - the job boundary: one job's part must not stop the others
                    await self.part_failed(job, out, exc)
        # Every message still held has its rows on disk now (or had only duplicates).
        settle = [h.settle() for held in self.held.values() for h in held]
        await asyncio.gather(*settle, return_exceptions=True)
        settled = set(self.held)  # with `written`: jobs whose progress (rows, duplicates) moved
        self.held, self.pending_rows, self.last_flush = {}, 0, time.monotonic()
        for job, n in written.items():
            if (out := self.outputs.get(job)) is not None:
                log.info("part written", job=job, rows=n, total_rows=out.rows, errors=out.errors)
        if written or settled:
            await self.check_jobs(list(written.keys() | settled))

    async def part_failed(self, job: str, out: JobOutput, exc: Exception) -> None:
        """A part of `job` could not be written (its rows dropped from the queue). Its
        messages are redelivered, and a message that keeps failing becomes bare error
        rows (poison, in `take`). Those always write: when a part of nothing but them
        fails too, the job's output itself is broken (a directory gone or replaced by a
        file), and the job fails."""
        held = self.held.get(job, [])
        kind = boundary.classify(exc)
        if kind is Fault.JOB and held and all(h.poison for h in held):
            await self.job_fault(job, "write a part of the job's output", exc, [])
            return
        out.drop_pending()
        held = self.held.pop(job, [])
        if kind is Fault.RESOURCE:
            await self.wait_for_resources(job, exc, [h.msg for h in held])
            return
        log.error("part write failed; its messages will be redelivered", job=job, error=repr(exc))
        await asyncio.gather(*(h.msg.nak(delay=1.0) for h in held), return_exceptions=True)

    async def check_jobs(self, jobs: list[str] | None = None) -> None:
        """Publish progress; finish sealed jobs whose every row is on disk. A job is done
        once its done status is stored: until that put succeeds it is tried every round."""
        for job in jobs if jobs is not None else list(self.outputs):
            try:
                await self.check_job(job)
            except Exception as exc:  # noqa: BLE001 - the job boundary: one job's fault never stops the sink
                await self.job_fault(job, "finish the job", exc, [])

    async def check_job(self, job: str) -> None:
        """`check_jobs` for one job."""
        out = self.outputs.get(job)
        if out is None or (out.done and job not in self.unannounced):
            return
        lookup = await self.jobs.get(job)
        spec = lookup.spec
        if spec is None:
            return
        complete = lifecycle.complete(spec, out.rows, bool(out.pending), time.monotonic() - out.last_added, time.time())
        if complete and not out.done:
            try:
                self.unannounced[job] = await self.finish(job, out, spec)  # sets out.done
            except export.ExportFailed as exc:
                out.done = False  # finished again next round
                log.warning("job results not exported, tried again", job=job, error=str(exc))
                return
        elif not complete:
            self.unannounced.pop(job, None)  # rows came after its summary: finished again later
        summary = self.unannounced.get(job) if complete else None
        if not complete and out.rows == 0:
            # Nothing to report yet (a job opened by a done query, before its first
            # row): writing a progress status would hide a `failed` the ingestor put.
            return
        if await self.put_status(job, self.status_of(job, out, spec, summary), done=complete) and complete:
            self.unannounced.pop(job, None)
            self.reconciler.forget(job)
            self.progress.pop(job, None)
            metrics.SINK_JOBS_DONE.inc()
            log.info("job complete", **lifecycle.status_summary(summary))
            await self.forget_inputs(job)

    async def finish(self, job: str, out: JobOutput, spec: m.JobSpec) -> dict:
        """Every row of `job` is on disk: write `_summary.json` (and, for a job of no rows,
        an empty part, so its directory reads as an empty table). Returns the summary."""
        if self.faults.exit_before_done and out.rows > 0 and await asyncio.to_thread(lifecycle.claim_exit, self.root):
            try:
                await self.nc.flush(timeout=2)  # the acks of its last part reach the server first
            finally:
                lifecycle.exit_now(job)
        async with self.disk:
            if not out.parts():
                name = f"part-{out.next_part:06d}.parquet"  # the writer's name of its next part
                await asyncio.to_thread(lifecycle.write_empty_part, out.dir, out.schema, name)
                out.next_part += 1
            summary = await asyncio.to_thread(out.write_summary, spec)
            if spec.deliver == export.DELIVER:  # the batch service reads the results from the object store
                ok_path, err_path = out.dir / "_batch" / "output.jsonl", out.dir / "_batch" / "errors.jsonl"
                await asyncio.to_thread(export.write_lines, out.parts(), spec.model, ok_path, err_path)
                await export.put_results(self.js, job, ok_path, err_path)
            return summary

    def status_of(self, job: str, out: JobOutput, spec: m.JobSpec, summary: dict | None) -> m.JobStatus:
        """The job's status: progress, or done with its summary (no per-replica totals)."""
        now = time.time()
        done = summary is not None
        prompt, cached, output = out.tokens
        return m.JobStatus(
            job, out.rows, out.errors, spec.total, done, now, lifecycle.status_summary(summary),
            created_at=spec.created_at, rate=0.0 if done else self.rate(job, out.rows),
            prompt_tokens=prompt, cached_tokens=cached, output_tokens=output, expires_at=now + job_retention(),
            duplicates=out.duplicates,
            cancelled=done and bool(spec.ended_at(now)) and (spec.total is None or out.rows < spec.total),
        )

    async def put_status(self, job: str, status: m.JobStatus, *, done: bool) -> bool:
        """Store a job's status; False (logged) if the put failed: retried next round."""
        try:
            if done:
                self.faults.before_done_put(job)
            await self.status_kv.put(job, m.encode_json(status))
            return True
        except Exception as exc:  # noqa: BLE001 - transport or server errors alike; retried next round
            log.warning("status update failed", job=job, done=done, error=repr(exc))
            return False

    async def reconcile(self) -> None:
        """Check the sealed jobs that are due (`lifecycle.Reconciler`): a job not done or
        failed and not open here is opened from disk and checked, so it completes even if
        the sink crashed before its done status or forgot it (eviction)."""
        for job, _ in self.reconciler.take_expired(time.time()):
            self.reconciler.due[job] = 0.0  # past its deadline: completes as expired (if not done)
        for job in self.reconciler.take_due(time.monotonic()):
            if job in self.outputs:
                continue  # open: check_jobs sees it every round
            try:
                await self.reconcile_job(job)
            except Exception as exc:  # noqa: BLE001 - the job boundary: one job's fault never stops the sink
                await self.job_fault(job, "check the job", exc, [])

    async def reconcile_job(self, job: str) -> None:
        """`reconcile` for one due job."""
        try:
            known = await lifecycle.read_status(self.status_kv, job)
        except lifecycle.StatusUnreadable as exc:
            log.warning("reconcile: status unreadable, checked again later", job=job, error=repr(exc.__cause__))
            return
        if known is not None and (known.done or known.failed):
            self.reconciler.forget(job)
            return
        if (await self.jobs.get(job, fresh=True)).spec is None:
            self.reconciler.forget(job)  # expired, deleted or not runnable
            return
        if await self.output(job) is None:
            return  # refused (forgotten by `refuse`), or gone
        log.info("reconcile: sealed job not done, checking it", job=job)
        await self.check_jobs([job])

    async def forget_inputs(self, job: str) -> None:
        """A done job's input columns are in its parts: drop the cached and stored copies."""
        self.inputs.drop(job)
        try:
            await purge_job_blobs(self.js, job)
        except Exception as exc:  # noqa: BLE001 - they expire anyway (the blob stream's max_age)
            log.warning("blob purge failed", job=job, error=repr(exc))

    def rate(self, job: str, rows: int) -> float:
        """Rows per second the job made over the last RATE_WINDOW seconds (0 until there
        is a second of history)."""
        now = time.monotonic()
        seen = self.progress.setdefault(job, deque())
        seen.append((now, rows))
        while len(seen) > 2 and now - seen[1][0] >= RATE_WINDOW:
            seen.popleft()
        t0, rows0 = seen[0]
        return round((rows - rows0) / (now - t0), 2) if now - t0 >= 1.0 else 0.0


def count_part(stats) -> None:
    """Metrics of a part on disk: rows out, error rows by reason, tokens by replica."""
    if stats is None:
        return
    metrics.PROMPTS_OUT.labels("ok").inc(stats.ok)
    n_errors = sum(stats.errors.values())
    if n_errors:
        metrics.PROMPTS_OUT.labels("error").inc(n_errors)
        for text, n in stats.errors.items():
            metrics.ERROR_ROWS.labels(metrics.error_reason(text)).inc(n)
    for replica, (prompt, cached, output) in stats.replicas.items():
        metrics.SINK_PROMPT_TOKENS.labels(replica).inc(prompt)
        metrics.SINK_CACHED_TOKENS.labels(replica).inc(cached)
        metrics.SINK_OUTPUT_TOKENS.labels(replica).inc(output)
