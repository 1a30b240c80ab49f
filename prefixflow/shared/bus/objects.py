"""Reading an object of a JetStream object store into a file, under a grant.

nats.py's `ObjectStore.get` subscribes to the object's chunks without naming the stream,
so it first asks the server which stream holds them (`$JS.API.STREAM.NAMES`, a listing of
every stream). Here the stream is named (`OBJ_<bucket>`), so the reader needs only what
`prefixflow.shared.wire.permissions.object_read` grants: the object's meta (direct get)
and an ordered consumer on the bucket's stream delivering to its own inbox. It also gives
up when no chunk comes for `stall` seconds (nats.py waits forever), writes each chunk as
it comes (the consumer's flow control answers only once the chunks are taken, so the
server does not send far ahead) and checks the digest.
"""

from __future__ import annotations

import asyncio
import base64
from hashlib import sha256
from typing import BinaryIO

DIGEST_PREFIX = "SHA-256="


class ObjectCorrupt(Exception):
    """An object's content does not match its digest."""


async def read_object(js, bucket: str, name: str, into: BinaryIO, *, stall: float = 30.0) -> int:
    """Write object `name` of object store `bucket` into `into`; its size. Raises
    nats.py's `ObjectNotFoundError` for no such object, TimeoutError after `stall`
    seconds without a chunk, `ObjectCorrupt` for a digest mismatch."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if info.is_link():
        raise ValueError(f"object {name!r} of {bucket} is a link: not read here")
    if not info.size:
        return 0
    digest = sha256()
    size = 0
    sub = await js.subscribe(f"$O.{bucket}.C.{info.nuid}", stream=f"OBJ_{bucket}", ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=stall)
            await asyncio.to_thread(into.write, msg.data)
            digest.update(msg.data)
            size += len(msg.data)
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    want = base64.urlsafe_b64decode(info.digest.removeprefix(DIGEST_PREFIX).removeprefix(DIGEST_PREFIX.lower()))
    if digest.digest() != want:
        raise ObjectCorrupt(f"object {name!r} of {bucket}: its content does not match its digest")
    return size
