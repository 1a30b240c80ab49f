"""Engine-worker (one per GPU / replica): keeps its engine continuously fed.

1. Pull work batches from `pfx.work.<replica>` while fewer than `window` prompts are in
   flight, and submit every prompt to the engine at once (vLLM's scheduler does the
   continuous batching).
2. As prompts finish, collect results per job and publish them to `pfx.results.<job>` in
   small batches (`result_batch` rows or `result_linger` seconds).
3. Ack a work batch once all its results are durably published.
4. Every second publish an `EngineStatus` on `pfx.status.<replica>` (load, KV cache,
   prefix-cache hits) for the router.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import defaultdict

import msgspec
import structlog
from nats.aio.msg import Msg

from shared.wire import messages as m
from shared.wire import subjects
from shared.prefix import tokens as tk
from shared.process.config import EngineWorkerConfig
from shared.bus.jobs import JobCache
from shared.bus.pull import DurablePull
from shared.bus.connection import close, connect
from shared.bus.provision import provision
from shared.bus.poison import error_rows, is_poison, quarantine
from shared.bus.publish import PublishError, publish
from shared.bus.pull import keep_in_progress
from services.engine_worker.engines import RequestFailed, make_engine
from services.engine_worker.grouping import GroupPriorities

log = structlog.get_logger()

STATUS_MIN_GAP = 0.02
"""Seconds between two status messages at least."""


class EngineDead(Exception):
    pass


class EngineWorker:
    def __init__(self, cfg: EngineWorkerConfig) -> None:
        self.cfg = cfg
        self.engine = make_engine(cfg)
        self.ready = False
        self.inflight = 0
        self.inflight_tokens = 0
        self.done_prompt_tokens = 0
        self.done_work_tokens = 0
        self.cached_tokens = 0
        self.completed = 0
        self.window_free = asyncio.Event()
        # work message sequence -> [message, results not yet published]
        self.holding: dict[int, list] = {}
        self.outbox: dict[str, list[tuple[m.Result, int]]] = defaultdict(list)
        self.tasks: set[asyncio.Task] = set()
        self.fatal: BaseException | None = None
        self.groups = GroupPriorities(block_size=cfg.hash_block_size, max_age=4 * cfg.window)
        self.scheduling = cfg.scheduling
        self.idle_seconds = 0.0
        """Time with no prompt in the engine, since start (the bench's idle fraction)."""
        self.idle_since: float | None = time.monotonic()
        self.max_running = 0
        self.last_status = 0.0
        self.status_due = asyncio.Event()
        """Set when completed work should reach the router before the next tick."""
        self.window = min(cfg.window, 64)
        """Current in-flight bound (adapted by `adapt_window`)."""

    async def run(self, stop: asyncio.Event) -> None:
        await self.engine.start()
        nc = await connect(self.cfg.nats_url, f"engine-{self.cfg.replica}")
        self.nc, self.js = nc, nc.jetstream()
        await provision(self.js)
        self.jobs = JobCache(await self.js.key_value(subjects.JOBS_KV))
        self.sub = sub = DurablePull(self.js, subjects.engine_consumer(self.cfg.replica))
        await nc.subscribe(subjects.engine_reset(self.cfg.replica), cb=self.on_reset)
        await nc.subscribe(subjects.engine_scheduling(self.cfg.replica), cb=self.on_scheduling)

        async def on_status_request(msg: Msg) -> None:
            await msg.respond(m.encode(self.status()))

        await nc.subscribe(subjects.engine_status_request(self.cfg.replica), cb=on_status_request)
        self.ready = True
        log.info("engine-worker ready", engine=self.cfg.engine, window=self.cfg.window)
        background = [
            asyncio.create_task(self.report_status(stop)),
            asyncio.create_task(self.linger_flush(stop)),
            asyncio.create_task(keep_in_progress(lambda: [h[0] for h in self.holding.values()], subjects.IN_PROGRESS_EVERY, stop)),
        ]
        while not stop.is_set() and self.fatal is None:
            room = self.window - self.inflight
            if room <= 0:
                self.window_free.clear()
                try:
                    await asyncio.wait_for(self.window_free.wait(), 0.5)
                except asyncio.TimeoutError:
                    pass
                continue
            # One work batch (up to --max-batch prompts) at a time.
            msgs = await sub.fetch(1, timeout=0.5)
            for msg in msgs:
                await self.start_batch(msg)
        await self.shutdown(stop, background)

    async def shutdown(self, stop: asyncio.Event, background: list[asyncio.Task]) -> None:
        ready_tasks = [t for t in self.tasks]
        if ready_tasks and self.fatal is None:
            _, pending = await asyncio.wait(ready_tasks, timeout=self.cfg.drain_timeout)
            for t in pending:  # unfinished prompts: their batches stay unacked -> redelivered
                t.cancel()
        await self.flush_all()
        stop.set()
        for t in background:
            t.cancel()
        self.ready = False
        await self.publish_status()
        await close(self.nc, self.sub)
        await self.engine.shutdown()
        if self.fatal is not None:
            log.error("engine dead: exiting for the supervisor to restart", error=repr(self.fatal))
            sys.exit(3)

    async def on_reset(self, msg: Msg) -> None:
        """Request/reply: empty the engine's prefix cache (benchmarks start each method
        from a cold cache without restarting the engine)."""
        ok = await self.engine.reset_prefix_cache()
        log.info("prefix cache reset", ok=ok)
        await msg.respond(b"ok" if ok else b"busy")

    async def on_scheduling(self, msg: Msg) -> None:
        """Request/reply: switch between `prefix-groups` and `fcfs` (benchmarks run the
        reference methods on vanilla FCFS vLLM)."""
        mode = msg.data.decode().strip()
        if mode not in ("prefix-groups", "fcfs"):
            await msg.respond(b"error: want prefix-groups or fcfs")
            return
        self.scheduling = mode
        log.info("scheduling set", scheduling=mode)
        await msg.respond(mode.encode())

    def _track_idle(self) -> None:
        now = time.monotonic()
        if self.inflight == 0 and self.idle_since is None:
            self.idle_since = now
        elif self.inflight > 0 and self.idle_since is not None:
            self.idle_seconds += now - self.idle_since
            self.idle_since = None

    async def start_batch(self, msg: Msg) -> None:
        try:
            work = m.work_batch_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            await quarantine(self.js, msg, f"undecodable work batch: {exc}")
            return
        seq = msg.metadata.sequence.stream
        if seq not in self.holding and is_poison(msg):
            # It keeps failing (say, a prompt that kills the engine): error rows, not a loop.
            await quarantine(self.js, msg, "generation failed repeatedly", error_rows(work.prompts, "poison message"))
            return
        if seq in self.holding or not work.prompts:
            if not work.prompts:
                await msg.ack()
            return
        self.holding[seq] = [msg, len(work.prompts)]
        if self.cfg.engine == "echo" and self.cfg.echo_crash_token >= 0:
            # Test hook of the echo engine: a prompt holding this token id kills the
            # worker like an engine-killing request would (exit 3, engine dead).
            if any(self.cfg.echo_crash_token in tk.unpack(p.tokens) for p in work.prompts):
                log.error("echo engine: crash token seen, dying like a dead engine")
                sys.exit(3)
        if self.cfg.engine == "echo" and not self.cfg.echo_delay:
            await self.echo_batch(seq, work.prompts)
            return
        lookups = {job: await self.jobs.get(job) for job in {p.job for p in work.prompts}}
        for prompt in work.prompts:
            lookup = lookups[prompt.job]
            self.inflight += 1
            self.inflight_tokens += prompt.work_tokens
            self._track_idle()
            task = asyncio.create_task(self.run_prompt(seq, prompt, lookup.spec, lookup.error))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def echo_batch(self, seq: int, prompts: list[m.Prompt]) -> None:
        """The instant echo engine: a whole batch at once, no task per prompt (so the
        pipeline benchmark measures the orchestration, not this worker's task overhead)."""
        specs = {job: (await self.jobs.get(job)).spec for job in {p.job for p in prompts}}
        for prompt in prompts:
            spec = specs[prompt.job]
            n = len(prompt.tokens) // tk.WIDTH
            out = min(n, spec.sampling.max_tokens if spec else 0)
            result = m.Result(
                prompt.id, prompt.columns, f"{out} tokens", m.FinishReason.LENGTH, n, 0, out, self.cfg.replica,
                None if spec else "unknown job",
            )
            self.outbox[prompt.job].append((result, seq))
            self.completed += 1
            self.done_prompt_tokens += n
            self.done_work_tokens += prompt.work_tokens
        for job in {p.job for p in prompts}:
            if len(self.outbox[job]) >= self.cfg.result_batch:
                await self.flush(job)

    async def run_prompt(self, seq: int, prompt: m.Prompt, spec: m.JobSpec | None, job_error: str | None) -> None:
        token_ids = tk.unpack(prompt.tokens)
        base = m.Result(prompt.id, prompt.columns, replica=self.cfg.replica, prompt_tokens=len(token_ids))
        try:
            if spec is None:
                raise RequestFailed(job_error or "unknown job")
            request_id = f"{prompt.job}:{prompt.id}:{uuid.uuid4().hex[:8]}"
            priority = self.groups.priority(prompt.tokens) if self.scheduling == "prefix-groups" else 0
            c = await self.engine.generate(request_id, prompt.id, token_ids, spec.sampling, priority)
            result = msgspec.structs.replace(
                base,
                output=c.output,
                finish_reason=c.finish_reason,
                prompt_tokens=c.prompt_tokens,
                cached_tokens=c.cached_tokens,
                output_tokens=c.output_tokens,
            )
            self.cached_tokens += c.cached_tokens
            self.done_prompt_tokens += c.prompt_tokens
        except RequestFailed as exc:
            result = msgspec.structs.replace(base, error=str(exc), finish_reason=m.FinishReason.ERROR)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - engine-level failure: stop the worker
            self.fatal = exc
            return
        finally:
            self.inflight -= 1
            self.inflight_tokens -= prompt.work_tokens
            self._track_idle()
            self.window_free.set()
        self.completed += 1
        self.done_work_tokens += prompt.work_tokens
        rows = self.outbox[prompt.job]
        rows.append((result, seq))
        if len(rows) >= self.cfg.result_batch:
            await self.flush(prompt.job)

    async def flush(self, job: str) -> None:
        rows = self.outbox.pop(job, [])
        if not rows:
            return
        try:
            for run in m.chunked([r for r, _ in rows], m.result_size, self.cfg.result_batch):
                await publish(self.js, subjects.results(job), m.encode(m.ResultBatch(job, run)))
        except PublishError as exc:
            # The batches stay unacked (and in_progress stops for none): redelivered later.
            log.error("result publish failed", job=job, error=str(exc))
            for seq in {s for _, s in rows}:
                held = self.holding.pop(seq, None)
                if held is not None:
                    await held[0].nak(delay=1.0)
            return
        for _, seq in rows:
            held = self.holding.get(seq)
            if held is None:
                continue
            held[1] -= 1
            if held[1] == 0:
                del self.holding[seq]
                await held[0].ack()
        # Completed work frees room at the router: tell it now, not at the next tick,
        # or a fast engine is throttled by the router's stale view.
        self.status_due.set()

    async def flush_all(self) -> None:
        await asyncio.gather(*(self.flush(job) for job in list(self.outbox)))

    async def linger_flush(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.cfg.result_linger)
            await self.flush_all()

    def status(self) -> m.EngineStatus:
        s = self.engine.snapshot()
        return m.EngineStatus(
            replica=self.cfg.replica,
            ts=time.time(),
            ready=self.ready,
            running=s.running,
            waiting=s.waiting,
            inflight=self.inflight,
            outstanding_tokens=self.inflight_tokens,
            kv_usage=s.kv_usage,
            kv_blocks=s.kv_blocks,
            block_size=s.block_size,
            prompt_tokens=self.done_prompt_tokens,
            done_tokens=self.done_work_tokens,
            window=self.window,
            cached_tokens=self.cached_tokens,
            completed=self.completed,
            idle_seconds=self.idle_seconds + (time.monotonic() - self.idle_since if self.idle_since is not None else 0.0),
        )

    def adapt_window(self) -> None:
        """In flight: twice what vLLM manages to run at once (its KV cache decides), between
        16 and `--window`. Keeps vLLM's queue from running dry without pulling work out of
        the bucketer (where it can still be grouped) long before the engine can use it."""
        snap = self.engine.snapshot()
        if not snap.kv_blocks:  # no KV cache to respect (echo engine): keep --window
            self.window = self.cfg.window
            return
        self.max_running = max(self.max_running, snap.running)
        if self.max_running:
            self.window = max(16, min(self.cfg.window, 2 * self.max_running))

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
            except asyncio.TimeoutError:
                pass
            self.status_due.clear()
