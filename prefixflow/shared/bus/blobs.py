"""Blobs: byte strings of any size kept in JetStream (the `PFX_BLOBS` stream), cut into
pieces that each fit the server's `max_payload`.

A blob is named by its job and a key (a subject token the writer chooses); piece `i` is
published on `pfx.blob.<job>.<key>.<i>` with the number of pieces in a header, and read
back by subject with a direct get (`$JS.API.STREAM.MSG.GET`), so a reader needs no
consumer. What lives here: a job's input columns that do not travel with the prompts
(`prefixflow/client/columns.py`, the sink joins them back), and results too large for one message.

Writing a blob again under the same key (a retry, a resumed job) replaces it piece by
piece; a reader always sees the last copy of each piece. The stream's `max_age` expires
blobs (`subjects.BLOB_RETENTION`); the sink purges a job's blobs when it is done.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from prefixflow.shared.bus.publish import publish
from prefixflow.shared.wire import subjects

PIECES_HEADER = "Pfx-Pieces"
HEADROOM = 4096
"""Bytes of a message kept free for the subject, headers and protocol framing."""
PIECE_CONCURRENCY = 16
"""Pieces of one blob in flight at once (published, or fetched)."""


class BlobMissing(KeyError):
    """A blob (or one of its pieces) is not in the store: never written, expired or purged."""


def piece_size(nc: Client) -> int:
    """Bytes of blob per message: the server's max_payload (asked of the connection, never
    assumed) less room for headers, and never more than the stream takes."""
    limit = min(nc.max_payload, subjects.BLOB_STREAM.max_msg_size)
    return max(limit - HEADROOM, 1024)


async def put_blob(js: JetStreamContext, nc: Client, job: str, key: str, data: bytes) -> int:
    """Store `data` as blob `key` of `job`; returns the number of pieces. Waits (publish
    backpressure) while the store is full."""
    size = piece_size(nc)
    n = max(1, -(-len(data) // size))
    view = memoryview(data)
    for first in range(0, n, PIECE_CONCURRENCY):
        await asyncio.gather(*(
            publish(js, subjects.blob_piece(job, key, i), bytes(view[i * size : (i + 1) * size]),
                    headers={PIECES_HEADER: str(n)})
            for i in range(first, min(first + PIECE_CONCURRENCY, n))
        ))
    return n


async def get_blob(js: JetStreamContext, job: str, key: str) -> bytes:
    """The bytes of blob `key` of `job`; `BlobMissing` if any piece is gone."""
    stream = subjects.BLOB_STREAM.name

    async def piece(i: int):
        try:
            return await js.get_last_msg(stream, subjects.blob_piece(job, key, i))
        except NotFoundError:
            raise BlobMissing(f"blob {job}/{key}: piece {i} not found") from None

    first = await piece(0)
    n = int((first.headers or {}).get(PIECES_HEADER, "1"))
    parts = [first.data or b""]
    for start in range(1, n, PIECE_CONCURRENCY):
        msgs = await asyncio.gather(*(piece(i) for i in range(start, min(start + PIECE_CONCURRENCY, n))))
        parts.extend(msg.data or b"" for msg in msgs)
    return b"".join(parts)


async def purge_job_blobs(js: JetStreamContext, job: str) -> None:
    """Drop every blob of `job` (its output is complete)."""
    await js.purge_stream(subjects.BLOB_STREAM.name, subject=subjects.blob_piece(job, "*", "*"))
