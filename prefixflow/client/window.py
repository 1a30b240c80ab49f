"""How far a job's publisher may run ahead of its output: the in-flight window.

Without it a client publishes as fast as it reads its input, and everything it has not
yet seen written sits in the cluster's streams (a 10M-row job put ~800 MiB into
nats-server before a tenth of it was done, up to the ingest stream's 1 GiB cap, where
every other job's publisher waits too). With it, the client publishes a chunk only
while fewer than `IN_FLIGHT_ROWS` of the rows it sent are unaccounted for: neither
written by the sink nor dropped there as duplicates (`JobStatus.rows` +
`JobStatus.duplicates`).

Pure bookkeeping (`Window`); the caller polls the job's status. The window never
deadlocks a job: when the sink's count stops moving for `STALL_SECONDS` (a restarted
sink counts its duplicates from zero; a cluster that lost rows resends them only after
ack_wait), the next chunk goes anyway, and the streams' own caps remain the bound.
"""

from __future__ import annotations

from dataclasses import dataclass

IN_FLIGHT_ROWS = 262_144
"""Rows a job may have sent and not yet seen written: ~20 s of work for the echo engine
at 13,000 rows/s, far more than the pipeline holds between the client and the sink, so a
full window never idles an engine."""
STALL_SECONDS = 30.0
"""Seconds without progress after which the next chunk is sent regardless."""


@dataclass
class Window:
    limit: int = IN_FLIGHT_ROWS
    sent: int = 0
    """Rows this client published for the job."""
    base: int | None = None
    """The sink's count (rows + duplicates) when this client started; lowered to any
    smaller count seen (a sink that restarted or replaced the output counts afresh)."""
    count: int = 0
    """The sink's latest count."""
    moved_at: float = 0.0
    """When the count last changed (or the window last let a chunk through a stall)."""

    def observe(self, count: int, now: float) -> None:
        """The sink's count (`rows + duplicates` of the job's status; 0 with no status)."""
        if self.base is None:
            self.base, self.moved_at = count, now
        elif count != self.count:
            self.moved_at = now
        self.base = min(self.base, count)
        self.count = count

    def in_flight(self) -> int:
        """Rows sent and not yet accounted for by the sink."""
        return max(0, self.sent - (self.count - (self.base or 0)))

    def may_send(self, rows: int, now: float) -> bool:
        """May a chunk of `rows` go now? Yes while the window has room for it (a chunk
        larger than the whole window goes once nothing is in flight), or when the count
        has not moved for `STALL_SECONDS` (that chunk restarts the stall clock)."""
        if self.in_flight() + rows <= self.limit or self.in_flight() == 0:
            return True
        if now - self.moved_at >= STALL_SECONDS:
            self.moved_at = now
            return True
        return False
