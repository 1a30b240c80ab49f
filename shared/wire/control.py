"""Replies of the control (request/reply) subjects, as tagged msgspec Structs.

The engine-worker answers `pfx.engine.<replica>.reset` (empty the prefix cache) and
`pfx.engine.<replica>.scheduling` (request body: `prefix-groups` or `fcfs`) with a
`ControlReply`: `ok` says whether it was done, `detail` why not (or the value now set).
The router answers `pfx.router.policy` (body: a policy name) with one too; an unknown
policy is a nats.micro error reply (`Nats-Service-Error`).
Tagged, so a later reply type can share the subjects; lenient like every wire message.
"""

from __future__ import annotations

import msgspec


class ControlReply(msgspec.Struct, tag="reply", tag_field="kind", omit_defaults=True):
    ok: bool
    """Done (the cache is empty, the mode is set)."""
    detail: str = ""
    """Why not (`busy`: requests are running; `not ready`: the engine is being
    rebuilt; a bad request), or the value now in effect."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode_reply(reply: ControlReply) -> bytes:
    return _encoder.encode(reply)


def decode_reply(data: bytes) -> ControlReply:
    """Raises msgspec.DecodeError on anything that is not a ControlReply."""
    return _decoder.decode(data)
