"""The engine-worker's status (mixed into `service.EngineWorker`): every
`status_interval`, or as soon as completed work is due, an `EngineStatus` on
`pfx.status.<replica>` (ready, load, KV cache, prefix-cache hits, the window the router's
cap follows); before each, the window is sized from what the engine runs
(`window.Window`).
"""

from __future__ import annotations

import asyncio
import heapq
import time

import structlog

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()

STATUS_MIN_GAP = 0.02
"""Seconds between two status messages at least."""


def step_model(stats, window: int) -> m.StepModel | None:
    """The engine's step model for the ETA (`m.StepModel`) from its stats, its slots the
    least of vLLM's `max_num_seqs` and the worker's window; None until measured."""
    if stats.step is None:
        return None
    slots = min((x for x in (stats.max_seqs, window) if x > 0), default=0)
    s0, prompt_s, output_s = stats.step
    model = m.StepModel(round(s0, 6), round(prompt_s, 9), round(output_s, 9), stats.batch_tokens, slots,
                        stats.kv_blocks * stats.block_size)
    return model if model.valid() else None


class StatusReport:
    """Status and window sizing; `self` is the `EngineWorker`."""

    def _track_idle(self) -> None:
        now = time.monotonic()
        if self.feeder.inflight == 0 and self.idle_since is None:
            self.idle_since = now
        elif self.feeder.inflight > 0 and self.idle_since is not None:
            self.idle_seconds += now - self.idle_since
            self.idle_since = None

    def status(self) -> m.EngineStatus:
        s = self.engine.snapshot()
        return m.EngineStatus(
            replica=self.cfg.replica,
            ts=time.time(),
            ready=self.ready,
            running=s.running,
            waiting=s.waiting,
            inflight=self.feeder.inflight,
            outstanding_tokens=self.feeder.held_tokens,
            kv_usage=s.kv_usage,
            kv_blocks=s.kv_blocks,
            block_size=s.block_size,
            prompt_tokens=self.done_prompt_tokens,
            done_tokens=self.done_work_tokens,
            window=self.window.limit,
            generated_tokens=s.generated,
            jobs=dict(self.feeder.jobs),
            cache_epoch=self.cache_epoch,
            decode_cost=s.decode_cost,
            preemptions=s.preemptions,
            adapters=self.engine.adapters,
            lora_slots=self.engine.lora_slots,
            loras=dict(self.feeder.loras),
            oldest=self.oldest_in_engine(),
            cached_tokens=self.cached_tokens,
            completed=self.completed,
            output_tokens=self.output_tokens,
            deduplicated=self.deduplicated,
            merged=self.merged,
            idle_seconds=self.idle_seconds + (time.monotonic() - self.idle_since if self.idle_since is not None else 0.0),
        )

    def oldest_in_engine(self) -> list[m.InEngine]:
        """Per job, its rows in the engine that were admitted first (`m.OLDEST_IDS` ids)."""
        by_job: dict[str, list[tuple[float, m.PromptId]]] = {}
        for held in self.in_engine.values():
            if held.prompt.admitted_at:
                by_job.setdefault(held.prompt.job, []).append((held.prompt.admitted_at, held.prompt.id))
        out = []
        for job, rows in by_job.items():
            first = heapq.nsmallest(m.OLDEST_IDS, rows, key=lambda row: row[0])
            out.append(m.InEngine(job, len(rows), [pid for _, pid in first], first[0][0]))
        return out

    def adapt_window(self) -> None:
        """Size the window from what the engine runs and generates (`window.Window`)."""
        snap = self.engine.snapshot()
        self.feeder.admission.resize(snap.kv_blocks, snap.block_size)
        if not self.ready:  # an engine still starting reports no KV cache yet: not the echo engine's "none"
            return
        self.window.observe(time.monotonic(), snap.kv_blocks, snap.running, snap.generated, self.feeder.inflight)
        self.feeder.feed()

    async def publish_status(self) -> None:
        self.last_status = time.monotonic()
        try:
            await self.nc.publish(subjects.status(self.cfg.replica), m.encode(self.status()))
        except Exception:  # noqa: BLE001 - reconnecting: the next tick retries
            pass

    async def report_status(self, stop: asyncio.Event) -> None:
        last_log = 0.0
        while not stop.is_set():
            self.adapt_window()
            await self.publish_status()
            now = time.monotonic()
            if now - last_log >= 10.0 and self.completed:
                last_log = now
                s = self.status()
                log.info("engine status", inflight=s.inflight, running=s.running, waiting=s.waiting,
                         completed=s.completed, kv_usage=round(s.kv_usage, 3),
                         hit_rate=round(s.cached_tokens / max(s.prompt_tokens, 1), 3))
            # Next status at the tick, or as soon as completed work is due (at most every
            # STATUS_MIN_GAP: a fast engine must not flood the router).
            await asyncio.sleep(STATUS_MIN_GAP)
            try:
                await asyncio.wait_for(self.status_due.wait(), max(self.cfg.status_interval - STATUS_MIN_GAP, 0.0))
            except TimeoutError:
                pass
            self.status_due.clear()
