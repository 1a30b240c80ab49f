"""Which input messages a stage still holds, and when to ack or hand them back.

A stage that turns one input message into several outputs (a work batch into results, a
prompt batch into buckets) holds the input until every output is durably published, then
acks it; if it cannot finish, it naks it (hands it back) so JetStream redelivers it.

Each hold is a `Lease`: outputs carry their lease, not the message's sequence number.
After a hand-back the same message can be redelivered and held again under a new lease
while outputs of the old one are still being published; those then count against the
old, released lease (a no-op) and cannot ack the new delivery early.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

import structlog
from nats.aio.msg import Msg

log = structlog.get_logger()


class Lease:
    """One held delivery of an input message: acked once `remaining` outputs are done."""

    __slots__ = ("key", "msg", "remaining")

    def __init__(self, key: Hashable, msg: Msg, remaining: int) -> None:
        self.key = key
        self.msg = msg
        self.remaining = remaining


class AckLedger:
    """Input messages held by a stage, keyed by something that identifies a message
    across redeliveries (its stream sequence number)."""

    def __init__(self) -> None:
        self._held: dict[Hashable, Lease] = {}

    def hold(self, key: Hashable, msg: Msg, count: int) -> Lease | None:
        """Hold `msg` until `count` outputs are done; None if `key` is already held (a
        redelivery of a message still being worked on: keep the first copy)."""
        if key in self._held:
            return None
        lease = self._held[key] = Lease(key, msg, count)
        return lease

    def active(self, lease: Lease) -> bool:
        """Still held (neither acked nor handed back)."""
        return self._held.get(lease.key) is lease

    async def done(self, lease: Lease, n: int = 1) -> bool:
        """`n` outputs of `lease` are published; ack the message once all are. True if
        this call acked it. A lease no longer held (handed back) is ignored."""
        if not self.active(lease):
            return False
        lease.remaining -= n
        if lease.remaining > 0:
            return False
        del self._held[lease.key]
        try:
            await lease.msg.ack()
        except Exception as exc:  # noqa: BLE001 - then it is redelivered; the sink drops duplicates
            log.warning("ack failed", error=repr(exc))
        return True

    async def hand_back(self, leases: Iterable[Lease] | None = None, delay: float | None = None) -> int:
        """Nak the messages of `leases` (default: every one held) so they are redelivered,
        after `delay` seconds if given. Returns how many were handed back."""
        todo = list(self._held.values()) if leases is None else [lease for lease in leases if self.active(lease)]
        for lease in todo:
            del self._held[lease.key]
            try:
                await lease.msg.nak(delay=delay)
            except Exception as exc:  # noqa: BLE001 - then it is redelivered after ack_wait
                log.warning("nak failed", error=repr(exc))
        return len(todo)

    def release(self, lease: Lease) -> None:
        """Forget `lease` without acking or naking it (its message was ended otherwise:
        terminated by a quarantine)."""
        if self.active(lease):
            del self._held[lease.key]

    def messages(self) -> list[Msg]:
        """The messages held (to keep them leased with `in_progress()`)."""
        return [lease.msg for lease in self._held.values()]

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._held
