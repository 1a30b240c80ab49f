"""A JetStream message stand-in for unit tests of consume, failover and takeover logic:
records what was done to it (ack, nak, in_progress, term). Its metadata is nats.py's own
`Msg.Metadata`, with every field the real one carries, so product code reads it as it
reads a delivered message (no test branches). And a JetStream context whose publishes are
recorded (`FakeJS`)."""

from __future__ import annotations

import datetime

from nats.aio.msg import Msg


def meta(seq: int, delivered: int, stream: str, pending: int = 0, consumer: str = "fake") -> Msg.Metadata:
    """Metadata as nats.py parses it from a JetStream delivery's reply subject."""
    return Msg.Metadata(
        sequence=Msg.Metadata.SequencePair(stream=seq, consumer=seq),
        num_pending=pending,
        num_delivered=delivered,
        timestamp=datetime.datetime.now(datetime.timezone.utc),
        stream=stream,
        consumer=consumer,
        domain=None,
    )


class FakeMsg:
    def __init__(self, data: bytes, seq: int = 1, delivered: int = 1, headers: dict | None = None,
                 subject: str = "pfx.work.r0", stream: str = "PFX_WORK") -> None:
        self.data, self.headers, self.subject = data, headers, subject
        self.metadata = meta(seq, delivered, stream)
        self.calls: list[str] = []

    async def ack(self) -> None:
        self.calls.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.calls.append("nak")

    async def in_progress(self) -> None:
        self.calls.append("in_progress")

    async def term(self) -> None:
        self.calls.append("term")


class FakeJS:
    """A JetStream context: publishes land in `published`; a server's max_payload."""

    def __init__(self, max_payload: int = 64 * 1024) -> None:
        self._nc = type("Conn", (), {"max_payload": max_payload})()
        self.published: list[tuple[str, bytes, dict | None]] = []

    async def publish(self, subject, payload, timeout=None, headers=None):
        import nats.errors

        if len(payload) > self._nc.max_payload:
            raise nats.errors.MaxPayloadError
        self.published.append((subject, payload, headers))

    async def get_last_msg(self, stream, subject):
        for s, data, headers in reversed(self.published):
            if s == subject:
                return type("Msg", (), {"data": data, "headers": headers})()
        from nats.js.errors import NotFoundError

        raise NotFoundError
