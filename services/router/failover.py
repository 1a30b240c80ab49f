"""Failover: the work queued for (or held by) a replica that stopped reporting is moved
to live replicas, without waiting for it to come back.

The router re-creates the dead replica's durable consumer (so even the batches its
worker had in flight, unacked, are deliverable at once), pulls them, routes each batch
again with the current policy and publishes it to the chosen live replicas, then acks
it. Prompts that were in flight may run twice; the sink keeps one. The count of earlier
deliveries travels in a header, so a batch that kills every engine it reaches is still
quarantined after a bounded number of tries. When the replica reports again, the rescue
stops and the worker (re-)binds its consumer.
"""

from __future__ import annotations

import time

import structlog

from shared.wire import messages as m
from shared.wire import subjects
from shared.bus.pull import DurablePull
from shared.bus.provision import ensure_consumer
from shared.bus.poison import PRIOR_DELIVERIES, deliveries, error_rows, is_poison, quarantine
from shared.bus.publish import PublishError, publish

log = structlog.get_logger()


class Failover:
    def __init__(self, router) -> None:
        self.router = router
        self.rescuing: dict[str, DurablePull] = {}
        self.moved = 0
        self.reconnected_at: float | None = None
        """Monotonic time of the router's last NATS reconnect (set by `on_reconnect`)."""

    def on_reconnect(self) -> None:
        self.reconnected_at = time.monotonic()

    async def tick(self) -> None:
        fleet = self.router.fleet
        now = time.monotonic()
        # Just back from our own disconnect: nobody could report meanwhile, so silence is
        # not death. Give every replica one dead_after to be heard again.
        if self.reconnected_at is not None and now - self.reconnected_at < fleet.dead_after:
            for r in fleet.replicas.values():
                r.last_seen = max(r.last_seen, now - fleet.dead_after / 2)
            return
        live = {r.name for r in fleet.live(now)}
        for name, replica in list(fleet.replicas.items()):
            dead = name not in live and replica.last_seen and now - replica.last_seen >= fleet.dead_after
            if dead and live:
                await self.rescue(name)
            elif name in self.rescuing and name in live:
                log.info("replica back: rescue stopped", replica=name, moved=self.moved)
                await self.rescuing.pop(name).unsubscribe()

    async def rescue(self, name: str) -> None:
        js = self.router.js
        spec = subjects.engine_consumer(name)
        if name not in self.rescuing:
            log.warning("replica stopped reporting: moving its work", replica=name)
            self.router.fleet.replicas[name].outstanding = 0  # its work is being moved away
            try:
                await js.delete_consumer(spec.stream, spec.durable)
            except Exception:  # noqa: BLE001 - never existed or already gone
                pass
            await ensure_consumer(js, spec)
            self.rescuing[name] = DurablePull(js, spec)
        msgs = await self.rescuing[name].fetch(8, timeout=0.2)
        for msg in msgs:
            await self.move(msg)

    async def move(self, msg) -> None:
        js = self.router.js
        try:
            work = m.work_batch_decoder.decode(msg.data)
        except Exception as exc:  # noqa: BLE001 - undecodable: dead letter
            await quarantine(js, msg, f"undecodable work batch: {exc}")
            return
        if is_poison(msg):
            await quarantine(js, msg, "generation failed repeatedly", error_rows(work.prompts, "poison message"))
            return
        tokens = sum(p.work_tokens for p in work.prompts)
        chosen = self.router.policy.route(self.router.fleet, time.monotonic(), len(work.prompts), tokens, work.key)
        if not chosen:
            await msg.nak(delay=1.0)
            return
        headers = {PRIOR_DELIVERIES: str(deliveries(msg))}
        start = 0
        try:
            for replica, n in chosen:
                part = m.WorkBatch(work.bucket, work.prompts[start : start + n], work.key)
                start += n
                await publish(js, subjects.work(replica.name), m.encode(part), headers=headers)
        except PublishError:
            await msg.nak(delay=1.0)
            return
        await msg.ack()
        self.moved += 1
