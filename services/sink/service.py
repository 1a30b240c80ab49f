"""Sink: writes results to Parquet, exactly once per (job, id), and tracks job progress.

Loop: pull result batches from `pfx.results.*` -> drop ids already written -> queue rows
per job -> every `flush_seconds` (or `flush_rows`) write a part per job, then ack the
messages whose rows are now on disk -> update the job's status in the status KV bucket ->
a sealed job whose row count reached its total gets `_summary.json` and `done`.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import structlog
from nats.aio.msg import Msg

from shared.wire import messages as m
from shared.wire import subjects
from shared.process.config import SinkConfig
from shared.bus.jobs import JobCache
from shared.bus.pull import DurablePull
from shared.bus.connection import close, connect
from shared.bus.provision import provision
from shared.bus.poison import deliveries, is_poison, quarantine
from shared.bus.publish import ack_all
from services.sink.writer import JobOutput

log = structlog.get_logger()

MAX_OPEN_JOBS = 256


class Sink:
    def __init__(self, cfg: SinkConfig) -> None:
        self.cfg = cfg
        self.outputs: dict[str, JobOutput] = {}
        self.done: set[str] = set()
        self.held: dict[str, list[Msg]] = {}
        """Messages whose rows are queued, by job: acked once their job's part is on disk."""
        self.pending_rows = 0
        self.last_flush = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "sink")
        self.js = nc.jetstream()
        await provision(self.js)
        self.jobs = JobCache(await self.js.key_value(subjects.JOBS_KV), ttl=1.0)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        sub = DurablePull(self.js, subjects.sink_consumer())
        log.info("sink ready")
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

    async def output(self, job: str) -> JobOutput | None:
        out = self.outputs.get(job)
        if out is not None:
            return out
        lookup = await self.jobs.get(job, fresh=True)
        if lookup.spec is None:
            return None
        if len(self.outputs) >= MAX_OPEN_JOBS:  # forget finished jobs first (reloaded from disk if needed)
            for name in [j for j in self.outputs if j in self.done][: len(self.outputs) // 2]:
                del self.outputs[name]
        out = self.outputs[job] = await asyncio.to_thread(JobOutput, job, lookup.spec.out_dir)
        self.done.discard(job)
        log.info("job opened", job=job, out_dir=lookup.spec.out_dir, rows_on_disk=out.rows)
        return out

    async def take(self, msg: Msg) -> None:
        try:
            batch = m.result_batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.error("undecodable result batch: terminated", error=str(exc))
            await msg.term()
            return
        out = await self.output(batch.job)
        if out is None:
            if is_poison(msg):
                await quarantine(self.js, msg, f"results for unknown job {batch.job!r}")
            else:
                log.warning("results for an unknown job: retried later", job=batch.job)
                await msg.nak(delay=5.0)
            return
        results = batch.results
        if is_poison(msg):
            # Writing these rows failed again and again: keep only id and an error, which
            # always writes, so the job still completes; the original is dead-lettered.
            why = f"poison message: result could not be written after {deliveries(msg)} deliveries"
            results = [m.Result(r.id, error=why, finish_reason=m.FinishReason.ERROR, replica=r.replica) for r in results]
            await quarantine(self.js, msg, "sink failed repeatedly")
            msg = None
        added = sum(out.add(r) for r in results)
        self.pending_rows += added
        if added:
            self.done.discard(batch.job)
        if msg is not None:
            self.held.setdefault(batch.job, []).append(msg)

    async def flush(self) -> None:
        written = {}
        for job, out in list(self.outputs.items()):
            if not out.pending:
                continue
            try:
                written[job] = await asyncio.to_thread(out.flush)
            except Exception as exc:  # noqa: BLE001 - one job's bad rows must not stop the others
                log.error("part write failed; its messages will be redelivered", job=job, error=repr(exc))
                out.drop_pending()
                await asyncio.gather(*(msg.nak(delay=1.0) for msg in self.held.pop(job, [])), return_exceptions=True)
        await ack_all([msg for msgs in self.held.values() for msg in msgs])
        self.held, self.pending_rows, self.last_flush = {}, 0, time.monotonic()
        for job, n in written.items():
            out = self.outputs[job]
            log.info("part written", job=job, rows=n, total_rows=out.rows, errors=out.errors)
        if written:
            await self.check_jobs(list(written))

    async def check_jobs(self, jobs: list[str] | None = None) -> None:
        """Publish progress; finish sealed jobs whose every row is on disk."""
        for job in jobs if jobs is not None else list(self.outputs):
            if job in self.done:
                continue
            out = self.outputs[job]
            lookup = await self.jobs.get(job)
            spec = lookup.spec
            if spec is None:
                continue
            complete = spec.total is not None and out.rows >= spec.total and not out.pending
            summary = None
            if complete:
                summary = await asyncio.to_thread(out.write_summary, spec)
                self.done.add(job)
                log.info("job complete", **{k: v for k, v in summary.items() if k != "replicas"})
            status = m.JobStatus(job, out.rows, out.errors, spec.total, complete, time.time(), summary)
            try:
                await self.status_kv.put(job, m.encode_json(status))
            except Exception as exc:  # noqa: BLE001 - progress only; retried next round
                log.warning("status update failed", job=job, error=repr(exc))
