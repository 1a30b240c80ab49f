"""Bucketer (one per node): groups prompts that share a prefix, routes the groups.

Each job's prompts for this node arrive on their own subject `pfx.bucket.<node>.<job>`
and wait in that job's lane (`prefixflow/services/bucketer/lanes.py`: a `PrefixBuffer` per job,
released by weighted fair queuing), so a small job is not queued behind a large one.
What to pull, what to release and where its cuts go is decided by `release.Release`
(pure; the simulator drives the same class); this module is its I/O. Two tasks share
the lanes:
- the intake loop looks at the bucket and ingest streams every `SCAN_EVERY` seconds
  (which jobs have prompts here, which have anything left upstream) and pulls prompt
  batches from each job's consumer while that job's lane is under its share of the
  buffer (a full lane stops its pulling: backpressure up to the ingestor);
- the dispatcher releases buckets: whenever the router reports free room on the
  replicas, the lanes furthest behind in virtual time first (without the router's room,
  by the reference rules: a job with nothing left upstream and no new input is
  flushed). It asks the router where each bucket goes
  (retrying while the router says retry-after; the router's freed-room event cuts the
  wait short), publishes them to `pfx.work.<replica>`, and acks an input message once
  every prompt it carried has been durably published downstream.

A message on a subject whose job id is outside the grammar (`subjects.job_id_error`), or
whose prompts name another job than its subject, is dead-lettered with the reason and
terminated (never bucketed, never retried).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Mapping

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.provenance import ORIGIN_BUCKETER, parse_key, sign
from prefixflow.shared.process import metrics
from prefixflow.shared.process.config import BucketerConfig
from prefixflow.shared.bus import control
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.consume import quarantine_held, receive
from prefixflow.shared.bus.ledger import AckLedger, Lease
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.bus.poison import error_rows, reject
from prefixflow.shared.bus.publish import PublishError, message_limit, publish
from prefixflow.shared.bus.pull import DurablePull, keep_in_progress
from prefixflow.services.bucketer.buffer import Bucket, Item
from prefixflow.services.bucketer.consumers import admit
from prefixflow.services.bucketer.lanes import Lanes
from prefixflow.services.bucketer.release import (DISPATCH_WAIT, INTAKE_WAIT, RETRY_WAIT, SEND_CONCURRENCY, Inflow,
                                                  Release)

log = structlog.get_logger()

SCAN_EVERY = 0.1
"""Seconds between looks at the streams (which jobs have prompts here or upstream)."""
QUIET_SCAN_EVERY = 0.5
"""... while the last look found nothing here or upstream and nothing is held or buffered:
an idle cluster's bucketers ask the server 4 times a second instead of 20 (two stream-info
requests a look), at the cost of up to 0.4 s more before a new job's first prompts are
pulled."""


class Bucketer:
    def __init__(self, cfg: BucketerConfig) -> None:
        self.cfg = cfg
        self.result_key = parse_key(cfg.result_key)
        """Signs each prompt's assignment to its replica (`provenance.py`; None: no grants)."""
        self.core = Release(cfg)
        """The lanes and their release rule."""
        self.pulls: dict[str, DurablePull] = {}
        """job -> the pull on its consumer of this node's prompts."""
        self.weights: dict[str, int] = {}
        """job -> priority, as its prompt batches carry it."""
        self.here: dict[str, int] = {}
        """job -> messages on its subject for this node (queued or held), as last scanned."""
        self.upstream: dict[str, int] = {}
        """job -> messages on its ingest subject (not yet ingested), as last scanned."""
        self.scanned_at = float("-inf")
        self.first_seen: dict[str, float] = {}
        """job -> when its subject was first seen holding messages (the order in which jobs
        beyond `max_job_consumers` get a consumer)."""
        # stream sequence -> [message, prompts not yet published downstream]
        self.ledger = AckLedger()
        """Prompt batches held until every prompt they carried is published downstream."""
        self.wake = asyncio.Event()
        self.freed = asyncio.Event()
        """Set (and replaced) whenever the router announces freed room."""
        node = cfg.node
        self.prompts_in = metrics.BUCKETER_PROMPTS_IN.labels(node)
        self.route_retries = metrics.ROUTE_RETRIES.labels(node)
        self.bucket_size = metrics.BUCKET_SIZE.labels(node)
        metrics.BUCKETER_BUFFERED.labels(node).set_function(lambda: len(self.lanes))
        metrics.BUCKETER_HELD.labels(node).set_function(lambda: len(self.ledger))

    @property
    def lanes(self) -> Lanes:
        return self.core.lanes

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, f"bucketer-{self.cfg.node}")
        self.nc, self.js = nc, nc.jetstream()
        await provision(self.js)

        async def on_freed(_msg: Msg) -> None:
            freed, self.freed = self.freed, asyncio.Event()
            freed.set()
            self.wake.set()

        await nc.subscribe(subjects.ROUTER_ROOM_FREED, cb=on_freed)
        log.info("bucketer ready", node=self.cfg.node)
        # Every loop runs under one TaskGroup: a task that dies takes the process down
        # (its supervisor restarts it and JetStream redelivers), never leaves prompts
        # leased by a dispatcher that no longer runs.
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.heartbeat(stop))
            tg.create_task(keep_in_progress(self.ledger.messages, subjects.IN_PROGRESS_EVERY, stop))
            dispatcher = tg.create_task(self.dispatch(stop))
            await self.intake(stop)
            # Shutdown: release everything buffered and publish it, within the drain time.
            try:
                await asyncio.wait_for(asyncio.shield(dispatcher), self.cfg.drain_timeout)
            except asyncio.TimeoutError:
                log.warning("shutdown: unpublished prompts stay unacked and will be redelivered", held=len(self.ledger))
                dispatcher.cancel()
        await close(nc, *self.pulls.values())

    async def scan(self) -> None:
        """Messages per job on this node's bucket subjects and on the ingest subjects."""
        try:
            own = await self.js.stream_info(subjects.BUCKET_STREAM.name, subjects_filter=subjects.node_bucket(self.cfg.node))
            ingest = await self.js.stream_info(subjects.INGEST_STREAM.name, subjects_filter=subjects.ingest(">"))
        except Exception as exc:  # noqa: BLE001 - not provisioned yet or reconnecting: keep the last view
            log.debug("stream scan failed", error=repr(exc))
            return
        here: dict[str, int] = {}
        for subject, n in (own.state.subjects or {}).items():
            if (parts := subjects.bucket_parts(subject)) is not None and n:
                here[parts[1]] = n
        self.here = here
        self.upstream = {subjects.job_from_subject(subject): n for subject, n in (ingest.state.subjects or {}).items() if n}
        self.scanned_at = time.monotonic()

    def held_by_job(self) -> dict[str, int]:
        """Messages this bucketer holds (leased, prompts not all published), by job."""
        held: dict[str, int] = collections.Counter()
        for msg in self.ledger.messages():
            if (parts := subjects.bucket_parts(msg.subject)) is not None:
                held[parts[1]] += 1
        return held

    def waiting(self, held: dict[str, int]) -> dict[str, int]:
        """Jobs with messages on this node's subjects not yet pulled, and how many."""
        return {job: n - held.get(job, 0) for job, n in self.here.items() if n > held.get(job, 0)}

    def inflow(self, held: dict[str, int]) -> Inflow:
        """What is still on its way here: messages on this node's subjects not yet pulled,
        jobs with prompts on their ingest subject."""
        return Inflow(self.waiting(held), self.upstream)

    def pull(self, job: str) -> DurablePull:
        if (pull := self.pulls.get(job)) is None:
            pull = self.pulls[job] = DurablePull(self.js, subjects.bucketer_consumer(self.cfg.node, job),
                                                 label=f"bucketer-{self.cfg.node}")
        return pull

    async def intake(self, stop: asyncio.Event) -> None:
        """Pull prompt batches into each job's lane while the lane is under its share."""
        while not stop.is_set():
            now = time.monotonic()
            held = self.held_by_job()
            if now - self.scanned_at >= (QUIET_SCAN_EVERY if self.quiet(held) else SCAN_EVERY):
                await self.scan()
                await self.forget(now)
            inflow = self.inflow(held)
            got = 0
            for job in self.intake_order(inflow.waiting):
                n = self.core.fetch(job, self.weights.get(job, 1), inflow)
                if not n:
                    continue
                msgs = await self.pull(job).fetch(n, timeout=0.05)
                now = time.monotonic()
                for msg in msgs:
                    await self.take(msg, now)
                got += len(msgs)
            if got:
                self.wake.set()
            else:
                # Nothing to pull, or every lane with input waiting is full (backpressure
                # until the dispatcher releases buckets); nothing at all: until the next look.
                await asyncio.sleep(QUIET_SCAN_EVERY if self.quiet(held) else INTAKE_WAIT)

    def quiet(self, held: dict[str, int]) -> bool:
        """Nothing on this node's subjects or upstream at the last look, nothing held or
        buffered here: the streams are looked at every `QUIET_SCAN_EVERY`."""
        return not (self.here or self.upstream or held or self.core)

    def lane_time(self, job: str) -> float:
        """Intake order: the job furthest behind in virtual time pulls first."""
        lane = self.lanes.lanes.get(job)
        return lane.vtime if lane is not None else self.lanes.clock

    async def forget(self, now: float) -> None:
        """Close the consumer of every job with nothing left here (no message on its
        subject, none held): a stream takes at most 1,000 consumers, so a finished job's
        goes at once, not after `subjects.BUCKET_CONSUMER_IDLE` (the server's backstop for
        a bucketer that died). Lanes are kept a while longer for their virtual time."""
        held = self.held_by_job()
        for job in self.lanes.forget(now, keep=set(self.here) | set(held)):
            self.weights.pop(job, None)
        for job in [j for j in self.pulls if j not in self.here and not held.get(j)]:
            await self.close_pull(job)

    async def close_pull(self, job: str) -> None:
        pull = self.pulls.pop(job)
        await pull.unsubscribe()
        try:
            await self.js.delete_consumer(pull.spec.stream, pull.spec.durable)
        except Exception as exc:  # noqa: BLE001 - gone already, or a blip: the server's idle limit removes it
            log.debug("consumer not deleted", consumer=pull.spec.durable, error=repr(exc))

    def intake_order(self, waiting: Mapping[str, int]) -> list[str]:
        """Jobs to pull from this round: those with a consumer open, then those that get
        one now (`consumers.admit`: tenants first, up to `max_job_consumers`; the others
        wait their turn in the stream), each group furthest behind in virtual time first."""
        for job in waiting:
            self.first_seen.setdefault(job, time.monotonic())
        for job in [j for j in self.first_seen if j not in self.here]:
            del self.first_seen[job]
        open_ = sorted((j for j in waiting if j in self.pulls), key=self.lane_time)
        new = admit([j for j in waiting if j not in self.pulls], self.pulls, self.first_seen, self.cfg.max_job_consumers)
        return open_ + sorted(new, key=self.lane_time)

    async def poisoned(self, batch: m.PromptBatch, lease: Lease) -> None:
        await quarantine_held(self.js, self.ledger, lease, "bucketing failed repeatedly",
                              error_rows(batch.prompts, "poison message"), origin=ORIGIN_BUCKETER)

    async def take(self, msg: Msg, now: float) -> None:
        job = parts[1] if (parts := subjects.bucket_parts(msg.subject)) is not None else ""
        if (why := subjects.job_id_error(job)) is not None:
            await reject(self.js, msg, why)
            return
        got = await receive(self.js, msg, m.prompt_batch_decoder, "prompt batch", ledger=self.ledger,
                            count=lambda batch: len(batch.prompts), on_poison=self.poisoned)
        if got is None:
            return
        batch, lease = got.body, got.lease
        if (other := next((p.job for p in batch.prompts if p.job != job), None)) is not None:
            # The subject (which lanes, grants and tenants go by) and the body name one job.
            await quarantine_held(self.js, self.ledger, lease, f"prompts of job {other!r} on {msg.subject!r}")
            return
        # Held until its last prompt is published, which may take a while (prompts of one
        # message go to many buckets): keep only what acking needs, not the raw payload.
        msg.data = b""
        self.prompts_in.inc(len(batch.prompts))
        self.weights[job] = batch.priority
        for p in batch.prompts:
            self.core.insert(job, batch.priority, Item(p.tokens, now, p, lease, p.work_tokens, p.lora, p.max_tokens))

    async def dispatch(self, stop: asyncio.Event) -> None:
        while True:
            if stop.is_set():
                released = self.core.drain(time.monotonic())
                self.count_released(released)
                await asyncio.gather(*(self.send(job, b, stop_retrying=True) for job, b in released))
                return
            now = time.monotonic()
            inflow = self.inflow(self.held_by_job())
            budget = self.core.budget(await self.room()) if self.core.wants_room(now, inflow) else self.core.no_budget()
            released = self.core.release(now, inflow, budget)
            self.count_released(released)
            for i in range(0, len(released), SEND_CONCURRENCY):
                await asyncio.gather(*(self.send(job, b) for job, b in released[i : i + SEND_CONCURRENCY]))
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), DISPATCH_WAIT)
            except asyncio.TimeoutError:
                pass

    def count_released(self, released: list[tuple[str, Bucket]]) -> None:
        """Metrics of one release: bucket sizes, and buckets and prompts by why."""
        if not released:
            return
        count: dict[str, list[int]] = {}
        for _, b in released:
            for n, why in b.released:
                self.bucket_size.observe(n)
                c = count.setdefault(why, [0, 0])
                c[0] += 1
                c[1] += n
        for why, (k, n) in count.items():
            metrics.RELEASES.labels(self.cfg.node, why).inc(k)
            metrics.RELEASED_PROMPTS.labels(self.cfg.node, why).inc(n)

    async def room(self) -> m.RouterRoom | None:
        """The router's room reply; None when it does not answer (the lanes then follow
        the reference rules)."""
        try:
            return m.router_room_decoder.decode(await control.request(self.nc, subjects.ROUTER_ROOM, timeout=1.0))
        except Exception:  # noqa: BLE001 - router away: release by the reference rules only
            return None

    async def route(self, bucket: Bucket, bucket_id: str, stop_retrying: bool) -> list[m.Assignment]:
        req = m.encode(self.core.route_request(self.cfg.node, bucket, bucket_id))
        while True:
            freed = self.freed  # a freed-room notice from now on ends the retry wait
            try:
                reply = m.route_reply_decoder.decode(await control.request(self.nc, subjects.ROUTE, req, timeout=2.0))
                if reply.assignments:
                    return reply.assignments
                self.route_retries.inc()
                delay = reply.retry_after or RETRY_WAIT
                if reply.error:  # an older router answers its failures in-band
                    log.warning("router error", error=reply.error)
            except (control.ControlError, nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError,
                    msgspec.DecodeError) as exc:  # ControlError: the router failed on it (a micro error reply)
                log.warning("router error" if isinstance(exc, control.ControlError) else "router unavailable", error=repr(exc))
                self.route_retries.inc()
                delay = 1.0
            if stop_retrying:
                raise TimeoutError("router has no capacity during shutdown")
            try:
                await asyncio.wait_for(freed.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def send(self, job: str, bucket: Bucket, stop_retrying: bool = False) -> None:
        bucket_id = uuid.uuid4().hex[:12]
        try:
            assignments = await self.route(bucket, bucket_id, stop_retrying)
        except TimeoutError:
            return
        placed = self.core.place(job, bucket, assignments)
        if any(not a.replica for a in assignments):
            self.wake.set()  # a cut went back into its lane (bounded lead)
        wrap = lambda prompts: m.WorkBatch(bucket_id, prompts, bucket.key)  # noqa: E731
        for k, p in enumerate(placed):
            items = p.items
            for it, share in zip(items, p.shares):  # the replica reports them done in this unit
                it.payload.cost = share
            sign(self.result_key, [it.payload for it in items], p.replica)  # its proof of the assignment
            # Cut by encoded size under the server's max_payload (asked of the connection).
            limit = message_limit(self.js, subjects.WORK_STREAM.max_msg_size)
            for batch in m.encode_batches([it.payload for it in items], wrap, limit, self.cfg.max_batch):
                part = items[batch.start : batch.stop]
                try:
                    if batch.oversized:  # one prompt no message can carry (the ingestor lets none through)
                        await self.too_large(part[0], len(batch.data), limit)
                    else:
                        await publish(self.js, subjects.work(p.replica), batch.data)
                except PublishError as exc:  # MessageTooLarge too: the limit shrank (a reconnect), cut again
                    log.error("work publish failed: inputs handed back for redelivery", error=str(exc))
                    await self.hand_back(items[batch.start :] + [it for q in placed[k + 1 :] for it in q.items])
                    return
                await self.release(part)
        log.debug("bucket sent", bucket=bucket_id, job=bucket.items[0].payload.job if bucket.items else "",
                  prompts=len(bucket.items), keyed=bool(bucket.key),
                  prefix_tokens=bucket.prefix_len, to=[a.replica or "(kept)" for a in assignments])

    async def too_large(self, item: Item, size: int, limit: int) -> None:
        """The error row of a prompt that no message can carry."""
        p = item.payload
        row = m.error_result(p.id, f"prompt too large for one message: {size} bytes, the server takes {limit}",
                             prompt_tokens=p.prompt_tokens, src=p.src, row=p.row)
        await publish(self.js, subjects.results(ORIGIN_BUCKETER, p.job), m.encode(m.ResultBatch(p.job, [row])))

    async def release(self, items: list[Item]) -> None:
        """These prompts are published: ack each source message whose last one it was."""
        for lease, n in collections.Counter(it.ref for it in items).items():
            await self.ledger.done(lease, n)

    async def hand_back(self, items: list[Item]) -> None:
        """Nak the source messages of unpublished items (a real failure): the server
        redelivers them (any of their prompts already published come out twice and the
        sink drops the copy)."""
        await self.ledger.hand_back({it.ref for it in items}, delay=1.0)

    async def heartbeat(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            hb = m.BucketerHeartbeat(self.cfg.node, time.time(), len(self.lanes))
            try:
                await self.nc.publish(subjects.bucketer_heartbeat(self.cfg.node), m.encode(hb))
            except Exception:  # noqa: BLE001 - reconnecting
                pass
            await asyncio.sleep(1.0)
