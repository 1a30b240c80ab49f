"""Sink: writes results to Parquet, exactly once per (job, id), and tracks job progress.

Loop: pull result batches from `pfx.results.*` -> drop ids already written -> queue rows
per job -> every `flush_seconds` (or `flush_rows`) write a part per job, then ack the
messages whose rows are now on disk -> update the job's status in the status KV bucket ->
a sealed job whose row count reached its total gets `_summary.json` and `done`.

A poison results message (written and failed too often) is copied to the dead-letter
stream at once, its rows queued as error rows, and it is terminated only once those rows
are on disk, like an ack: a crash in between redelivers it instead of losing the rows.

Output is confined to `--out-root`: a job whose `out_dir` resolves outside it (`..`,
another absolute path, a symlink out) is marked failed with the reason in its status, its
results are dropped, and nothing is created or written for it.
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
from shared.bus.provision import provision
from shared.bus.consume import decode_or_quarantine
from shared.bus.poison import dead_letter, deliveries, is_poison, quarantine
from shared.process import metrics
from services.sink.inputs import InputCache
from services.sink.large import resolve_or_hand_back
from services.sink.writer import JobOutput, OutsideRoot, confine
from shared.bus.blobs import purge_job_blobs

log = structlog.get_logger()

MAX_OPEN_JOBS = 256
"""Job outputs kept open; past it, idle ones are forgotten (reopened from disk if needed)."""
RATE_WINDOW = 30.0
"""Seconds of progress a job's rate (rows per second, hence its ETA) is measured over."""
MAX_REFUSED_JOBS = 10_000
"""Refused jobs remembered (their results are dropped at once); the oldest are forgotten
first (and refused again, from their spec, if more of their results arrive)."""


class Held(NamedTuple):
    """A message whose rows are queued, settled once its job's part is on disk."""

    msg: Msg
    poison: bool
    """Dead-lettered already: terminated, not acked (and still nak'd if the write fails)."""


class Sink:
    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.outputs: dict[str, JobOutput] = {}
        """Open jobs. A done job (`JobOutput.done`) is not checked again; done ones are
        forgotten first, so nothing here grows with the number of jobs ever run."""
        self.held: dict[str, list[Held]] = {}
        """Messages whose rows are queued, by job: settled once their job's part is on disk."""
        self.pending_rows = 0
        self.last_flush = time.monotonic()
        self.root = Path(os.path.realpath(cfg.out_root or os.getcwd()))
        """Every job writes under this directory (`--out-root`, default the working directory)."""
        self.refused: OrderedDict[str, str] = OrderedDict()
        """Jobs whose out_dir is outside the root -> why (their results are dropped)."""
        self.progress: dict[str, deque[tuple[float, int]]] = {}
        """Open jobs -> (monotonic time, rows on disk) over the last RATE_WINDOW seconds."""
        self.inputs = InputCache(cfg.inputs_cache or None)
        """Local copies of the blobs of input columns the queued rows need."""
        metrics.SINK_PENDING_ROWS.set_function(lambda: self.pending_rows)
        metrics.SINK_OPEN_JOBS.set_function(lambda: len(self.outputs))

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "sink")
        self.js = nc.jetstream()
        await provision(self.js)
        self.jobs = JobCache(await self.js.key_value(subjects.JOBS_KV), ttl=1.0)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        sub = DurablePull(self.js, subjects.sink_consumer())
        log.info("sink ready", out_root=str(self.root))
        last_check = 0.0
        while not stop.is_set():
            msgs = await sub.fetch(self.cfg.fetch_batch, timeout=0.2)
            for msg in msgs:
                await self.take(msg)
            now = time.monotonic()
            if self.pending_rows >= self.cfg.flush_rows or (self.held and now - self.last_flush >= self.cfg.flush_seconds):
                await self.flush()
            if now - last_check >= 1.0:
                last_check = now
                await self.check_jobs()
        await self.flush()
        await close(nc, sub)
        self.inputs.close()

    async def output(self, job: str) -> JobOutput | None:
        out = self.outputs.pop(job, None)
        if out is not None:
            self.outputs[job] = out  # most recently used last
            return out
        lookup = await self.jobs.get(job, fresh=True)
        if lookup.spec is None:
            return None
        try:
            out_dir = confine(self.root, lookup.spec.out_dir)
        except OutsideRoot as exc:
            await self.refuse(job, str(exc))
            return None
        if len(self.outputs) >= MAX_OPEN_JOBS:
            self.evict()
        out = self.outputs[job] = await asyncio.to_thread(JobOutput, job, out_dir)
        log.info("job opened", job=job, out_dir=str(out_dir), rows_on_disk=out.rows)
        return out

    async def refuse(self, job: str, why: str) -> None:
        """Mark `job` failed (its out_dir escapes the root); its results get dropped."""
        log.error("job refused", job=job, error=why)
        status = m.JobStatus(job, updated_at=time.time(), failed=True, error=why)
        try:
            await self.status_kv.put(job, m.encode_json(status))
        except Exception as exc:  # noqa: BLE001 - not remembered: the next result tries again
            log.warning("status update failed", job=job, error=repr(exc))
            return
        self.refused[job] = why
        while len(self.refused) > MAX_REFUSED_JOBS:
            self.refused.popitem(last=False)

    def evict(self) -> None:
        """Forget half the open outputs: finished jobs first, then the least recently
        used ones with nothing queued (an unfinished job is reopened from its parts on
        disk when its next row arrives, so abandoned jobs cannot pile up)."""
        idle = [j for j, o in self.outputs.items() if not o.pending and j not in self.held]
        for job in sorted(idle, key=lambda j: not self.outputs[j].done)[: max(len(self.outputs) // 2, 1)]:
            del self.outputs[job]
            self.progress.pop(job, None)

    async def take(self, msg: Msg) -> None:
        # The consume protocol (shared/bus/consume.py) without its ledger: the sink holds
        # results per job until they are written (`held`, settled in `flush`).
        if (batch := await decode_or_quarantine(self.js, msg, m.result_batch_decoder, "result batch")) is None:
            return
        out = None if batch.job in self.refused else await self.output(batch.job)  # may refuse it
        if batch.job in self.refused:
            # Its out_dir escapes the output root: the results are dropped (acked, so
            # they are not redelivered), nothing is written for the job.
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
        try:  # when the results reached the stream: the finish time of rows that have none
            reached = msg.metadata.timestamp.timestamp()
        except Exception:  # noqa: BLE001 - not a JetStream message (tests)
            reached = time.time()
        added = sum(out.add(r, reached) for r in results)
        self.pending_rows += added
        if added < len(results):
            metrics.SINK_DUPLICATES.inc(len(results) - added)
        self.held.setdefault(batch.job, []).append(Held(msg, poison))

    async def flush(self) -> None:
        written = {}
        for job, out in list(self.outputs.items()):
            if not out.pending:
                continue
            try:
                t0 = time.perf_counter()
                await self.inputs.fetch(self.js, job, out.sources())  # the rows' input columns
                written[job] = await asyncio.to_thread(out.flush, functools.partial(self.inputs.table, job))
                metrics.SINK_PART_SECONDS.observe(time.perf_counter() - t0)
                count_part(out.last_part)
            except Exception as exc:  # noqa: BLE001 - one job's bad rows must not stop the others
                log.error("part write failed; its messages will be redelivered", job=job, error=repr(exc))
                out.drop_pending()
                await asyncio.gather(*(h.msg.nak(delay=1.0) for h in self.held.pop(job, [])), return_exceptions=True)
        # Every message still held has its rows on disk now (or had only duplicates).
        settle = [h.msg.term() if h.poison else h.msg.ack() for held in self.held.values() for h in held]
        await asyncio.gather(*settle, return_exceptions=True)
        self.held, self.pending_rows, self.last_flush = {}, 0, time.monotonic()
        for job, n in written.items():
            out = self.outputs[job]
            log.info("part written", job=job, rows=n, total_rows=out.rows, errors=out.errors)
        if written:
            await self.check_jobs(list(written))

    async def check_jobs(self, jobs: list[str] | None = None) -> None:
        """Publish progress; finish sealed jobs whose every row is on disk."""
        for job in jobs if jobs is not None else list(self.outputs):
            out = self.outputs[job]
            if out.done:
                continue
            lookup = await self.jobs.get(job)
            spec = lookup.spec
            if spec is None:
                continue
            complete = spec.total is not None and out.rows >= spec.total and not out.pending
            summary = None
            if complete:
                summary = await asyncio.to_thread(out.write_summary, spec)  # sets out.done
                log.info("job complete", **{k: v for k, v in summary.items() if k != "replicas"})
                await self.forget_inputs(job)
            if complete:
                metrics.SINK_JOBS_DONE.inc()
            prompt, cached, output = out.tokens
            status = m.JobStatus(
                job, out.rows, out.errors, spec.total, complete, time.time(), summary,
                created_at=spec.created_at, rate=0.0 if complete else self.rate(job, out.rows),
                prompt_tokens=prompt, cached_tokens=cached, output_tokens=output,
            )
            if complete:
                self.progress.pop(job, None)
            try:
                await self.status_kv.put(job, m.encode_json(status))
            except Exception as exc:  # noqa: BLE001 - progress only; retried next round
                log.warning("status update failed", job=job, error=repr(exc))

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
