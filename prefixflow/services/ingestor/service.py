"""Ingestor: validates and tokenizes user prompts, shards them to the node bucketers.

Loop: fetch a batch from one job's `pfx.ingest.<job>` -> plan it in a worker thread (parse, validate,
tokenize, shard: `prefixflow/services/ingestor/plan.py`) -> publish prompt batches to
`pfx.bucket.<node>` and error rows to `pfx.results.<job>` -> wait for every publish ack
-> ack the inputs. A message with no recoverable id, or on a subject whose job id is not
in the grammar (`subjects.job_id_error`, e.g. a raw `pfx.ingest.bad:job`), goes to the
dead-letter stream with the reason and is acked (gone from the work queue: never
retried); a job whose spec cannot run is marked failed in the job-status bucket. Any other
failure of a batch naks it (redelivered one message at a time, then quarantined as
poison): the service never goes down for one job. Several ingestors
can share the work (one durable pull consumer per job, shared).

Jobs take turns (`prefixflow/services/ingestor/shares.py`): the ingestor looks at which
ingest subjects hold messages (stream info, every `SCAN_EVERY` s) and pulls each job
through its own consumer, the tenant furthest behind first, then its job furthest behind,
in short turns while several wait: a job submitted after a large one is not queued
behind the large one's backlog, even when ingestion is the bottleneck.

Beside it runs the mover (`prefixflow/services/ingestor/mover.py`): the prompts of a bucketer node
gone for good (no heartbeat for `--bucketer-gone-after` seconds) are moved to live nodes.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import msgspec
import structlog
from nats.aio.msg import Msg

from prefixflow.services.ingestor.model import load_model
from prefixflow.services.ingestor.mover import Mover
from prefixflow.services.ingestor.plan import Incoming, Plan, plan_batch, poison_rows
from prefixflow.services.ingestor.shares import IngestShares
from prefixflow.shared.bus.blobs import put_blob
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.bus.poison import dead_payload, deliveries, is_poison, quarantine
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.bus.publish import ack_all, message_limit, publish
from prefixflow.shared.bus.pull import DurablePull
from prefixflow.shared.prefix.sharding import Sharder
from prefixflow.shared.process import metrics
from prefixflow.shared.process.config import IngestorConfig
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.provenance import ORIGIN_INGESTOR
from prefixflow.shared.wire.sampling import compile_structured

log = structlog.get_logger()

MAX_PROMPTS_PER_MESSAGE = m.MAX_PROMPTS_PER_MESSAGE
PROMPTS_OK = metrics.PROMPTS_IN.labels("ok")
PROMPTS_ERROR = metrics.PROMPTS_IN.labels("error")
BUCKETER_LIVE_FOR = 3.0
"""Seconds after its last heartbeat that a bucketer still gets prompts."""
SCAN_EVERY = 0.1
"""Seconds between looks at which ingest subjects hold messages while jobs wait."""
QUIET_SCAN_EVERY = 1.0
"""... and while none does. An idle ingestor also holds a core subscription on the ingest
subjects (`idle`), which wakes it at a job's first message: the look is a backstop."""
CONTENDED_TURN = 8
"""Messages (up to 64 rows each from `submit`) a job's turn takes while other jobs wait."""


def same_model(a: str, b: str) -> bool:
    """Whether two model names (directories or hub ids) name the same model: equal, or
    the same last path component (`/models/Qwen3-8B`, `Qwen/Qwen3-8B`). By name only: a
    job's model never makes the ingestor look at its own file system (a submitter
    could otherwise probe for paths there)."""
    def name(x: str) -> str:
        return os.path.basename(os.path.normpath(x.strip()))

    return a == b or (bool(name(a)) and name(a) == name(b))


class Ingestor:
    def __init__(self, cfg: IngestorConfig) -> None:
        self.cfg = cfg
        self.model = load_model(cfg.model, cfg.max_model_len, cfg.hash_block_size, cfg.chat_template_timeout)
        self.bucketers: dict[str, float] = {}  # node -> last heartbeat (monotonic)
        self.sharder = Sharder(epsilon=cfg.shard_epsilon)
        self.mover = Mover(self.bucketers, cfg.bucketer_gone_after, BUCKETER_LIVE_FOR, cfg.hash_block_size)
        self.shares = IngestShares(cfg.max_job_consumers)
        self.pulls: dict[str, DurablePull] = {}
        """job -> the pull on its ingest consumer."""
        self.scanned_at = -1e9
        self.woken = asyncio.Event()
        self.wake_sub = None
        """The core subscription on the ingest subjects held while idle (`idle`)."""

    def live_nodes(self) -> list[str]:
        """Bucketer nodes heard from within BUCKETER_LIVE_FOR; when none is (heartbeats
        late across a reconnect), every node ever heard: its durable stream keeps the
        prompts until its bucketer is back. Never a node no bucketer reported: nothing
        would ever take its prompts. Empty until the first heartbeat."""
        now = time.monotonic()
        return sorted(n for n, seen in self.bucketers.items() if now - seen < BUCKETER_LIVE_FOR) or sorted(self.bucketers)

    async def run(self, stop: asyncio.Event) -> None:
        nc = self.nc = await connect(self.cfg.nats_url, "ingestor", on_reconnect=self.mover.on_reconnect)
        js = nc.jetstream()
        await provision(js)
        self.js = js
        self.jobs = JobCache(await js.key_value(subjects.JOBS_KV))
        await self.jobs.follow_cancels(nc)
        self.status_kv = await js.key_value(subjects.JOB_STATUS_KV)
        await self.drop_legacy_consumer()

        async def on_heartbeat(msg: Msg) -> None:
            try:
                hb = m.heartbeat_decoder.decode(msg.data)
            except Exception:  # noqa: BLE001 - a foreign message on our subject
                return
            if subjects.is_valid_name(hb.node):
                self.bucketers[hb.node] = time.monotonic()

        await nc.subscribe(subjects.ALL_BUCKETER_HEARTBEATS, cb=on_heartbeat)
        log.info("ingestor ready", max_model_len=self.model.max_model_len)
        # Both loops under one TaskGroup: a task that dies takes the process down (its
        # supervisor restarts it, JetStream redelivers what it held).
        async with asyncio.TaskGroup() as tg:
            mover = tg.create_task(self.mover.run(js, stop))
            await self.ingest(stop)
            try:  # a move waiting on a full stream: its message is redelivered (same ids)
                await asyncio.wait_for(asyncio.shield(mover), self.cfg.drain_timeout)
            except asyncio.TimeoutError:
                mover.cancel()
        await close(nc, *self.pulls.values())

    async def drop_legacy_consumer(self) -> None:
        """Delete the one FIFO consumer of ingestors before per-job turns, if it is there:
        its filter overlaps each job's, which a work-queue stream refuses."""
        try:
            await self.js.delete_consumer(subjects.INGEST_STREAM.name, subjects.LEGACY_INGESTOR_CONSUMER)
            log.info("deleted the ingest stream's former single consumer", consumer=subjects.LEGACY_INGESTOR_CONSUMER)
        except Exception as exc:  # noqa: BLE001 - not there (the usual case), or not provisioned yet
            log.debug("no former ingest consumer deleted", error=repr(exc))

    async def ingest(self, stop: asyncio.Event) -> None:
        """Turns between the jobs with rows waiting (`IngestShares`): each turn pulls one
        job's messages through its own consumer and ingests them."""
        while not stop.is_set():
            if not self.bucketers:  # no bucketer has reported yet: its prompts would have nowhere to go
                await asyncio.sleep(0.1)
                continue
            if time.monotonic() - self.scanned_at >= (SCAN_EVERY if self.shares.job_time else QUIET_SCAN_EVERY):
                await self.scan()
            order = self.shares.order(self.pulls)
            if not order:
                if self.shares.job_time:  # jobs wait, none may be pulled now (consumers at their bound)
                    await asyncio.sleep(SCAN_EVERY)
                else:
                    await self.idle(QUIET_SCAN_EVERY - (time.monotonic() - self.scanned_at))
                continue
            await self.busy()
            job = order[0]
            msgs = await self.pull(job).fetch(self.shares.turn(self.cfg.fetch_batch, CONTENDED_TURN), timeout=0.05)
            if not msgs:  # taken by another ingestor, or held unacked: not waiting here until the next look
                self.shares.done(job)
                continue
            # Redelivered messages go one at a time: a poison message must not keep
            # failing the good messages fetched with it.
            fresh = [msg for msg in msgs if deliveries(msg) == 1]
            rows, weight = 0, 1
            for group in ([fresh] if fresh else []) + [[msg] for msg in msgs if deliveries(msg) > 1]:
                took = await self.handle_safely(group)
                rows, weight = rows + took[0], took[1]
            self.shares.charge(job, rows, weight)

    async def idle(self, seconds: float) -> None:
        """Nothing waits: until a message lands on any ingest subject, or `seconds`. A core
        subscription (held only while idle, so no row travels to the ingestor twice while it
        works) wakes it at once; then it looks at the stream."""
        if self.wake_sub is None:
            self.woken.clear()
            self.wake_sub = await self.nc.subscribe(subjects.ingest(">"), cb=self.wake)
        try:
            await asyncio.wait_for(self.woken.wait(), max(seconds, 0.0))
            self.scanned_at = -1e9  # woken: look now
        except asyncio.TimeoutError:
            pass

    async def wake(self, msg: Msg) -> None:
        self.woken.set()

    async def busy(self) -> None:
        if self.wake_sub is not None:
            sub, self.wake_sub = self.wake_sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection gone: the subscription with it
                pass

    async def scan(self) -> None:
        """Which jobs have messages on their ingest subject; close the consumers of jobs
        whose subject is empty (nothing unacked either: a work queue keeps a message
        until it is acked)."""
        self.scanned_at = time.monotonic()
        try:
            info = await self.js.stream_info(subjects.INGEST_STREAM.name, subjects_filter=subjects.ingest(">"))
        except Exception as exc:  # noqa: BLE001 - reconnecting: keep the last view
            log.debug("ingest stream scan failed", error=repr(exc))
            return
        waiting = {subjects.job_from_subject(subject) for subject, n in (info.state.subjects or {}).items() if n}
        self.shares.wait(waiting)
        for job in [j for j in self.pulls if j not in waiting]:
            await self.close_pull(job)

    def pull(self, job: str) -> DurablePull:
        if (pull := self.pulls.get(job)) is None:
            pull = self.pulls[job] = DurablePull(self.js, subjects.ingestor_consumer(job), label="ingestor")
        return pull

    async def close_pull(self, job: str) -> None:
        pull = self.pulls.pop(job)
        await pull.unsubscribe()
        try:
            await self.js.delete_consumer(pull.spec.stream, pull.spec.durable)
        except Exception as exc:  # noqa: BLE001 - gone already (another ingestor), or a blip: the server's idle limit removes it
            log.debug("ingest consumer not deleted", consumer=pull.spec.durable, error=repr(exc))

    async def handle_safely(self, msgs: list[Msg]) -> tuple[int, int]:
        """Ingest these messages (of one job); the rows and the job's priority, for its turns."""
        if len(msgs) == 1 and is_poison(msgs[0]):
            msg = msgs[0]
            why = f"poison message: failed {deliveries(msg)} deliveries"
            await quarantine(self.js, msg, "ingest failed repeatedly", poison_rows(incoming(msg), why), origin=ORIGIN_INGESTOR)
            return 1, 1
        try:
            return await self.handle(msgs)
        except Exception:  # noqa: BLE001 - a real failure: redelivered, counted toward poison
            log.exception("ingest batch failed; naked for redelivery")
            await asyncio.gather(*(msg.nak(delay=1.0) for msg in msgs), return_exceptions=True)
            return len(msgs), 1

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

    async def handle(self, msgs: list[Msg]) -> tuple[int, int]:
        """Ingest a batch of messages; the rows it held and its (first) job's priority."""
        t0 = time.perf_counter()
        batch = [incoming(msg) for msg in msgs]
        # Invalid job ids are not looked up: the plan dead-letters their messages.
        jobs = {job: await self.lookup(job) for job in {i.job for i in batch} if subjects.job_id_error(job) is None}
        now = time.time()
        cancelled = {job for job, lookup in jobs.items() if lookup.spec is not None and lookup.spec.ended_at(now)}
        if cancelled:  # the cluster stops feeding a cancelled job: its prompts go nowhere
            keep = [i for i, b in enumerate(batch) if b.job not in cancelled]
            await ack_all([msg for i, msg in enumerate(msgs) if i not in set(keep)])
            log.info("dropped ingest messages of cancelled jobs", jobs=sorted(cancelled), messages=len(msgs) - len(keep))
            msgs, batch = [msgs[i] for i in keep], [batch[i] for i in keep]
            if not msgs:
                return 0, 1
        nodes = self.live_nodes()
        plan = await asyncio.to_thread(plan_batch, batch, jobs, self.model, lambda key: self.sharder.pick(key, nodes))
        await self.store_kept(plan)  # before anything that refers to it is published
        # A spec written by hand may carry any number: the weight is kept within 1..MAX_PRIORITY.
        priority = {job: min(max(int(lookup.spec.priority), 1), m.MAX_PRIORITY)
                    for job, lookup in jobs.items() if lookup.spec is not None}
        await self.publish(plan, msgs, priority)
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
        return plan.n_prompts + plan.n_errors + len(plan.dead), max(priority.values(), default=1)

    async def publish(self, plan: Plan, msgs: list[Msg], priority: dict[str, int]) -> None:
        """Publish everything the plan produced and wait for every ack. Prompts go to their
        node's subject of their job, with the job's priority."""
        pubs = []
        # Cut by encoded size under the server's max_payload (asked of the connection):
        # a prompt too large for a message even alone becomes an error row.
        limit = message_limit(self.js, subjects.BUCKET_STREAM.max_msg_size)
        errors = {job: list(rows) for job, rows in plan.errors.items()}
        for node, prompts in plan.prompts.items():
            fit = []
            for p in prompts:
                if m.prompt_fits(p, limit, self.cfg.hash_block_size):
                    fit.append(p)
                else:
                    errors.setdefault(p.job, []).append(m.error_result(
                        p.id, f"prompt too large for one message: {m.encoded_size(p)} bytes "
                              f"({p.prompt_tokens} tokens), the server takes {limit}",
                        prompt_tokens=p.prompt_tokens, src=p.src, row=p.row))
            by_job: dict[str, list[m.Prompt]] = {}
            for p in fit:
                by_job.setdefault(p.job, []).append(p)
            for job, run in by_job.items():
                wrap = lambda ps, w=priority.get(job, 1): m.PromptBatch(ps, w)  # noqa: E731
                for batch in m.encode_batches(run, wrap, limit, MAX_PROMPTS_PER_MESSAGE):
                    pubs.append(publish(self.js, subjects.bucket(node, job), batch.data))
        limit = message_limit(self.js, subjects.RESULTS_STREAM.max_msg_size)
        for job, rows in errors.items():
            for batch in m.encode_batches(rows, lambda run, job=job: m.ResultBatch(job, run), limit, MAX_PROMPTS_PER_MESSAGE):
                pubs.append(publish(self.js, subjects.results(ORIGIN_INGESTOR, job), batch.data))
        for i, why in plan.dead.items():
            pubs.append(self.dead_letter(msgs[i], why))
        for job, why in plan.failed_jobs.items():
            pubs.append(self.fail_job(job, why))
        await asyncio.gather(*pubs)

    async def store_kept(self, plan: Plan) -> None:
        """Store the other fields of rows published without kept columns (the user's own
        publishers) as each job's blob `in-<plan.src>`, for the sink to join."""
        for job, maps in plan.kept.items():
            table = await asyncio.to_thread(kept_table, maps)
            await put_blob(self.js, self.nc, job, m.input_blob(plan.src), table)

    async def dead_letter(self, msg: Msg, why: str) -> None:
        log.warning("dead-lettered ingest message", subject=msg.subject, error=why)
        headers = {"Pfx-Error": why[:512], "Pfx-Subject": msg.subject}
        await publish(self.js, subjects.dead(msg.subject), dead_payload(self.js, msg.data, headers), headers=headers)
        metrics.DEAD_LETTERS.labels(metrics.stream_of(msg.subject)).inc()

    async def fail_job(self, job: str, why: str) -> None:
        """Mark a job that cannot run as failed, with the reason, in the status bucket."""
        log.error("job failed", job=job, error=why)
        status = m.JobStatus(job, updated_at=time.time(), failed=True, error=why)
        await self.status_kv.put(job, m.encode_json(status))


def incoming(msg: Msg) -> Incoming:
    return Incoming(msg.subject, msg.data, msg.headers, msg.metadata.sequence.stream)


_fields = msgspec.msgpack.Decoder(dict[str, Any])


def kept_table(maps: list[bytes]) -> bytes:
    """Rows' other fields (msgpack maps) as an Arrow IPC file, each field typed to hold
    every row's value exactly (`prefixflow/shared/widening.py`: int + float -> float64,
    int + string -> string, a nested value of another shape -> JSON text; a field null in
    every row -> null, which the sink's schema widens when later rows bring values)."""
    import pyarrow as pa

    from prefixflow.shared.widening import column_of

    rows = [_fields.decode(b) for b in maps]
    names = list(dict.fromkeys(k for r in rows for k in r))
    arrays = [column_of([r.get(name) for r in rows]) for name in names]
    table = pa.Table.from_arrays(arrays, names=names)
    out = pa.BufferOutputStream()
    with pa.ipc.new_file(out, table.schema) as writer:
        writer.write_table(table)
    return out.getvalue().to_pybytes()
