"""Failover: the work queued for (or held by) a replica that stopped reporting is moved
to live replicas, without waiting for it to come back.

The router re-creates the dead replica's durable consumer (so even the batches its
worker had in flight, unacked, are deliverable at once), pulls them, routes each batch
again with the current policy and publishes it to the chosen live replicas, then acks
it. Prompts that were in flight may run twice; the sink keeps one.

Backpressure is not failure: a batch is pulled only while some live replica has room,
and one pulled when the caps filled up meanwhile is kept (leased with `in_progress`)
until it can be placed, never nak'ed. The failed deliveries so far travel in a header,
so the replica that gets a batch which killed every engine it reached isolates its prompts
(`prefixflow/services/engine_worker/isolate.py`, strikes travel with them): only a prompt that kills
an engine alone becomes an error row, after a bounded number of tries. When the replica reports again, the rescue stops and the worker
(re-)binds its consumer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.assignments import Assignments
from prefixflow.shared.bus.consume import decode_or_quarantine
from prefixflow.shared.bus.poison import moved_headers
from prefixflow.shared.bus.provision import ensure_consumer
from prefixflow.shared.bus.publish import publish
from prefixflow.shared.bus.pull import DurablePull
from prefixflow.shared.process import metrics
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.provenance import sign

log = structlog.get_logger()

Place = Callable[[int, int, Sequence[int], int, str], tuple[Assignments, list[int]] | None]
"""(prompts, work tokens, prefix key, output budget, LoRA adapter) -> (assignments recorded in the fleet,
what each was charged), or None when no live replica has room."""

RESCUE_BATCH = 8
"""Work messages pulled from a dead replica's consumer at once."""


class Failover:
    def __init__(self, fleet: Fleet, place: Place, result_key: bytes | None = None) -> None:
        self.fleet = fleet
        self.place = place
        self.result_key = result_key
        """Signs each moved prompt's assignment to its new replica (`provenance.py`)."""
        self.js: JetStreamContext | None = None
        self.rescuing: dict[str, DurablePull] = {}
        self.waiting: list[Msg] = []
        """Pulled batches that found no room yet (bounded: nothing more is pulled while
        any wait)."""
        self.moved = 0
        self.reconnected_at: float | None = None
        """Monotonic time of the router's last NATS reconnect (set by `on_reconnect`)."""

    def on_reconnect(self) -> None:
        self.reconnected_at = time.monotonic()

    async def tick(self) -> None:
        fleet = self.fleet
        now = time.monotonic()
        # Just back from our own disconnect: nobody could report meanwhile, so silence is
        # not death. Give every replica one dead_after to be heard again.
        if self.reconnected_at is not None and now - self.reconnected_at < fleet.dead_after:
            for r in fleet.replicas.values():
                r.last_seen = max(r.last_seen, now - fleet.dead_after / 2)
                if r.last_ready:
                    r.last_ready = max(r.last_ready, now - fleet.dead_after / 2)
            return
        await self.retry_waiting()
        live = {r.name for r in fleet.live(now)}
        for name, replica in list(fleet.replicas.items()):
            # Silent, or not ready (rebuilding its engine), for dead_after: its queued
            # work (and what it handed back) goes to the live replicas meanwhile.
            dead = name not in live and replica.last_ready and now - replica.last_ready >= fleet.dead_after
            if dead and live:
                await self.rescue(name)
            elif name in self.rescuing and name in live:
                log.info("replica back: rescue stopped", replica=name, moved=self.moved)
                await self.rescuing.pop(name).unsubscribe()

    async def retry_waiting(self) -> None:
        """Place what waits for room; keep the rest leased."""
        waiting, self.waiting = self.waiting, []
        for msg in waiting:
            if not await self.move(msg):
                self.waiting.append(msg)
        for msg in self.waiting:
            try:
                await msg.in_progress()
            except Exception:  # noqa: BLE001 - connection blip: redelivered at worst
                pass

    async def rescue(self, name: str) -> None:
        assert self.js is not None
        spec = subjects.engine_consumer(name)
        if name not in self.rescuing:
            log.warning("replica silent or not ready: moving its work", replica=name)
            self.fleet.replicas[name].outstanding = 0  # its work is being moved away
            try:
                await self.js.delete_consumer(spec.stream, spec.durable)
            except Exception:  # noqa: BLE001 - never existed or already gone
                pass
            await ensure_consumer(self.js, spec)
            self.rescuing[name] = DurablePull(self.js, spec)
        if self.waiting or not self.fleet.open(time.monotonic()):
            return  # no room anywhere: leave the work queued where it is
        for msg in await self.rescuing[name].fetch(RESCUE_BATCH, timeout=0.2):
            if not await self.move(msg):
                self.waiting.append(msg)

    async def move(self, msg: Msg) -> bool:
        """Route `msg` to live replicas and ack it; False when none has room."""
        assert self.js is not None
        if (work := await decode_or_quarantine(self.js, msg, m.work_batch_decoder, "work batch")) is None:
            return True
        # NOTE: a message past POISON_AFTER deliveries is moved like any other: its
        # deliveries travel in its headers, and the replica that gets it isolates its
        # prompts (prefixflow/services/engine_worker/isolate.py), so only a prompt that kills an
        # engine by itself becomes an error row.
        loras = {p.lora for p in work.prompts}
        placed = self.place(len(work.prompts), sum(p.work_tokens for p in work.prompts), work.key,
                            sum(p.max_tokens for p in work.prompts), loras.pop() if len(loras) == 1 else "")
        if not placed:
            return False
        headers = moved_headers(msg)
        start = 0
        for (replica, n), cost in zip(*placed, strict=True):
            strikes = work.strikes[start : start + n] if work.strikes else []
            m.charge_prompts(work.prompts[start : start + n], cost)  # what its new replica was charged
            sign(self.result_key, work.prompts[start : start + n], replica.name)  # the old grants name the dead one
            part = m.WorkBatch(work.bucket, work.prompts[start : start + n], work.key, strikes=strikes)
            start += n
            await publish(self.js, subjects.work(replica.name), m.encode(part), headers=headers)
        await msg.ack()
        self.moved += 1
        metrics.FAILOVER_MOVED.inc()
        return True
