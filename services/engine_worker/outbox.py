"""Finished results on their way to `pfx.results.<job>`, and the acks they release.

Results are published per job in small batches (`result_batch` rows, or whatever has
waited `result_linger` seconds). Each row carries the lease of its work message; once a
message's last row is durably published, the ledger acks it. A publish that fails after
every retry hands the messages of its rows back (nak): they are redelivered and the sink
drops the rows already published.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable

import structlog
from nats.js import JetStreamContext

from shared.bus.ledger import AckLedger, Lease
from shared.bus.publish import PublishError, publish
from shared.wire import messages as m
from shared.wire import subjects

log = structlog.get_logger()


class Outbox:
    def __init__(
        self, js: JetStreamContext, ledger: AckLedger, *, batch: int, linger: float, on_published: Callable[[], None]
    ) -> None:
        self.js, self.ledger = js, ledger
        self.batch, self.linger = batch, linger
        self.on_published = on_published
        """Called after rows are published (completed work frees room at the router)."""
        self.rows: dict[str, list[tuple[m.Result, Lease]]] = defaultdict(list)

    async def add(self, job: str, result: m.Result, lease: Lease) -> None:
        rows = self.rows[job]
        rows.append((result, lease))
        if len(rows) >= self.batch:
            await self.flush(job)

    async def flush(self, job: str) -> None:
        rows = self.rows.pop(job, [])
        if not rows:
            return
        try:
            for run in m.chunked([r for r, _ in rows], m.result_size, self.batch):
                await publish(self.js, subjects.results(job), m.encode(m.ResultBatch(job, run)))
        except PublishError as exc:
            log.error("result publish failed: work handed back for redelivery", job=job, error=str(exc))
            await self.ledger.hand_back({lease for _, lease in rows}, delay=1.0)
            return
        published: dict[Lease, int] = defaultdict(int)
        for _, lease in rows:
            published[lease] += 1
        for lease, n in published.items():
            await self.ledger.done(lease, n)
        self.on_published()

    async def flush_all(self) -> None:
        await asyncio.gather(*(self.flush(job) for job in list(self.rows)))

    async def run_linger(self, stop: asyncio.Event) -> None:
        """Publish partial batches every `linger` seconds until `stop`."""
        while not stop.is_set():
            await asyncio.sleep(self.linger)
            await self.flush_all()
