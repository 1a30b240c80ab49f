"""Ingestor: validates and tokenizes user prompts, shards them to the node bucketers.

Loop: fetch a batch from `pfx.ingest.*` -> plan it in a worker thread (parse, validate,
tokenize, shard: `services/ingestor/plan.py`) -> publish prompt batches to
`pfx.bucket.<node>` and error rows to `pfx.results.<job>` -> wait for every publish ack
-> ack the inputs. A message with no recoverable id goes to the dead-letter stream; a
job whose spec cannot run is marked failed in the job-status bucket. Several ingestors
can share the work (one durable pull consumer).
"""

from __future__ import annotations

import asyncio
import os
import time

import structlog
from nats.aio.msg import Msg

from services.ingestor.model import load_model
from services.ingestor.plan import Incoming, Plan, plan_batch, poison_rows
from shared.bus.connection import close, connect
from shared.bus.jobs import JobCache
from shared.bus.poison import deliveries, is_poison, quarantine
from shared.bus.provision import provision
from shared.bus.publish import ack_all, publish
from shared.bus.pull import DurablePull
from shared.prefix.sharding import Sharder
from shared.process import metrics
from shared.process.config import IngestorConfig
from shared.wire import messages as m
from shared.wire import subjects
from shared.wire.sampling import compile_structured

log = structlog.get_logger()

MAX_PROMPTS_PER_MESSAGE = 512
PROMPTS_OK = metrics.PROMPTS_IN.labels("ok")
PROMPTS_ERROR = metrics.PROMPTS_IN.labels("error")
BUCKETER_LIVE_FOR = 3.0
"""Seconds after its last heartbeat that a bucketer still gets prompts."""


def same_model(a: str, b: str) -> bool:
    """Whether two model names (directories or hub ids) are the same model."""
    if a == b:
        return True
    return os.path.exists(a) and os.path.exists(b) and os.path.realpath(a) == os.path.realpath(b)


class Ingestor:
    def __init__(self, cfg: IngestorConfig) -> None:
        self.cfg = cfg
        self.model = load_model(cfg.model, cfg.max_model_len, cfg.hash_block_size)
        self.bucketers: dict[str, float] = {}  # node -> last heartbeat (monotonic)
        self.sharder = Sharder(epsilon=cfg.shard_epsilon)

    def live_nodes(self) -> list[str]:
        """Bucketer nodes heard from within BUCKETER_LIVE_FOR; when none is (heartbeats
        late across a reconnect), every node ever heard: its durable stream keeps the
        prompts until its bucketer is back. Never a node no bucketer reported: nothing
        would ever take its prompts. Empty until the first heartbeat."""
        now = time.monotonic()
        return sorted(n for n, seen in self.bucketers.items() if now - seen < BUCKETER_LIVE_FOR) or sorted(self.bucketers)

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "ingestor")
        js = nc.jetstream()
        await provision(js)
        self.js = js
        self.jobs = JobCache(await js.key_value(subjects.JOBS_KV))
        self.status_kv = await js.key_value(subjects.JOB_STATUS_KV)
        sub = DurablePull(js, subjects.ingestor_consumer())

        async def on_heartbeat(msg: Msg) -> None:
            try:
                hb = m.heartbeat_decoder.decode(msg.data)
            except Exception:  # noqa: BLE001 - a foreign message on our subject
                return
            if subjects.is_valid_name(hb.node):
                self.bucketers[hb.node] = time.monotonic()

        await nc.subscribe(subjects.ALL_BUCKETER_HEARTBEATS, cb=on_heartbeat)
        log.info("ingestor ready", max_model_len=self.model.max_model_len)
        while not stop.is_set():
            if not self.bucketers:  # no bucketer has reported yet: its prompts would have nowhere to go
                await asyncio.sleep(0.1)
                continue
            msgs = await sub.fetch(self.cfg.fetch_batch, timeout=1.0)
            if not msgs:
                continue
            # Redelivered messages go one at a time: a poison message must not keep
            # failing the good messages fetched with it.
            fresh = [msg for msg in msgs if deliveries(msg) == 1]
            for group in ([fresh] if fresh else []) + [[msg] for msg in msgs if deliveries(msg) > 1]:
                await self.handle_safely(group)
        await close(nc, sub)

    async def handle_safely(self, msgs: list[Msg]) -> None:
        if len(msgs) == 1 and is_poison(msgs[0]):
            msg = msgs[0]
            why = f"poison message: failed {deliveries(msg)} deliveries"
            await quarantine(self.js, msg, "ingest failed repeatedly", poison_rows(incoming(msg), why))
            return
        try:
            await self.handle(msgs)
        except Exception:  # noqa: BLE001 - a real failure: redelivered, counted toward poison
            log.exception("ingest batch failed; naked for redelivery")
            await asyncio.gather(*(msg.nak(delay=1.0) for msg in msgs), return_exceptions=True)

    async def lookup(self, job: str) -> m.JobLookup:
        """The job's spec, or why the cluster cannot run it."""
        lookup = await self.jobs.get(job)
        spec = lookup.spec
        if spec is not None and spec.model and not same_model(spec.model, self.cfg.model):
            return m.JobLookup(None, f"job wants model {spec.model!r}, this cluster serves {self.cfg.model!r}")
        if spec is not None and spec.task != self.cfg.task:
            return m.JobLookup(None, f"job task {spec.task!r}, but this cluster's engines {self.cfg.task} "
                                     f"(start it with --task {spec.task})")
        if spec is not None and spec.sampling.structured is not None:
            try:  # xgrammar compiles it as vLLM would (cached per form)
                await asyncio.to_thread(compile_structured, spec.sampling.structured)
            except ValueError as exc:
                return m.JobLookup(None, f"invalid structured output: {exc}")
        return lookup

    async def handle(self, msgs: list[Msg]) -> None:
        t0 = time.perf_counter()
        batch = [incoming(msg) for msg in msgs]
        jobs = {job: await self.lookup(job) for job in {i.job for i in batch}}
        nodes = self.live_nodes()
        plan = await asyncio.to_thread(plan_batch, batch, jobs, self.model, lambda key: self.sharder.pick(key, nodes))
        await self.publish(plan, msgs)
        await ack_all(msgs)
        PROMPTS_OK.inc(plan.n_prompts)
        PROMPTS_ERROR.inc(plan.n_errors)
        metrics.INGEST_BATCH_SECONDS.observe(time.perf_counter() - t0)
        log.debug(
            "ingested",
            messages=len(msgs),
            prompts=plan.n_prompts,
            errors=plan.n_errors,
            dead=len(plan.dead),
            nodes=len(plan.prompts),
            ms=round((time.perf_counter() - t0) * 1000, 1),
        )

    async def publish(self, plan: Plan, msgs: list[Msg]) -> None:
        """Publish everything the plan produced and wait for every ack."""
        pubs = []
        for node, prompts in plan.prompts.items():
            for run in m.chunked(prompts, m.prompt_size, MAX_PROMPTS_PER_MESSAGE):
                pubs.append(publish(self.js, subjects.bucket(node), m.encode(m.PromptBatch(run))))
        for job, rows in plan.errors.items():
            for run in m.chunked(rows, m.result_size, MAX_PROMPTS_PER_MESSAGE):
                pubs.append(publish(self.js, subjects.results(job), m.encode(m.ResultBatch(job, run))))
        for i, why in plan.dead.items():
            pubs.append(self.dead_letter(msgs[i], why))
        for job, why in plan.failed_jobs.items():
            pubs.append(self.fail_job(job, why))
        await asyncio.gather(*pubs)

    async def dead_letter(self, msg: Msg, why: str) -> None:
        log.warning("dead-lettered ingest message", subject=msg.subject, error=why)
        headers = {"Pfx-Error": why[:512], "Pfx-Subject": msg.subject}
        await publish(self.js, subjects.dead(msg.subject), msg.data, headers=headers)
        metrics.DEAD_LETTERS.labels(metrics.stream_of(msg.subject)).inc()

    async def fail_job(self, job: str, why: str) -> None:
        """Mark a job that cannot run as failed, with the reason, in the status bucket."""
        log.error("job failed", job=job, error=why)
        status = m.JobStatus(job, updated_at=time.time(), failed=True, error=why)
        await self.status_kv.put(job, m.encode_json(status))


def incoming(msg: Msg) -> Incoming:
    return Incoming(msg.subject, msg.data, msg.headers)
