"""The consume protocol every stage follows for one JetStream message.

1. **decode**: a message that does not decode is quarantined (dead-lettered and
   terminated), never retried;
2. **ledger**: a redelivered copy of a message the stage still holds is skipped (the
   first copy's outputs are on their way);
3. **hold**: the message is held until its outputs are durably published
   (`prefixflow/shared/bus/ledger.py`); one with nothing to do is acked at once;
4. **poison**: a message past `POISON_AFTER` deliveries goes to the stage's own
   `on_poison` (error rows, or the engine-worker's isolation), never to the normal path.

What is left is the stage's own work on the body it gets back. The bucketer and the
engine-worker go through `receive`; the sink (which holds results per job until a flush,
not in a ledger) and the router's failover use its decode step and `is_poison`; the
ingestor's input is users' rows, whose decode errors are error rows of their job.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import msgspec
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from prefixflow.shared.bus.ledger import AckLedger, Lease
from prefixflow.shared.bus.poison import is_poison, quarantine

T = TypeVar("T")


class Received(Generic[T]):
    """A message to work on: its decoded body and the lease that holds it."""

    __slots__ = ("body", "lease")

    def __init__(self, body: T, lease: Lease | None) -> None:
        self.body = body
        self.lease = lease


async def decode_or_quarantine(js: JetStreamContext, msg: Msg, decoder: msgspec.msgpack.Decoder, what: str):
    """The body of `msg`, or None once an undecodable `msg` is quarantined."""
    try:
        return decoder.decode(msg.data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        await quarantine(js, msg, f"undecodable {what}: {exc}")
        return None


async def receive(
    js: JetStreamContext,
    msg: Msg,
    decoder: msgspec.msgpack.Decoder,
    what: str,
    *,
    ledger: AckLedger,
    count: Callable[[T], int],
    on_poison: Callable[[T, Lease], Awaitable[None]],
) -> Received[T] | None:
    """Decode, skip a held copy, hold, route poison (see the module's doc). Returns what
    to work on, or None when the message is dealt with. `count(body)`: the outputs to
    publish before the message is acked; `on_poison` must end the lease (settle it with
    `ledger.done`, or `ledger.release` it after terminating the message)."""
    body = await decode_or_quarantine(js, msg, decoder, what)
    if body is None:
        return None
    seq = msg.metadata.sequence.stream
    if seq in ledger:  # redelivered while we still hold it: keep the first copy
        return None
    n = count(body)
    lease = ledger.hold(seq, msg, n)
    if n == 0:
        await ledger.done(lease, 0)  # nothing to publish: ack
        return None
    if is_poison(msg):
        await on_poison(body, lease)
        return None
    return Received(body, lease)


async def quarantine_held(js: JetStreamContext, ledger: AckLedger, lease: Lease, reason: str, rows=(), *,
                          origin: str = "") -> None:
    """`on_poison` for a stage whose poison message becomes error rows: quarantine it (the
    rows published, the message terminated) and release its lease."""
    try:
        await quarantine(js, lease.msg, reason, rows, origin=origin)
    finally:
        ledger.release(lease)
