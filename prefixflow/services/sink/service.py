"""Sink: writes results to Parquet, exactly once per (job, id), and tracks job progress.

Loop: pull result batches from `pfx.results.*` -> drop ids already written -> queue rows
per job -> every `flush_seconds` (or `flush_rows`) write a part per job, then ack the
messages whose rows are now on disk -> update the job's status in the status KV bucket ->
a sealed job whose row count reached its total gets `_summary.json` and `done`.

A job owns its output directory (`prefixflow/services/sink/binding.py`): it is bound (`_job.json`)
before anything is written, and a job whose `out_dir` another job owns fails unless its
spec says `overwrite`. Completion is durable (`prefixflow/services/sink/lifecycle.py`): a job is done
once its done status is stored, retried every round until then, and every sealed job not
yet done is checked again after a restart or an eviction (a watch on the jobs bucket). Done
queries (`prefixflow/services/sink/queries.py`) tell a resuming client which ids are on disk.

A poison results message (written and failed too often) is copied to the dead-letter
stream at once, its rows queued as error rows, and it is terminated only once those rows
are on disk, like an ack: a crash in between redelivers it instead of losing the rows.

Output is confined to `--out-root`: a job whose `out_dir` resolves outside it (`..`,
another absolute path, a symlink out) is marked failed with the reason in its status, its
results are dropped, and nothing is created or written for it.

A bad job fails alone: every exception on one job's path ends at the job boundary
(`prefixflow/services/sink/failures.py`), which fails that job or retries its messages; the sink and
every other job go on. A job id outside the grammar (`subjects.job_id_error`) on a
results subject is dead-lettered with the reason on sight; a done query for one gets an
error reply. Also here: `held.py` (messages held), `progress.py` (a job's status as it
goes), `finishing.py` (a finished job's files), `reconcile.py` (sealed jobs due a check).
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path

import structlog
from nats.aio.msg import Msg

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.provenance import parse_key, refusal
from prefixflow.shared.process.config import SinkConfig
from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.bus.pull import DurablePull
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.bus.consume import decode_or_quarantine
from prefixflow.shared.bus.poison import dead_letter, quarantine, reject
from prefixflow.shared.process import metrics
from prefixflow.services.sink.growth import RewriteFailed
from prefixflow.services.sink import boundary, export, finishing, lifecycle, queries
from prefixflow.services.sink.boundary import Fault
from prefixflow.services.sink.binding import Action, open_bound
from prefixflow.services.sink.failures import Failures
from prefixflow.services.sink.held import Held
from prefixflow.services.sink.inputs import InputCache
from prefixflow.services.sink.large import resolve_or_hand_back
from prefixflow.services.sink.pause import Pauses
from prefixflow.services.sink.progress import Progress, count_part
from prefixflow.services.sink.reconcile import reconcile
from prefixflow.services.sink.roots import OutsideRoot, Roots
from prefixflow.services.sink.store import confine_store
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.bus.blobs import purge_job_blobs

log = structlog.get_logger()

MAX_OPEN_JOBS = 256
"""Job outputs kept open; past it, idle ones are forgotten (reopened from disk if needed)."""


class Sink:
    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.result_key = parse_key(cfg.result_key)
        """Checks each replica's grant for the rows it answers (`provenance.py`; None: none made)."""
        self.outputs: dict[str, JobOutput] = {}
        """Open jobs. A done job (`JobOutput.done`, its done status stored) is not checked
        again; done ones are forgotten first, so nothing here grows with the number of jobs
        ever run."""
        self.held: dict[str, list[Held]] = {}
        """Messages whose rows are queued, by job: settled once their job's part is on disk."""
        self.pending_rows = 0
        self.last_flush = time.monotonic()
        self.roots = Roots.parse(cfg.out_root)
        """Where jobs may write (`--out-root`: a local directory, default the working
        directory, and object store prefixes; `roots.py`)."""
        self.root = self.roots.local
        self.progress = Progress()
        """Open jobs' rows on disk over the last seconds: their rate in their status."""
        self.inputs = InputCache(cfg.inputs_cache or None)
        """Local copies of the blobs of input columns the queued rows need."""
        self.unannounced: dict[str, dict] = {}
        """Open jobs whose `_summary.json` is written but whose done status is not stored
        yet -> their summary: the put is retried every round (never evicted meanwhile)."""
        self.reconciler = lifecycle.Reconciler()
        """Sealed jobs not known done or failed: checked (opened from disk) when due."""
        self.failures = Failures(self.reconciler, self.forget, lambda job, data: self.status_kv.put(job, data))
        """The job boundary: refused and failed jobs, and what a fault on a job's path does."""
        self.pauses = self.failures.pauses = Pauses(self.out_dir_of)
        """Jobs paused because their output lacks a resource (disk full...): `pause.py`."""
        self.refused = self.failures.refused  # jobs refused or failed -> why: their results are dropped
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
        self.pauses.connect(self.js, self.status_kv)
        sub = DurablePull(self.js, subjects.sink_consumer())
        done_queries = await nc.subscribe(subjects.ALL_DONE_QUERIES)
        await nc.flush()  # subscribed at the server before "ready"
        log.info("sink ready", out_root=str(self.roots))
        # Every loop under one TaskGroup: a task that dies ends the process (its
        # supervisor restarts it, JetStream redelivers what it held).
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.reconciler.watch(jobs_kv, stop, self.failures.spec_written))
            tg.create_task(queries.answer(self, done_queries, stop))
            await self.consume(sub, stop)
        await self.flush()
        await self.pauses.stop()
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
                await reconcile(self)
                await self.pauses.recheck()

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
            await self.failures.fail_job(job, boundary.reason("open the job's output", exc))
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
            if (known := await lifecycle.read_status(self.status_kv, job)) is not None and known.failed:
                # Failed before (by this sink before a restart, or another): its results are
                # dropped, nothing written for it; its status stays as it is.
                self.failures.remember_failed(job, known.error or "the job failed")
                return None
            try:
                # A tenant's jobs write under its own part of the root: another tenant's
                # directories are outside it.
                store = confine_store(self.roots, spec.out_dir, subjects.tenant_of(job) or "")
            except OutsideRoot as exc:
                await self.failures.refuse(job, str(exc))
                return None
            if evict and len(self.outputs) >= MAX_OPEN_JOBS:
                self.evict()
            decision, out = await asyncio.to_thread(open_bound, job, store, spec)
            if out is None:
                await self.failures.refuse(job, decision.error or "out_dir is bound to another job")
                return None
            if decision.action is Action.REPLACE and decision.previous:
                await self.release(decision.previous, job, spec.out_dir)
            self.outputs[job] = out
        log.info("job opened", job=job, out_dir=store.where, rows_on_disk=out.rows, binding=decision.action.value,
                 previous_job=decision.previous)
        return out

    async def out_dir_of(self, job: str) -> Path:
        """`job`'s output directory (the output root if it cannot be told)."""
        if (out := self.outputs.get(job)) is not None:
            return out.dir or self.root
        try:
            spec = (await self.jobs.get(job)).spec
            store = confine_store(self.roots, spec.out_dir, subjects.tenant_of(job) or "") if spec else None
            return (store.local_dir or self.root) if store else self.root
        except Exception:  # noqa: BLE001 - NATS away or an out_dir outside the root: the root is what is known
            return self.root

    async def release(self, previous: str, job: str, out_dir: str) -> None:
        """`job` took over `previous`'s directory (overwrite): if `previous` is open here,
        forget it, and drop its queued rows (their messages acked, as for a refused job)."""
        old = self.outputs.get(previous)
        if old is None:
            return
        held = self.forget(previous)
        await asyncio.gather(*(h.msg.ack() for h in held), return_exceptions=True)
        if not old.done:
            await self.failures.refuse(previous, f"out_dir {out_dir} was taken over by job {job} (--overwrite): "
                                                 "this job's output there is gone")

    def forget(self, job: str) -> list[Held]:
        """Drop what the sink holds of `job`: its open output and queued rows, its summary
        not announced yet and its progress. Returns its held messages, for the caller to
        settle."""
        out = self.outputs.pop(job, None)
        if out is not None:
            self.pending_rows = max(self.pending_rows - len(out.pending), 0)
            out.drop_pending()
        self.unannounced.pop(job, None)
        self.progress.forget(job)
        return self.held.pop(job, [])

    def evict(self) -> None:
        """Forget half the open outputs: finished jobs first, then the least recently
        used ones with nothing queued (an unfinished job is reopened from its parts on
        disk when its next row arrives, or by the reconciler if it is sealed, so abandoned
        jobs cannot pile up). A job whose done status is not stored yet stays."""
        idle = [j for j, o in self.outputs.items() if not o.pending and j not in self.held and j not in self.unannounced]
        for job in sorted(idle, key=lambda j: not self.outputs[j].done)[: max(len(self.outputs) // 2, 1)]:
            del self.outputs[job]
            self.progress.forget(job)

    async def take(self, msg: Msg) -> None:
        # The consume protocol (prefixflow/shared/bus/consume.py) without its ledger: the sink holds
        # results per job until they are written (`held`, settled in `flush`).
        origin, job = subjects.origin_and_job(msg.subject)
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
            await self.queue(batch, msg, origin)
        except Exception as exc:  # noqa: BLE001 - the job boundary: one job's fault never stops the sink
            await self.failures.job_fault(job, "take the job's results", exc, [msg])

    async def queue(self, batch: m.ResultBatch, msg: Msg, origin: str) -> None:
        """Queue the rows of `msg` for its job's next part (held until then), or drop them
        (acked) for a refused or failed job, or park them for a paused one. Rows whose
        origin holds no assignment of them are never written (`provenance.py`)."""
        if batch.job in self.pauses and batch.job not in self.refused:
            await self.pauses.park(batch.job, [msg])
            return
        out = None if batch.job in self.refused else await self.output(batch.job)  # may refuse it
        if batch.job in self.refused:
            # Its out_dir escapes the output root or is another job's, or the job failed
            # here (`fail_job`): the results are dropped (acked, so they are not
            # redelivered), nothing is written for the job.
            await msg.ack()
            return
        if out is None:
            if self.pauses.excused.is_poison(msg):
                await quarantine(self.js, msg, f"results for unknown job {batch.job!r}")
            else:
                log.warning("results for an unknown job: retried later", job=batch.job)
                await msg.nak(delay=5.0)
            return
        poison = self.pauses.excused.is_poison(msg)  # deliveries that were its own fault (not a pause)
        if not poison and (batch := await resolve_or_hand_back(self.js, batch, msg)) is None:
            return  # a result stored by reference could not be read now: redelivered (prefixflow/services/sink/large.py)
        results = await self.provenance(batch, msg, origin)
        if poison:
            # Writing these rows failed again and again: the original goes to the
            # dead-letter stream, and its rows become bare error rows (id, replica,
            # error), which always write, so the job still completes.
            # NOTE: the message is terminated in `flush`, once those rows are on disk: a
            # crash before then redelivers it (and dead-letters it again) instead of
            # losing its rows, and a failed write naks it.
            await dead_letter(self.js, msg, "sink failed repeatedly")
            why = f"poison message: result could not be written after {self.pauses.excused.own(msg)} deliveries"
            results = [m.error_result(r.id, why, replica=r.replica, src=r.src, row=r.row) for r in results]
        if batch.decode_cost > 0 and results:  # what an output token costs the engine that wrote these (the ETA)
            self.progress.note_cost(batch.job, results[0].replica, batch.decode_cost)
        if batch.step is not None and results:  # how fast that engine goes (the ETA's engine model)
            self.progress.note_step(batch.job, results[0].replica, batch.step)
        reached = msg.metadata.timestamp.timestamp()  # the finish time of rows that have none
        added = sum(out.add(r, reached) for r in results)
        self.pending_rows += added
        if added < len(results):
            metrics.SINK_DUPLICATES.inc(len(results) - added)
        self.held.setdefault(batch.job, []).append(Held(msg, poison))

    async def provenance(self, batch: m.ResultBatch, msg: Msg, origin: str) -> list[m.Result]:
        """The rows of `batch` that `origin` may answer: a replica's only with the grant of
        their assignment (`prefixflow/shared/wire/provenance.py`). The others are dropped,
        counted, and the message copied to the dead-letter stream with the reason; their
        rows stay open for the replica that holds them."""
        kept, refused = [], []
        for r in batch.results:
            (refused if (why := refusal(self.result_key, batch.job, origin, r)) else kept).append((r, why))
        if refused:
            metrics.SINK_RESULTS_REFUSED.inc(len(refused))
            why = refused[0][1] + (f" (and {len(refused) - 1} more rows)" if len(refused) > 1 else "")
            log.warning("results refused: no assignment", job=batch.job, origin=origin, rows=len(refused), reason=why)
            await dead_letter(self.js, msg, why)
        return [r for r, _ in kept]

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
            await self.failures.job_fault(job, "write a part of the job's output", exc, [])
            return
        out.drop_pending()
        held = self.held.pop(job, [])
        if kind is Fault.RESOURCE:
            await self.failures.wait_for_resources(job, exc, [h.msg for h in held])
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
                await self.failures.job_fault(job, "finish the job", exc, [])

    async def check_job(self, job: str) -> None:
        """`check_jobs` for one job."""
        out = self.outputs.get(job)
        if out is None or (out.done and job not in self.unannounced) or job in self.pauses:
            return  # (a paused job's status says so until it resumes: `pause.py`)
        lookup = await self.jobs.get(job)
        spec = lookup.spec
        if spec is None:
            return
        complete = lifecycle.complete(spec, out.rows, bool(out.pending), time.monotonic() - out.last_added, time.time())
        if complete and not out.done:
            try:
                self.unannounced[job] = await self.finish(job, out, spec)  # sets out.done
            except (export.ExportFailed, RewriteFailed) as exc:
                out.done = False  # finished again next round
                log.warning("job not finished (results not exported or a file not rewritten), tried again", job=job,
                            error=str(exc))
                return
        elif not complete:
            self.unannounced.pop(job, None)  # rows came after its summary: finished again later
        summary = self.unannounced.get(job) if complete else None
        if not complete and out.rows == 0:
            # Nothing to report yet (a job opened by a done query, before its first
            # row): writing a progress status would hide a `failed` the ingestor put.
            return
        if await self.put_status(job, self.progress.status(job, out, spec, summary), done=complete) and complete:
            self.unannounced.pop(job, None)
            self.reconciler.forget(job)
            self.progress.forget(job)
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
            return await finishing.write_final(self.js, job, out, spec, self.cfg.files_uri)

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

    async def forget_inputs(self, job: str) -> None:
        """A done job's input columns are in its parts: drop the cached and stored copies."""
        self.inputs.drop(job)
        try:
            await purge_job_blobs(self.js, job)
        except Exception as exc:  # noqa: BLE001 - they expire anyway (the blob stream's max_age)
            log.warning("blob purge failed", job=job, error=repr(exc))
