"""Finished results on their way to `pfx.results.<replica>.<job>`, and the acks they release.

Results are published per job in small batches (`result_batch` rows, or whatever has
waited `result_linger` seconds). Each row carries the lease of its work message; once a
message's last row is durably published, the ledger acks it. A publish that fails after
every retry hands the messages of its rows back (nak): they are redelivered and the sink
drops the rows already published.

No message is larger than the server takes: batches are cut by their encoded size under
`message_limit` (the connection's `max_payload` less headroom), and one result too large
for a message on its own (long logprobs, many long completions, a wide embedding) is
stored whole in the job's blob store (`prefixflow/shared/bus/blobs.py`, key `res-<uuid>`) and
travels as a small stand-in (`Result.blob` names the key) that the sink resolves
(`prefixflow/services/sink/large.py`).
"""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict
from collections.abc import Callable

import msgspec
import structlog
from nats.js import JetStreamContext

from prefixflow.shared.bus.blobs import put_blob
from prefixflow.shared.bus.ledger import AckLedger, Lease
from prefixflow.shared.bus.publish import PublishError, message_limit, publish
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()


class Outbox:
    def __init__(
        self, js: JetStreamContext, ledger: AckLedger, *, origin: str, batch: int, linger: float,
        on_published: Callable[[], None], decode_cost: Callable[[], float] = lambda: 0.0,
        step: Callable[[], m.StepModel | None] = lambda: None,
    ) -> None:
        self.js, self.ledger = js, ledger
        self.origin = origin
        """This replica's name: the origin of its results (`subjects.results`)."""
        self.batch, self.linger = batch, linger
        self.on_published = on_published
        """Called after rows are published (completed work frees room at the router)."""
        self.decode_cost = decode_cost
        """The engine's measured cost of an output token now (each batch carries it: the job's ETA)."""
        self.step = step
        """The engine's step model now (each batch carries it: the job's ETA)."""
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
            limit = message_limit(self.js, subjects.RESULTS_STREAM.max_msg_size)
            cost = round(float(self.decode_cost()), 3)
            step = self.step()
            wrap = lambda run: m.ResultBatch(job, run, cost, step)  # noqa: E731
            room = limit - m.envelope_size(wrap)
            results = [await self.by_reference(job, r, room) for r, _ in rows]
            for batch in m.encode_batches(results, wrap, limit, self.batch):
                await publish(self.js, subjects.results(self.origin, job), batch.data)
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

    async def by_reference(self, job: str, result: m.Result, room: int) -> msgspec.Raw | m.Result:
        """`result`, encoded (once: `encode_batches` splices it in as is), if it fits in
        `room` bytes; else a stand-in naming the blob the whole result is now stored in
        (durably: the blob's publish acks come before the stand-in is published)."""
        data = m.encode(result)
        if len(data) <= room:
            return msgspec.Raw(data)
        key = f"res-{uuid.uuid4().hex}"
        pieces = await put_blob(self.js, self.js._nc, job, key, data)  # nats.py: the context's connection
        log.info("result stored by reference", job=job, id=result.id, bytes=len(data), pieces=pieces, blob=key)
        # NOTE: the stand-in reads as an error row to a sink that predates `blob` (mixed
        # versions during an upgrade), never as an empty completion; the sink that
        # resolves it replaces it whole.
        return msgspec.structs.replace(
            result, columns=b"", output="", outputs=[], logprobs=[], embedding=[], blob=key,
            error=f"result of {len(data)} bytes stored by reference (blob {key}); this sink cannot read it",
        )

    async def flush_all(self) -> None:
        await asyncio.gather(*(self.flush(job) for job in list(self.rows)))

    async def run_linger(self, stop: asyncio.Event) -> None:
        """Publish partial batches every `linger` seconds until `stop`."""
        while not stop.is_set():
            await asyncio.sleep(self.linger)
            await self.flush_all()
