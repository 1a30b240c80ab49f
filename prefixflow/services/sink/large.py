"""Results too large for one message, read back from the blob store.

The engine-worker's outbox (`prefixflow/services/engine_worker/outbox.py`) stores a result whose
encoding does not fit under the server's `max_payload` whole, as msgpack, in the job's
blob store (`prefixflow/shared/bus/blobs.py`), and publishes a small stand-in whose `Result.blob`
names the blob. Before the sink writes a batch, every stand-in in it is replaced by the
result it stands for:

- a blob that is gone (expired, purged) or does not hold that prompt's result can never
  be read: the row becomes an error row saying so (the job still completes);
- a blob that cannot be read now (NATS away, a timeout) is a real failure of this
  delivery: `BlobUnavailable`, and the message is handed back (nak) for redelivery, which
  counts toward poison like any other failure to write it.
"""

from __future__ import annotations

import asyncio

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from prefixflow.shared.bus.blobs import BlobMissing, get_blob
from prefixflow.shared.wire import messages as m

log = structlog.get_logger()

_result_decoder = msgspec.msgpack.Decoder(m.Result)

RETRY_DELAY = 1.0
"""Seconds before a message whose blob could not be read now is redelivered."""


class BlobUnavailable(Exception):
    """A stand-in's blob could not be read now (the store did not answer): retry later."""


async def resolve(js: JetStreamContext, batch: m.ResultBatch) -> m.ResultBatch:
    """`batch` with every stand-in replaced by its whole result (the same batch when it
    holds none). Raises `BlobUnavailable`."""
    stand_ins = [i for i, r in enumerate(batch.results) if r.blob]
    if not stand_ins:
        return batch
    results = list(batch.results)
    found = await asyncio.gather(*(_fetch(js, batch.job, results[i]) for i in stand_ins))
    for i, result in zip(stand_ins, found, strict=True):
        results[i] = result
    return m.ResultBatch(batch.job, results)


async def resolve_or_hand_back(js: JetStreamContext, batch: m.ResultBatch, msg: Msg) -> m.ResultBatch | None:
    """`resolve(js, batch)`, or None once `msg` is handed back (nak) because a blob could
    not be read now."""
    try:
        return await resolve(js, batch)
    except BlobUnavailable as exc:
        log.warning("result blob unavailable: message handed back", job=batch.job, error=str(exc))
        await msg.nak(delay=RETRY_DELAY)
        return None


async def _fetch(js: JetStreamContext, job: str, stand_in: m.Result) -> m.Result:
    try:
        data = await get_blob(js, job, stand_in.blob)
    except BlobMissing as exc:
        return _lost(stand_in, f"its blob is gone ({exc})")
    except (nats.errors.Error, asyncio.TimeoutError) as exc:
        raise BlobUnavailable(f"blob {job}/{stand_in.blob}: {exc!r}") from exc
    try:
        result = _result_decoder.decode(data)
    except msgspec.DecodeError as exc:
        return _lost(stand_in, f"its blob does not decode ({exc})")
    if result.id != stand_in.id or result.blob:
        return _lost(stand_in, f"its blob holds another result (id {result.id!r})")
    return result


def _lost(stand_in: m.Result, why: str) -> m.Result:
    log.error("result stored by reference is lost", id=stand_in.id, blob=stand_in.blob, why=why)
    return m.error_result(
        stand_in.id, f"result too large for one message was stored by reference, but {why}",
        prompt_tokens=stand_in.prompt_tokens, replica=stand_in.replica, bucket=stand_in.bucket,
        src=stand_in.src, row=stand_in.row,
    )
