"""A JetStream message stand-in for unit tests of consume, failover and takeover logic:
records what was done to it (ack, nak, in_progress, term)."""

from __future__ import annotations


class Seq:
    def __init__(self, stream: int) -> None:
        self.stream = stream


class Meta:
    def __init__(self, seq: int, delivered: int, stream: str) -> None:
        self.sequence, self.num_delivered, self.stream = Seq(seq), delivered, stream


class FakeMsg:
    def __init__(self, data: bytes, seq: int = 1, delivered: int = 1, headers: dict | None = None,
                 subject: str = "pfx.work.r0", stream: str = "PFX_WORK") -> None:
        self.data, self.headers, self.subject = data, headers, subject
        self.metadata = Meta(seq, delivered, stream)
        self.calls: list[str] = []

    async def ack(self) -> None:
        self.calls.append("ack")

    async def nak(self, delay: float | None = None) -> None:
        self.calls.append("nak")

    async def in_progress(self) -> None:
        self.calls.append("in_progress")

    async def term(self) -> None:
        self.calls.append("term")
