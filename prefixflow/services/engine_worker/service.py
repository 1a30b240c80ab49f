"""Engine-worker (one per GPU / replica): keeps its engine continuously fed, and outlives it.

1. Pull work batches from `pfx.work.<replica>` while fewer than `window` prompts are held,
   and submit them to the engine while fewer than `window` are in flight (vLLM's scheduler
   does the continuous batching). The window sizes itself (`window.Window`): one prompt
   alone first on a quiet engine (a fast first result), then what the engine can run.
2. As prompts finish, the outbox publishes their results to `pfx.results.<replica>.<job>` in small
   batches (`result_batch` rows or `result_linger` seconds).
3. The ack ledger acks a work batch once all its results are durably published.
4. Every `status_interval` publish an `EngineStatus` on `pfx.status.<replica>` (ready,
   load, KV cache, prefix-cache hits) for the router (`status.py`).
5. When the engine dies (`recovery.py`) (`EngineDead`: vLLM's engine-core process crashed or was killed;
   a failure of one request is that row's error row, never a rebuild), report not ready,
   publish what did finish and re-publish the unfinished prompts to this replica's own
   work subject (`isolate.py`: the untried as they were, the ones in flight as suspect
   batches that run alone, bisected, then one prompt at a time; a prompt that killed the
   engine alone `isolate.STRIKES` times is an error row), ack each work batch once all
   that is published, shut the engine down, start it again in this process, check it
   with a canary request, then take work again. More than `max_rebuilds` rebuilds within
   `rebuild_window` seconds (deaths while only suspects ran are not counted) exit with
   code 3, for the supervisor to restart the process.

A prompt whose job id is outside the grammar (`subjects.job_id_error`: a foreign work
message; the bucketer checks every job) is never run: it is dead-lettered with the reason
(its rows would have no results subject) and the rest of its batch runs.

Every task (the fetch loop, status, linger flush, in-progress keeper, one per prompt) runs
in one `asyncio.TaskGroup`: an unexpected exception in any of them hands the work back
and ends the process with a non-zero exit, never leaving a batch leased.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import uuid

import msgspec
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro import add_service
from nats.micro.request import Request, ServiceError
from nats.micro.service import Service

from prefixflow.services.engine_worker.engines import Completion, EngineDead, RequestFailed, is_engine_death, make_engine
from prefixflow.services.engine_worker.admission import KvAdmission
from prefixflow.services.engine_worker.dedupe import Deduper, Kind
from prefixflow.services.engine_worker.fanout import Fanout
from prefixflow.services.engine_worker.feeder import Feeder, Held
from prefixflow.services.engine_worker.kv_events import KeyTranslator
from prefixflow.services.engine_worker.kv_subscriber import CacheEventForwarder, KvEventSubscriber, events_config, ipc_endpoint
from prefixflow.services.engine_worker.requests import prompt_sampling
from prefixflow.services.engine_worker.grouping import EngineOrder
from prefixflow.services.engine_worker.outbox import Outbox
from prefixflow.services.engine_worker.recovery import Recovery
from prefixflow.services.engine_worker.status import StatusReport, step_model
from prefixflow.services.engine_worker.rebuild import GAVE_UP_EXIT_CODE, EngineGaveUp, RebuildBudget
from prefixflow.services.engine_worker.window import Window
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.control import SERVICE_VERSION, decode_request
from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.bus.consume import receive
from prefixflow.shared.bus.ledger import AckLedger, Lease
from prefixflow.shared.bus.poison import dead_letter
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.bus.pull import DurablePull, keep_in_progress
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.process.config import EngineWorkerConfig
from prefixflow.shared.wire import limits
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()

KV_TRANSLATOR_NODES = 1 << 20
"""The KV-event translator's bound until the engine reports its size."""
KV_TRANSLATOR_SLACK = 1024
SCHEDULING_MODES = ("prefix-groups", "fcfs")
"""What `pfx.engine.<replica>.scheduling` may set (`EngineWorkerConfig.scheduling`)."""


def is_cancelled(lookup: m.JobLookup) -> bool:
    """The job was cancelled, or its deadline passed: its prompts are not started."""
    return lookup.spec is not None and bool(lookup.spec.ended_at(time.time()))


class EngineWorker(Recovery, StatusReport, Fanout):
    def __init__(self, cfg: EngineWorkerConfig) -> None:
        self.cfg = cfg
        self.engine = make_engine(cfg)
        self.generate_batch = getattr(self.engine, "generate_batch", None)
        """Set for engines that complete a whole work batch at once (`BatchEngine`)."""
        self.ready = False
        self.death: BaseException | None = None
        """Why the engine died, until it is rebuilt."""
        self.budget = RebuildBudget(cfg.max_rebuilds, cfg.rebuild_window, cfg.rebuild_backoff)
        self.rebuilds = 0
        self.cache_epoch = uuid.uuid4().hex[:8]
        """A new one whenever the engine's prefix cache starts empty (`EngineStatus`)."""
        self.done_prompt_tokens = 0
        self.done_work_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0
        self.completed = 0
        self.window_free = asyncio.Event()
        self.ledger = AckLedger()
        """Work messages held until all their results are published."""
        self.prompt_tasks: set[asyncio.Task] = set()
        self.in_engine: dict[int, Held] = {}
        """Prompts submitted to the engine and not finished, by id(held): after a death,
        the ones it died with (the suspects, `isolate.py`)."""
        self.untried: list[Held] = []
        """Prompts held but not submitted when the engine died (re-published as they were)."""
        self.order = EngineOrder(block_size=cfg.hash_block_size, max_age=4 * cfg.window)
        self.scheduling = cfg.scheduling
        self.idle_seconds = 0.0
        """Time with no prompt in the engine, since start (the bench's idle fraction)."""
        self.idle_since: float | None = time.monotonic()
        self.last_status = 0.0
        self.status_due = asyncio.Event()
        """Set when completed work (or a change of readiness) should reach the router now."""
        self.window = Window(cfg.window, cfg.adaptive, cfg.first_result_seconds)
        """The in-flight bound (`window.limit`), sized from measurements (`adapt_window`)."""
        self.feeder = Feeder(self.window, self.submit, lambda: self.engine.snapshot().generated,
                             admission=KvAdmission(enabled=cfg.kv_admission, output_reserve=cfg.kv_output_reserve),
                             steps=lambda: self.engine.snapshot().steps, lora_slots=self.engine.lora_slots)
        """The prompts held here, submitted as the window allows."""
        self.dedupe: Deduper[Held] = Deduper()
        """Identical requests of a job run once (`dedupe.py`, `fanout.py`)."""
        self.leading = {}
        self.deduplicated = 0
        self.merged = 0
        self.kv: CacheEventForwarder | None = None
        """Sends the engine's KV-cache events to the router (`--kv-events`)."""
        if cfg.kv_events and cfg.engine == "vllm":
            endpoint = ipc_endpoint(tempfile.gettempdir(), cfg.replica)
            self.engine.engine_argv += ["--kv-events-config", events_config(endpoint)]
            translator = KeyTranslator(KV_TRANSLATOR_NODES, hash_block_size=cfg.hash_block_size)
            self.kv = CacheEventForwarder(cfg.replica, KvEventSubscriber(endpoint, translator),
                                          lambda data: self.nc.publish(subjects.cache_events(cfg.replica), data))

    async def run(self, stop: asyncio.Event) -> None:
        if self.cfg.nice:
            os.nice(self.cfg.nice)  # before the engine core starts: it inherits it
        if self.cfg.start_delay:
            log.info("engine start delayed", seconds=self.cfg.start_delay)
            try:
                await asyncio.wait_for(stop.wait(), self.cfg.start_delay)
                return  # stopped while waiting
            except TimeoutError:
                pass
        await self.engine.start()
        nc = await connect(self.cfg.nats_url, f"engine-{self.cfg.replica}")
        self.nc, self.js = nc, nc.jetstream()
        await provision(self.js)
        self.jobs = JobCache(await self.js.key_value(subjects.JOBS_KV))
        await self.jobs.follow_cancels(nc)
        self.sub = DurablePull(self.js, subjects.engine_consumer(self.cfg.replica))
        self.outbox = Outbox(
            self.js, self.ledger, origin=self.cfg.replica, batch=self.cfg.result_batch, linger=self.cfg.result_linger, on_published=self.status_due.set,
            decode_cost=lambda: self.engine.snapshot().decode_cost,
            step=lambda: step_model(self.engine.snapshot(), self.window.limit),
        )
        await self.serve(nc)
        self.ready = True
        log.info("engine-worker ready", engine=self.cfg.engine, window=self.cfg.window)
        finished = asyncio.Event()  # ends the background loops once the work is drained
        code = 0
        try:
            async with asyncio.TaskGroup() as tg:
                self.tg = tg
                tg.create_task(self.report_status(finished))
                tg.create_task(self.outbox.run_linger(finished))
                tg.create_task(keep_in_progress(self.ledger.messages, subjects.IN_PROGRESS_EVERY, finished))
                if self.kv is not None:
                    # Bounded by what the engine can hold (plus the blocks of one step in flight).
                    self.kv.subscriber.translator.max_nodes = self.engine.snapshot().kv_blocks + KV_TRANSLATOR_SLACK
                    tg.create_task(self.kv.run(finished))
                try:
                    await self.pump(stop)
                    await self.drain()
                finally:
                    finished.set()
        except* EngineGaveUp as eg:
            log.error("engine cannot be rebuilt: exiting for the supervisor to restart", error=str(eg.exceptions[0]))
            code = GAVE_UP_EXIT_CODE
        finally:
            # Also after an unexpected error (which then ends the process with code 1,
            # see `run_service`): nothing stays leased.
            await self.close()
        if code:
            raise SystemExit(code)

    async def pump(self, stop: asyncio.Event) -> None:
        """Fetch work while the window has room; rebuild the engine when it dies."""
        while not stop.is_set():
            if self.death is None and not self.engine.alive():  # died with nothing in flight
                self.engine_died(EngineDead("engine found dead"))
            if self.death is not None:
                await self.rebuild(stop)
                continue
            if self.feeder.room() <= 0:
                self.window_free.clear()
                try:
                    await asyncio.wait_for(self.window_free.wait(), 0.5)
                except TimeoutError:
                    pass
                continue
            # One work batch (up to --max-batch prompts) at a time.
            for msg in await self.sub.fetch(1, timeout=0.5):
                await self.start_batch(msg)

    async def drain(self) -> None:
        """Stopping: let prompts in flight finish (up to `drain_timeout`), publish. Prompts
        not yet submitted stay unsubmitted: their batches are handed back by close()."""
        self.feeder.open = False
        if self.prompt_tasks:
            _, pending = await asyncio.wait(self.prompt_tasks, timeout=self.cfg.drain_timeout)
            for t in pending:  # unfinished: their batches are handed back by close()
                t.cancel()
            if pending:
                await asyncio.wait(pending)
        await self.outbox.flush_all()

    async def close(self) -> None:
        self.ready = False
        await self.publish_status()
        handed = await self.ledger.hand_back()  # redelivered at once, not after ack_wait
        if handed:
            log.warning("unfinished work batches handed back", batches=handed)
        await close(self.nc, self.sub)
        await self.engine.shutdown()

    async def serve(self, nc: Client) -> Service:
        """The control endpoints, a nats.micro service (`prefixflow-engine-worker`, its
        replica in the metadata): a handler that fails raises and micro answers an error
        reply and counts it (`prefixflow/shared/bus/control.py`). Drained with the connection."""
        service = await add_service(nc, name="prefixflow-engine-worker", version=SERVICE_VERSION,
                                    description="one engine replica's control", metadata={"replica": self.cfg.replica})
        await service.add_endpoint(name="reset", subject=subjects.engine_reset(self.cfg.replica), handler=self.on_reset)
        await service.add_endpoint(name="scheduling", subject=subjects.engine_scheduling(self.cfg.replica),
                                   handler=self.on_scheduling)
        await service.add_endpoint(name="status", subject=subjects.engine_status_request(self.cfg.replica),
                                   handler=self.on_status_request)
        return service

    async def on_reset(self, request: Request) -> None:
        """`pfx.engine.<replica>.reset` (empty -> `ControlReply`): empty the engine's prefix
        cache (benchmarks start each method from a cold cache without restarting the
        engine). `ok` False is a state, not an error: `busy` (vLLM refuses while requests
        hold blocks) or `not ready` (the engine is being rebuilt); callers ask again. Any
        other failure raises: an error reply (500)."""
        reply = m.ControlReply(False, "not ready")
        if self.ready:
            try:
                ok = await self.engine.reset_prefix_cache()
            except EngineDead as exc:
                self.engine_died(exc)
            else:
                if ok:
                    self.cache_epoch = uuid.uuid4().hex[:8]
                if ok and self.kv is not None:
                    self.kv.cleared()  # vLLM reports it only at its next step
                reply = m.ControlReply(ok, "" if ok else "busy")
        log.info("prefix cache reset", ok=reply.ok, detail=reply.detail)
        await request.respond(m.encode(reply))

    async def on_scheduling(self, request: Request) -> None:
        """`pfx.engine.<replica>.scheduling` (`SetScheduling` -> `ControlReply`): switch
        between `prefix-groups` and `fcfs` (benchmarks run the reference methods on vanilla
        FCFS vLLM); another mode is a 400 error reply."""
        mode = decode_request(m.set_scheduling_decoder, request.data).mode
        if mode not in SCHEDULING_MODES:
            raise ServiceError("400", f"unknown scheduling {mode!r}; want {' or '.join(SCHEDULING_MODES)}")
        self.scheduling = mode
        log.info("scheduling set", scheduling=mode)
        await request.respond(m.encode(m.ControlReply(True, mode)))

    async def on_status_request(self, request: Request) -> None:
        """`pfx.engine.<replica>.status` (empty -> `EngineStatus`): the status now."""
        await request.respond(m.encode(self.status()))

    async def start_batch(self, msg: Msg) -> None:
        got = await receive(self.js, msg, m.work_batch_decoder, "work batch", ledger=self.ledger,
                            count=lambda work: len(work.prompts), on_poison=self.isolate_all)
        if got is None:
            return
        work, lease = got.body, got.lease
        if (work := await self.refuse_invalid_jobs(work, lease)) is None:
            return
        lookups = {job: await self.jobs.get(job) for job in {p.job for p in work.prompts}}
        ended = {job for job, lookup in lookups.items() if is_cancelled(lookup)}
        held = [Held(lease, p, lookups[p.job], work.bucket, work, i) for i, p in enumerate(work.prompts)
                if p.job not in ended]
        if len(held) < len(work.prompts):  # a cancelled job's prompts are not started: no rows
            # Counted as done work: the router's view of this replica's load stays true.
            self.done_work_tokens += sum(p.load for p in work.prompts if p.job in ended)
            await self.ledger.done(lease, len(work.prompts) - len(held))
            if not held:
                return
        if self.death is not None:  # died meanwhile: `rebuild` re-publishes the batch, untried
            self.untried += held
            return
        if self.generate_batch is not None:
            await self.run_batch(await self.admit(held, attach=False))
            return
        self.feeder.hold(await self.admit(held, attach=True))

    async def refuse_invalid_jobs(self, work: m.WorkBatch, lease: Lease) -> m.WorkBatch | None:
        """`work` without its prompts of invalid job ids, which are dead-lettered (as one
        work batch, with the reason) and settled; None if none is left to run."""
        bad = [p for p in work.prompts if subjects.job_id_error(p.job) is not None]
        if not bad:
            return work
        why = subjects.job_id_error(bad[0].job) or ""
        await dead_letter(self.js, lease.msg, why, data=m.encode(msgspec.structs.replace(work, prompts=bad, strikes=[])),
                          part="invalid job ids")
        await self.ledger.done(lease, len(bad))
        keep = [i for i, p in enumerate(work.prompts) if subjects.job_id_error(p.job) is None]
        strikes = [work.strikes[i] for i in keep] if work.strikes else []
        return msgspec.structs.replace(work, prompts=[work.prompts[i] for i in keep], strikes=strikes) if keep else None

    def submit(self, held: Held) -> None:
        """Start one prompt in the engine (the feeder calls this as the window allows)."""
        self._track_idle()
        task = self.tg.create_task(self.run_prompt(held))
        self.prompt_tasks.add(task)
        task.add_done_callback(self.prompt_tasks.discard)

    async def run_batch(self, held: list[Held]) -> None:
        """A batch engine: the whole work batch in one call, no task per prompt."""
        runnable, failed = [], []
        for h in held:
            try:
                if h.lookup.spec is not None:
                    runnable.append((h, self.leader_sampling(h, prompt_sampling(h.prompt, h.lookup.spec.sampling))))
            except msgspec.DecodeError as exc:  # a sampling value this worker cannot take (unknown fields are ignored)
                failed.append((h, f"bad sampling parameters: {exc}"))
        started = time.time()
        for h, _ in runnable:
            self.in_engine[id(h)] = h
            h.prompt.admitted_at = h.prompt.admitted_at or started  # NOTE: a batch engine has no deadline
        completions: list[Completion] = []
        try:
            completions = await self.generate_batch([(h.prompt.tokens, sp) for h, sp in runnable])
        except Exception as exc:  # noqa: BLE001 - classified: only a dead engine rebuilds
            if is_engine_death(exc, self.engine.alive()):
                self.engine_died(exc)  # `rebuild` re-publishes the runnable prompts as suspects
            else:
                failed += [(h, f"{type(exc).__name__}: {exc}") for h, _ in runnable]
                for h, _ in runnable:
                    self.in_engine.pop(id(h), None)
        else:
            for h, _ in runnable:
                self.in_engine.pop(id(h), None)
        done = dict(zip((id(h) for h, _ in runnable), completions, strict=False))
        errors = {id(h): why for h, why in failed}
        for h in held:
            if h.lookup.spec is None:
                await self.finish(h.lease, h.prompt, error=h.lookup.error or "unknown job", bucket=h.bucket)
            elif id(h) in errors:
                await self.settle(h, None, errors[id(h)], started_at=started, fed=False)
                await self.finish(h.lease, h.prompt, error=errors[id(h)], bucket=h.bucket)
            elif id(h) in done:
                own = await self.settle(h, done[id(h)], started_at=started, fed=False)
                await self.finish(h.lease, h.prompt, own, bucket=h.bucket, started_at=started)

    async def run_prompt(self, held: Held) -> None:
        """One prompt through the engine. Its own failure (`RequestFailed`, a sampling
        field that does not decode, an error the engine did not name while it stays alive)
        is its error row; only a dead engine (`is_engine_death`) leaves it unfinished, for
        `rebuild` to re-publish."""
        prompt, spec = held.prompt, held.lookup.spec
        completion: Completion | None = None
        error = None
        started = 0.0
        ticket: int | None = None
        self.in_engine[id(held)] = held
        try:
            if spec is None:
                error = held.lookup.error or "unknown job"
            else:
                request_id = f"{prompt.job}:{prompt.id}:{uuid.uuid4().hex[:8]}"
                token_ids = tk.unpack(prompt.tokens)
                deadline = None
                try:
                    # The row's own, else the job's; a merge's n if it leads identical sampled rows.
                    sampling = self.leader_sampling(held, prompt_sampling(prompt, spec.sampling))
                    priority = 0
                    if self.scheduling == "prefix-groups":
                        priority, ticket = self.order.admit(prompt.tokens, prompt.job, spec.priority, cost=sampling.n)
                    started = time.time()
                    # NOTE: set in place, so a re-publish after an engine death (`resplit`) carries it.
                    prompt.admitted_at = prompt.admitted_at or started
                    async with asyncio.timeout(limits.time_left(prompt.admitted_at, spec.row_timeout, started)) as deadline:
                        completion = await self.engine.generate(request_id, prompt.id, token_ids, sampling, priority,
                                                                prompt.lora)
                except msgspec.DecodeError as exc:  # a sampling value this worker cannot take (unknown fields are ignored)
                    error = f"bad sampling parameters: {exc}"
                except RequestFailed as exc:
                    error = str(exc)
                except Exception as exc:  # noqa: BLE001 - classified: only a dead engine rebuilds
                    if isinstance(exc, TimeoutError) and deadline is not None and deadline.expired():
                        # Past its deadline: the request was cancelled (vLLM aborts it), its slot is free.
                        error = limits.timeout_error(spec.row_timeout)
                        log.warning("row past its deadline: error row", job=prompt.job, id=prompt.id,
                                    row_timeout=spec.row_timeout, admitted_ago=round(time.time() - prompt.admitted_at, 1))
                    elif is_engine_death(exc, self.engine.alive()):
                        self.engine_died(exc)
                        return  # still in `in_engine`: it died in flight
                    else:
                        error = f"{type(exc).__name__}: {exc}"
        finally:
            if ticket is not None:
                self.order.done(ticket)
            self.feeder.finished(prompt, output_tokens=completion.output_tokens if completion is not None else None)
            self._track_idle()
            self.feeder.feed()
            self.window_free.set()
        self.in_engine.pop(id(held), None)
        completion = await self.settle(held, completion, error, started_at=started, fed=True)
        await self.finish(held.lease, prompt, completion, error, bucket=held.bucket, started_at=started)

    async def finish(
        self, lease: Lease, prompt: m.Prompt, c: Completion | None = None, error: str | None = None, *,
        bucket: str = "", started_at: float = 0.0, dedupe: Kind = Kind.OWN,
    ) -> None:
        """Count a finished prompt and queue its result row (an error row if `error`).
        `bucket`, `started_at`: the prompt's bucket id and when it entered the engine
        (output columns `bucket`, `started_at`, `finished_at`: `prefixflow report`)."""
        if c is None:
            result = m.error_result(prompt.id, error or "", prompt_tokens=prompt.prompt_tokens,
                                    replica=self.cfg.replica, bucket=bucket, src=prompt.src, row=prompt.row,
                                    grant=prompt.grant)
        else:
            result = m.Result(prompt.id, prompt.columns, c.output, c.finish_reason, c.prompt_tokens,
                              c.cached_tokens, c.output_tokens, self.cfg.replica, outputs=c.outputs, logprobs=c.logprobs,
                              embedding=c.embedding, bucket=bucket, started_at=started_at, finished_at=time.time(),
                              src=prompt.src, row=prompt.row, dedupe=dedupe, grant=prompt.grant)
            # The engine's own work only: a copy ran nothing, a merged row's prompt was prefilled once.
            if dedupe == Kind.OWN:
                self.cached_tokens += c.cached_tokens
                self.done_prompt_tokens += c.prompt_tokens
            if dedupe != Kind.COPY:
                self.output_tokens += c.output_tokens
        self.completed += 1
        self.done_work_tokens += prompt.load
        await self.outbox.add(prompt.job, result, lease)
