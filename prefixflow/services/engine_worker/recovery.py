"""The engine-worker's recovery from an engine death (mixed into `service.EngineWorker`).

When the engine dies (`EngineDead`; a failure of one request is that row's error row,
never a death) the worker stops feeding it and reports not ready (`engine_died`); then
`rebuild` publishes what did finish, re-publishes the unfinished prompts to this
replica's own work subject (`isolate.py`: the untried as they were, the ones in flight
as suspect batches that run alone, bisected, then one prompt at a time; a prompt that
killed the engine alone `isolate.STRIKES` times is an error row and a dead letter), acks
each work batch once all that is published, shuts the engine down and starts it again
(with the rebuild budget's backoff), checks it with a canary and takes work again.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import structlog

from prefixflow.services.engine_worker import isolate
from prefixflow.services.engine_worker.rebuild import EngineGaveUp
from prefixflow.shared.bus.ledger import Lease
from prefixflow.shared.bus.poison import dead_letter
from prefixflow.shared.bus.publish import publish
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()


class Recovery:
    """Engine death and rebuild; `self` is the `EngineWorker`."""

    def engine_died(self, exc: BaseException) -> None:
        """The engine is dead (a request saw it, or it was found dead): stop feeding it
        and report not ready at once; `pump` rebuilds it."""
        if self.death is None:
            log.error("engine died: re-publishing its work and rebuilding it", error=repr(exc))
            self.death = exc
            self.feeder.open = False
            self.untried += self.feeder.drop_pending()
            self.ready = False
            self.status_due.set()
            self.window_free.set()

    async def rebuild(self, stop: asyncio.Event) -> None:
        """Re-publish the dead engine's unfinished work, shut it down, start it again (with
        backoff) and check it with a canary. Raises EngineGaveUp once the rebuild budget is
        spent."""
        t0 = time.monotonic()
        # 1. Prompts still in flight died with the engine.
        for t in self.prompt_tasks:
            t.cancel()
        if self.prompt_tasks:
            await asyncio.wait(self.prompt_tasks)
        # 2. Publish what did finish, re-publish the rest (isolating what was in flight),
        #    ack what is all published; anything else still held is handed back (nak).
        await self.outbox.flush_all()
        charge = await self.retry_unfinished()
        await self.outbox.flush_all()  # the culprits' error rows
        handed = await self.ledger.hand_back()
        await self.publish_status()
        # 3. Shut the engine down and start it again.
        try:
            await self.engine.shutdown()
        except Exception as exc:  # noqa: BLE001 - it is dead already; start anew regardless
            log.warning("shutting the dead engine down failed", error=repr(exc))
        while True:
            delay = self.budget.next_delay(time.monotonic(), charge)
            charge = True  # a failed start always counts
            if delay is None:
                raise EngineGaveUp(f"{self.cfg.max_rebuilds} rebuilds within {self.cfg.rebuild_window:g} s: {self.death!r}")
            log.warning("rebuilding the engine", handed_back=handed, in_seconds=delay)
            try:
                await asyncio.wait_for(stop.wait(), delay)
                return  # stopping: no point in a new engine
            except TimeoutError:
                pass
            try:
                await self.engine.start()
                # NOTE: a rebuilt engine serves a canary before any suspect runs alone, so
                # an engine that cannot serve at all counts against the budget instead of
                # striking the prompts it is given.
                await self.engine.canary()
                break
            except Exception as exc:  # noqa: BLE001 - counts against the budget; try again
                log.error("engine rebuild failed", error=repr(exc))
                try:
                    await self.engine.shutdown()
                except Exception as stop_exc:  # noqa: BLE001 - half-started: nothing more to stop
                    log.warning("shutting the half-started engine down failed", error=repr(stop_exc))
        self.death = None
        self.window.reset()  # a new engine: cold, and its first result should come fast
        self.feeder.open = True
        self.rebuilds += 1
        self.cache_epoch = uuid.uuid4().hex[:8]
        self.ready = True
        self.status_due.set()
        log.info("engine rebuilt: taking work again", seconds=round(time.monotonic() - t0, 2), rebuilds=self.rebuilds)

    async def isolate_all(self, work: m.WorkBatch, lease: Lease) -> None:
        """A work message past the poison limit: its holder kept dying with it (the worker
        process itself, not only its engine, whose deaths re-publish rather than
        redeliver). Every prompt is a suspect, isolated like the prompts an engine died
        with, never all error rows."""
        await self.resplit(lease, work, list(range(len(work.prompts))), [], alone=len(work.prompts) == 1)
        await self.outbox.flush_all()

    async def retry_unfinished(self) -> bool:
        """After an engine death: re-publish each held batch's unfinished prompts
        (`isolate.split`: what was in flight as suspect batches, bisected or struck) and
        ack the batches whose every output is published. Returns whether the death counts
        against the rebuild budget (`isolate.charged`)."""
        died = list(self.in_engine.values())
        # NOTE: followers (`fanout.py`) never ran: untried, re-published with their work message.
        untried, self.untried = self.untried + self.abandon_followers(), []
        self.in_engine.clear()
        charge = isolate.charged([h.suspect for h in died])
        alone = len(died) == 1
        by_lease: dict[Lease, tuple[list[int], list[int], m.WorkBatch]] = {}
        for h, kind in [(h, 0) for h in died] + [(h, 1) for h in untried]:
            by_lease.setdefault(h.lease, ([], [], h.work))[kind].append(h.index)
        for lease, (in_flight, waiting, work) in by_lease.items():
            if self.ledger.active(lease):  # else handed back already: redelivered whole
                await self.resplit(lease, work, sorted(in_flight), sorted(waiting), alone=alone)
        if died:
            log.warning("engine died with work in flight: re-published for isolation", in_flight=len(died),
                        untried=len(untried), batches=len(by_lease), charged=charge)
        return charge

    async def resplit(self, lease: Lease, work: m.WorkBatch, died: list[int], untried: list[int], *, alone: bool) -> None:
        """Re-publish the prompts `died` and `untried` of `work` to this replica's work
        subject as `isolate.split` says, queue error rows for its culprits, and count them
        all done on `lease` (acked once its other outputs are published too)."""
        strikes = work.strikes or [0] * len(work.prompts)
        plan = isolate.split(strikes, died, untried, suspect=bool(work.strikes), alone=alone)
        for part in plan.parts:
            sub = m.WorkBatch(work.bucket, [work.prompts[i] for i in part.indices], work.key, strikes=part.strikes)
            # NOTE: the publish ack comes before the input's ack: nothing lost.
            await publish(self.js, subjects.work(self.cfg.replica), m.encode(sub))
        for i in plan.culprits:
            p = work.prompts[i]
            why = f"poison prompt: the engine died {isolate.STRIKES} times while it ran alone"
            alone_batch = m.WorkBatch(work.bucket, [p], work.key, strikes=[strikes[i] + 1])
            await dead_letter(self.js, lease.msg, why, data=m.encode(alone_batch), part=f"{p.job}:{p.id}")
            await self.finish(lease, p, error=why, bucket=work.bucket)
        await self.ledger.done(lease, sum(len(part.indices) for part in plan.parts))
