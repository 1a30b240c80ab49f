"""What a job in progress waits on (`prefixflow status`): its rows in the engines, from
the engine-workers' statuses (`EngineStatus.oldest`: per job, how many rows are in the
engine and the ids of those admitted first), so a job whose last rows are stuck says
which instead of waiting silently (docs/limits.md)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec

from prefixflow.client.fmt import fmt_duration
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

STATUS_LISTEN = 1.0
"""Seconds `status` listens to the engines' statuses for a job in progress (several each)."""
TAIL_ROWS = 16
"""A job in progress with at most this many rows left is in its tail: `status` names them."""
STUCK_SECONDS = 60.0
"""A row this long in an engine is named by `status` whatever the job's rows left."""


@dataclass
class Waiting:
    """The rows a job in progress waits on, from the engines' statuses (`EngineStatus.oldest`)."""

    rows: int | None
    """Rows not written yet (None: the job is not sealed, its total unknown)."""
    in_engines: int = 0
    """Of them, rows in an engine now."""
    ids: list[m.PromptId] = field(default_factory=list)
    """Some of those, the longest in an engine first (`m.OLDEST_IDS` per replica)."""
    oldest_seconds: float | None = None
    """How long ago the oldest of them was first admitted to an engine."""
    replica: str = ""
    """The replica holding it."""

    def stuck(self) -> bool:
        """Worth saying: the job's tail (few rows left), or a row long in an engine."""
        return (self.rows is not None and 0 < self.rows <= TAIL_ROWS) or (self.oldest_seconds or 0.0) >= STUCK_SECONDS

    def line(self, job: str) -> str:
        left = "?" if self.rows is None else str(self.rows)
        if not self.in_engines:
            return f"{job}: waiting on {left} rows, none in an engine (still being ingested, bucketed or routed)"
        shown = ", ".join(map(repr, self.ids)) + (", ..." if self.in_engines > len(self.ids) else "")
        text = (f"{job}: waiting on {left} rows: {self.in_engines} in engines (ids {shown}), the oldest admitted "
                f"{fmt_duration(self.oldest_seconds)} ago on replica {self.replica}")
        if self.rows is not None and self.rows > self.in_engines:
            text += f"; {self.rows - self.in_engines} not in an engine yet"
        return text


def waiting_on(job: str, rows: int, total: int | None, statuses: list[m.EngineStatus], now: float) -> Waiting:
    """What `job` (`rows` written of `total`; None: not sealed) waits on, from the latest
    status of each live replica."""
    left = None if total is None else max(total - rows, 0)
    waiting = Waiting(left)
    found = sorted(((row.admitted_at, st.replica, row) for st in statuses for row in st.oldest if row.job == job),
                   key=lambda found: found[0])
    for admitted, replica, row in found:
        waiting.in_engines += row.count
        waiting.ids += row.ids
        if waiting.oldest_seconds is None:
            waiting.oldest_seconds, waiting.replica = max(now - admitted, 0.0), replica
    return waiting


async def engine_statuses(nc, seconds: float = STATUS_LISTEN) -> list[m.EngineStatus]:
    """The latest status of each replica heard within `seconds` (they publish several a second)."""
    latest: dict[str, m.EngineStatus] = {}

    async def on_status(msg) -> None:
        try:
            st = m.engine_status_decoder.decode(msg.data)
        except msgspec.DecodeError:
            return
        latest[st.replica] = st

    sub = await nc.subscribe(subjects.ALL_STATUS, cb=on_status)
    try:
        await asyncio.sleep(seconds)
    finally:
        await sub.unsubscribe()
    return list(latest.values())
