"""The mover: prompts queued for a bucketer node that is gone for good are taken over by
live bucketers, like the router's failover does for a dead replica's work
(`prefixflow/services/router/failover.py`).

Every ingestor runs one, beside its ingest loop. Every `SCAN_EVERY` seconds it asks the
bucket stream how many messages each node's subject holds (queued or leased); the pure
rules (`prefixflow/services/ingestor/takeover.py`) say which nodes are gone (no heartbeat for
`--bucketer-gone-after` seconds, prompts left) and which live nodes take their prompts.
For a gone node it:

1. re-creates the node's durable consumer of each job with prompts there, once (so what
   its dead bucketer held leased is deliverable at once, not after `ack_wait`);
2. pulls a few messages at a time (memory: at most `MOVE_BATCH` messages);
3. splits each message's prompts over the live nodes (rendezvous on the first block) and
   publishes each part to `pfx.bucket.<live node>.<job>` with `Nats-Msg-Id`
   `moved:<stream>:<sequence>:<node>` and the failed deliveries so far
   (`prefixflow/shared/bus/poison.moved_headers`), waiting for every publish ack (a full stream
   makes it wait, the message kept leased: backpressure is never a nak);
4. acks the original.

Exactly once at the output: the original is acked only after its parts are durably
published, so a crash loses nothing; a crash between the two redoes the move with the
same message ids, which JetStream drops as duplicates (and past its duplicate window the
sink keeps one row per (job, id)). Several ingestors may move the same node's prompts at
once: the consumer is shared, each message is delivered to one of them at a time, and a
redelivered one is the crash case above. When the node's heartbeat returns the mover
stops and its bucketer binds its consumer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import APIError

from prefixflow.services.ingestor.takeover import Takeover, move_id, node_of, place
from prefixflow.shared.bus.consume import decode_or_quarantine
from prefixflow.shared.bus.poison import moved_headers
from prefixflow.shared.bus.provision import ensure_consumer
from prefixflow.shared.bus.publish import publish
from prefixflow.shared.bus.pull import DurablePull
from prefixflow.shared.process import metrics
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()

MOVE_BATCH = 16
"""Bucket messages pulled from a gone node's consumer at once."""
MOVE_JOBS = 16
"""Jobs of a gone node moved at once (one consumer each; a stream takes 1,000 in all)."""
SCAN_EVERY = 1.0
"""Seconds between looks at the bucket stream's per-node backlog."""
TICK = 0.5
"""Seconds between rounds when there is nothing to move."""
TRANSPORT_ERRORS = (nats.errors.Error, APIError, asyncio.TimeoutError)
"""Errors of a NATS call that a later round retries (a reconnect, a stream with no leader)."""


class Mover:
    def __init__(self, heard: dict[str, float], gone_after: float, live_for: float, block_size: int) -> None:
        self.heard = heard
        """node -> monotonic time of its last heartbeat (the ingestor's own map)."""
        self.rules = Takeover(gone_after, live_for, since=time.monotonic())
        self.block_size = block_size
        self.js: JetStreamContext | None = None
        self.pulls: dict[tuple[str, str], DurablePull] = {}
        """(node, job) -> the pull on that job's consumer of a gone node."""
        self.backlog: dict[str, int] = {}
        self.jobs: dict[str, set[str]] = {}
        """node -> jobs with prompts on its subjects (as of the last scan)."""
        self.scanned_at = float("-inf")
        self.moved = 0

    def on_reconnect(self) -> None:
        self.rules.on_reconnect(time.monotonic())

    async def run(self, js: JetStreamContext, stop: asyncio.Event) -> None:
        self.js = js
        try:
            while not stop.is_set():
                if not await self.tick():
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(stop.wait(), TICK)
        finally:
            for node in {node for node, _ in self.pulls}:
                await self.release(node)

    async def tick(self) -> int:
        """One round: look, decide, move. Returns the messages moved."""
        now = time.monotonic()
        if now - self.scanned_at >= SCAN_EVERY:
            try:
                self.backlog, self.jobs = await self.scan()
            except TRANSPORT_ERRORS as exc:
                log.warning("takeover: cannot read the bucket stream; retrying", error=repr(exc))
                return 0
            self.scanned_at = now
        decision = self.rules.decide(self.heard, self.backlog, now)
        for node in decision.stop:
            log.info("takeover stopped", node=node, heard=node in self.heard and now - self.heard[node] < self.rules.gone_after,
                     left=self.backlog.get(node, 0), moved=self.moved)
            await self.release(node)
        moved = 0
        for node in decision.move:
            try:
                moved += await self.move_from(node, decision.targets)
            except TRANSPORT_ERRORS as exc:
                log.warning("takeover: pull failed; retrying", node=node, error=repr(exc))
        return moved

    async def scan(self) -> tuple[dict[str, int], dict[str, set[str]]]:
        """Messages on each node's bucket subjects (queued or leased), and the jobs they
        belong to."""
        assert self.js is not None
        stream = subjects.BUCKET_STREAM
        info = await self.js.stream_info(stream.name, subjects_filter=subjects.node_bucket("*"))
        backlog: dict[str, int] = {}
        jobs: dict[str, set[str]] = {}
        for subject, n in (info.state.subjects or {}).items():
            if (node := node_of(subject)) is not None and n:
                backlog[node] = backlog.get(node, 0) + n
                jobs.setdefault(node, set()).add(subjects.bucket_parts(subject)[1])  # type: ignore[index]
        return backlog, jobs

    async def take(self, node: str, job: str) -> DurablePull:
        """The gone node's consumer of `job`, re-created the first time (its leased messages
        are deliverable at once)."""
        assert self.js is not None
        if (pull := self.pulls.get((node, job))) is None:
            spec = subjects.bucketer_consumer(node, job)
            if not any(n == node for n, _ in self.pulls):
                log.warning("bucketer gone: moving its prompts to live nodes", node=node, left=self.backlog.get(node, 0),
                            silent_s=round(self.rules.silent_for(node, self.heard, time.monotonic()), 1))
            with contextlib.suppress(*TRANSPORT_ERRORS):  # never existed, or already gone
                await self.js.delete_consumer(spec.stream, spec.durable)
            await ensure_consumer(self.js, spec)
            pull = self.pulls[(node, job)] = DurablePull(self.js, spec, label=f"takeover-{node}")
        return pull

    async def release(self, node: str, job: str | None = None) -> None:
        """Close the consumers of `node` (of one `job`)."""
        for key in [k for k in self.pulls if k[0] == node and job in (None, k[1])]:
            pull = self.pulls.pop(key)
            await pull.unsubscribe()
            with contextlib.suppress(*TRANSPORT_ERRORS):  # the server's idle limit removes it anyway
                await self.js.delete_consumer(pull.spec.stream, pull.spec.durable)

    async def move_from(self, node: str, targets: tuple[str, ...]) -> int:
        for n, job in [k for k in self.pulls if k[0] == node and k[1] not in self.jobs.get(node, ())]:
            await self.release(n, job)  # moved all of it
        moved = 0
        for job in sorted(self.jobs.get(node, ()))[:MOVE_JOBS]:
            pull = await self.take(node, job)
            msgs = await pull.fetch(MOVE_BATCH, timeout=0.05)
            for msg in msgs:
                await self.move(msg, targets)
            moved += len(msgs)
        return moved

    async def move(self, msg: Msg, targets: tuple[str, ...]) -> None:
        """Publish `msg`'s prompts to `targets`, then ack it."""
        assert self.js is not None
        if (batch := await decode_or_quarantine(self.js, msg, m.prompt_batch_decoder, "prompt batch")) is None:
            return
        # NOTE: a message past POISON_AFTER deliveries moves like any other: its failed
        # deliveries travel in its headers and the receiving bucketer quarantines it.
        headers = moved_headers(msg)
        meta = msg.metadata
        job = subjects.bucket_parts(msg.subject)
        if job is None:  # not a bucket subject: nothing of ours
            await msg.term()
            return
        async with leased(msg):
            pubs = []
            for node, prompts in place(batch.prompts, targets, self.block_size).items():
                part_headers = {**headers, "Nats-Msg-Id": move_id(meta.stream, meta.sequence.stream, node)}
                data = m.encode(m.PromptBatch(prompts, batch.priority))
                pubs.append(publish(self.js, subjects.bucket(node, job[1]), data, headers=part_headers))
            await asyncio.gather(*pubs)
        try:
            await msg.ack()
        except nats.errors.Error as exc:  # redelivered and moved again: the same ids, dropped
            log.warning("takeover: ack failed", error=repr(exc))
            return
        self.moved += 1
        metrics.TAKEOVER_MOVED.inc()


@contextlib.asynccontextmanager
async def leased(msg: Msg):
    """Keep `msg` leased (`in_progress`) while its publishes wait (a full stream)."""

    async def keep() -> None:
        while True:
            await asyncio.sleep(subjects.IN_PROGRESS_EVERY)
            with contextlib.suppress(*TRANSPORT_ERRORS):  # a blip: the next round retries
                await msg.in_progress()

    task = asyncio.create_task(keep())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
