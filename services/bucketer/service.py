"""Bucketer (one per node): groups prompts that share a prefix, routes the groups.

Two tasks share a bounded `PrefixBuffer`:
- the intake loop pulls prompt batches from `pfx.bucket.<node>` while the buffer has
  room (a full buffer stops the pulling: backpressure up to the ingestor);
- the dispatcher takes due buckets, asks the router where each goes (retrying while the
  router says retry-after - the buffer meanwhile keeps filling, which is exactly when
  buckets get better; the router's freed-room event cuts the wait short), publishes
  them to `pfx.work.<replica>`, and acks an input message once every prompt it carried
  has been durably published downstream.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg

from shared.wire import messages as m
from shared.wire import subjects
from shared.process import metrics
from shared.process.config import BucketerConfig
from shared.bus.connection import close, connect
from shared.bus.consume import quarantine_held, receive
from shared.bus.ledger import AckLedger, Lease
from shared.bus.provision import provision
from shared.bus.poison import error_rows
from shared.bus.publish import PublishError, message_limit, publish
from shared.bus.pull import DurablePull, keep_in_progress
from services.bucketer.buffer import Bucket, Item, PrefixBuffer

log = structlog.get_logger()

SEND_CONCURRENCY = 32
EAGER_MIN_WAIT = 0.1
"""Seconds the oldest prompt waits before eager release may ask whether input landed."""
CAUGHT_UP_EVERY = 0.1
FETCH_MESSAGES = 4
"""Prompt batches pulled at once (each up to 512 prompts): how far past its bound the
buffer can get before the intake stops."""


class Bucketer:
    def __init__(self, cfg: BucketerConfig) -> None:
        self.cfg = cfg
        self.buffer = PrefixBuffer(
            max_prompts=cfg.buffer_prompts,
            max_bytes=cfg.buffer_bytes,
            min_bucket=cfg.min_bucket,
            max_bucket=cfg.max_bucket,
            threshold=cfg.threshold,
            max_wait=cfg.max_wait,
            block_size=cfg.hash_block_size,
            pool_size=cfg.pool_size,
        )
        self.last_input = time.monotonic()
        # stream sequence -> [message, prompts not yet published downstream]
        self.ledger = AckLedger()
        """Prompt batches held until every prompt they carried is published downstream."""
        self.wake = asyncio.Event()
        self.freed = asyncio.Event()
        """Set (and replaced) whenever the router announces freed room."""
        self.caught_up_at = (-1.0, False)
        """(when asked, answer) of the last upstream check."""
        node = cfg.node
        self.prompts_in = metrics.BUCKETER_PROMPTS_IN.labels(node)
        self.route_retries = metrics.ROUTE_RETRIES.labels(node)
        self.bucket_size = metrics.BUCKET_SIZE.labels(node)
        metrics.BUCKETER_BUFFERED.labels(node).set_function(lambda: len(self.buffer))
        metrics.BUCKETER_HELD.labels(node).set_function(lambda: len(self.ledger))

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, f"bucketer-{self.cfg.node}")
        self.nc, self.js = nc, nc.jetstream()
        await provision(self.js)
        sub = DurablePull(self.js, subjects.bucketer_consumer(self.cfg.node))

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
            await self.intake(sub, stop)
            # Shutdown: release everything buffered and publish it, within the drain time.
            try:
                await asyncio.wait_for(asyncio.shield(dispatcher), self.cfg.drain_timeout)
            except asyncio.TimeoutError:
                log.warning("shutdown: unpublished prompts stay unacked and will be redelivered", held=len(self.ledger))
                dispatcher.cancel()
        await close(nc, sub)

    async def intake(self, sub: DurablePull, stop: asyncio.Event) -> None:
        """Pull prompt batches into the buffer while it has room."""
        while not stop.is_set():
            if self.buffer.over():
                # Full: stop pulling (backpressure) until the dispatcher releases buckets.
                # Input is waiting, so this is not the idle end of input.
                self.last_input = time.monotonic()
                await asyncio.sleep(0.05)
                continue
            msgs = await sub.fetch(FETCH_MESSAGES, timeout=0.1)
            now = time.monotonic()
            for msg in msgs:
                await self.take(msg, now)
            if msgs:
                self.last_input = now
            self.wake.set()

    async def poisoned(self, batch: m.PromptBatch, lease: Lease) -> None:
        await quarantine_held(self.js, self.ledger, lease, "bucketing failed repeatedly",
                              error_rows(batch.prompts, "poison message"))

    async def take(self, msg: Msg, now: float) -> None:
        got = await receive(self.js, msg, m.prompt_batch_decoder, "prompt batch", ledger=self.ledger,
                            count=lambda batch: len(batch.prompts), on_poison=self.poisoned)
        if got is None:
            return
        batch, lease = got.body, got.lease
        # Held until its last prompt is published, which may take a while (prompts of one
        # message go to many buckets): keep only what acking needs, not the raw payload.
        msg.data = b""
        self.prompts_in.inc(len(batch.prompts))
        for p in batch.prompts:
            self.buffer.insert(Item(p.tokens, now, p, lease, p.work_tokens))

    async def dispatch(self, stop: asyncio.Event) -> None:
        while True:
            if stop.is_set():
                buckets = self.buffer.pop(time.monotonic(), flush=True)
                self.count_released(buckets)
                await asyncio.gather(*(self.send(b, stop_retrying=True) for b in buckets))
                return
            now = time.monotonic()
            # No input for a while and none left upstream = end of input: flush. (A slow
            # ingest batch can leave this node without input for longer than idle_flush;
            # flushing then would cut every group of the burst in two.)
            idle = bool(self.buffer) and now - self.last_input >= self.cfg.idle_flush and await self.caught_up(now)
            oldest = self.buffer.oldest()
            # Eager release once the input has landed (groups then go out whole, not as
            # fragments of a burst still being ingested), or after --eager-delay anyway.
            waited = -1.0 if oldest is None else now - oldest
            settled = waited >= self.cfg.eager_delay or (waited >= EAGER_MIN_WAIT and await self.caught_up(now))
            budget = await self.room() if settled and not idle else 0
            # Route and publish up to SEND_CONCURRENCY buckets at once (each waits for its
            # route reply and publish ack; one at a time would cap the rate at 1/RTT).
            buckets = self.buffer.pop(now, flush=idle, budget=budget)
            self.count_released(buckets)
            for i in range(0, len(buckets), SEND_CONCURRENCY):
                await asyncio.gather(*(self.send(b) for b in buckets[i : i + SEND_CONCURRENCY]))
            self.wake.clear()
            try:
                await asyncio.wait_for(self.wake.wait(), 0.2)
            except asyncio.TimeoutError:
                pass

    def count_released(self, buckets: list[Bucket]) -> None:
        """Metrics of one release: bucket sizes, and buckets and prompts by why."""
        if not buckets:
            return
        count: dict[str, list[int]] = {}
        for b in buckets:
            for n, why in b.released:
                self.bucket_size.observe(n)
                c = count.setdefault(why, [0, 0])
                c[0] += 1
                c[1] += n
        for why, (k, n) in count.items():
            metrics.RELEASES.labels(self.cfg.node, why).inc(k)
            metrics.RELEASED_PROMPTS.labels(self.cfg.node, why).inc(n)

    async def caught_up(self, now: float) -> bool:
        """Nothing upstream is still on its way here: the ingest stream has no message
        left to ingest and this node's bucket stream none left to deliver. (Asked at most
        every CAUGHT_UP_EVERY seconds; unknown counts as not caught up.)"""
        if now - self.caught_up_at[0] < CAUGHT_UP_EVERY:
            return self.caught_up_at[1]
        try:
            ingest = await self.js.consumer_info(subjects.INGEST_STREAM.name, subjects.ingestor_consumer().durable)
            own = await self.js.consumer_info(subjects.BUCKET_STREAM.name, subjects.bucketer_consumer(self.cfg.node).durable)
            answer = ingest.num_pending + ingest.num_ack_pending == 0 and own.num_pending == 0
        except Exception:  # noqa: BLE001 - not provisioned yet or reconnecting
            answer = False
        self.caught_up_at = (now, answer)
        return answer

    async def room(self) -> float:
        """Free room on the replicas (work tokens) if eager release is on; 0 otherwise."""
        if not self.cfg.eager:
            return 0
        try:
            reply = m.router_room_decoder.decode((await self.nc.request(subjects.ROUTER_ROOM, b"", timeout=1.0)).data)
        except Exception:  # noqa: BLE001 - router away: release by the reference rules only
            return 0
        return float("inf") if reply.tokens < 0 else reply.tokens

    def route_request(self, bucket: Bucket, tokens: int, bucket_id: str) -> m.RouteRequest:
        parts = []
        start = 0
        for n, key in bucket.parts:
            part_tokens = sum(it.payload.work_tokens for it in bucket.items[start : start + n])
            parts.append(m.RoutePart(n, part_tokens, key))
            start += n
        return m.RouteRequest(self.cfg.node, len(bucket.items), tokens, bucket.key, parts, bucket_id)

    async def route(self, bucket: Bucket, tokens: int, bucket_id: str, stop_retrying: bool) -> list[m.Assignment]:
        req = m.encode(self.route_request(bucket, tokens, bucket_id))
        while True:
            freed = self.freed  # a freed-room notice from now on ends the retry wait
            try:
                msg = await self.nc.request(subjects.ROUTE, req, timeout=2.0)
                if msg.headers and msg.headers.get("Nats-Service-Error"):
                    raise RuntimeError(f"router: {msg.headers.get('Nats-Service-Error')}")
                reply = m.route_reply_decoder.decode(msg.data)
                if reply.assignments:
                    return reply.assignments
                self.route_retries.inc()
                delay = reply.retry_after or 0.5
                if reply.error:
                    log.warning("router error", error=reply.error)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError, msgspec.DecodeError, RuntimeError) as exc:
                log.warning("router unavailable", error=repr(exc))
                self.route_retries.inc()
                delay = 1.0
            if stop_retrying:
                raise TimeoutError("router has no capacity during shutdown")
            try:
                await asyncio.wait_for(freed.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def send(self, bucket: Bucket, stop_retrying: bool = False) -> None:
        tokens = sum(it.payload.work_tokens for it in bucket.items)
        bucket_id = uuid.uuid4().hex[:12]
        try:
            assignments = await self.route(bucket, tokens, bucket_id, stop_retrying)
        except TimeoutError:
            return
        start = 0
        wrap = lambda prompts: m.WorkBatch(bucket_id, prompts, bucket.key)  # noqa: E731
        for a in assignments:
            items = bucket.items[start : start + a.prompts]
            start += a.prompts
            # Cut by encoded size under the server's max_payload (asked of the connection).
            limit = message_limit(self.js, subjects.WORK_STREAM.max_msg_size)
            for batch in m.encode_batches([it.payload for it in items], wrap, limit, self.cfg.max_batch):
                part = items[batch.start : batch.stop]
                try:
                    if batch.oversized:  # one prompt no message can carry (the ingestor lets none through)
                        await self.too_large(part[0], len(batch.data), limit)
                    else:
                        await publish(self.js, subjects.work(a.replica), batch.data)
                except PublishError as exc:  # MessageTooLarge too: the limit shrank (a reconnect), cut again
                    log.error("work publish failed: inputs handed back for redelivery", error=str(exc))
                    await self.hand_back(bucket.items[start - a.prompts + batch.start :])
                    return
                await self.release(part)
        log.debug("bucket sent", bucket=bucket_id, prompts=len(bucket.items), keyed=bool(bucket.key),
                  prefix_tokens=bucket.prefix_len, to=[a.replica for a in assignments])

    async def too_large(self, item: Item, size: int, limit: int) -> None:
        """The error row of a prompt that no message can carry."""
        p = item.payload
        row = m.error_result(p.id, f"prompt too large for one message: {size} bytes, the server takes {limit}",
                             prompt_tokens=p.prompt_tokens, src=p.src, row=p.row)
        await publish(self.js, subjects.results(p.job), m.encode(m.ResultBatch(p.job, [row])))

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
            hb = m.BucketerHeartbeat(self.cfg.node, time.time(), len(self.buffer))
            try:
                await self.nc.publish(subjects.bucketer_heartbeat(self.cfg.node), m.encode(hb))
            except Exception:  # noqa: BLE001 - reconnecting
                pass
            await asyncio.sleep(1.0)
