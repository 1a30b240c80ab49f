"""Which ids of an input chunk are on disk already: `DoneQuery` requests to the sink, so
a resume sends only what is missing (`prefixflow/client/submit.py`)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import nats.errors

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.bus.publish import message_limit

DONE_QUERY_TIMEOUT = 5.0
"""Seconds a done query waits for the sink's answer (then the chunk's rows are sent)."""
DONE_QUERY_FAILURES = 2
"""Consecutive unanswered done queries after which a resume stops asking (a sink that
does not answer them): every remaining row is sent, and the sink drops duplicates."""

done_reply_decoder = msgspec.msgpack.Decoder(m.DoneReply)


class DoneQueries:
    """Resume: which rows of a chunk the sink has written already (`DoneQuery` on
    `subjects.done_query(job)`). A query not answered (timeout, no sink listening, an
    error reply) sends the chunk's rows as they are (the sink drops duplicates); after
    `DONE_QUERY_FAILURES` in a row it stops asking. No sink listening yet (a cluster just
    started: the sink subscribes after it is up) is asked again for `wait_for_sink` seconds
    first, so a job resumed at once does not recompute its finished rows."""

    def __init__(self, nc, job: str, *, timeout: float = DONE_QUERY_TIMEOUT,
                 wait_for_sink: float = DONE_QUERY_TIMEOUT) -> None:
        self.nc, self.job, self.timeout = nc, job, timeout
        self.wait_for_sink = wait_for_sink
        self.failures = 0
        self.problem: str | None = None
        """Why the last query went unanswered."""
        self.none_done = False
        """The sink said no row of the job was on disk: later chunks need no query."""

    async def missing(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.failures >= DONE_QUERY_FAILURES or self.none_done or not rows:
            return rows
        try:
            done = await self._ask_when_listened([r["id"] for r in rows])
        except (nats.errors.Error, asyncio.TimeoutError, msgspec.DecodeError, ValueError) as exc:
            self.failures += 1
            self.problem = str(exc) or type(exc).__name__
            return rows
        self.failures = 0
        return [r for r, d in zip(rows, done) if not d]

    async def _ask_when_listened(self, ids: list[Any]) -> list[bool]:
        """`_ask`, again while no sink listens, for `wait_for_sink` seconds (the first time)."""
        deadline = time.monotonic() + self.wait_for_sink
        while True:
            try:
                return await self._ask(ids)
            except nats.errors.NoRespondersError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
            finally:
                self.wait_for_sink = 0.0  # only a cluster that just started is waited for

    async def _ask(self, ids: list[Any]) -> list[bool]:
        data = m.encode(m.DoneQuery(ids))
        if len(data) > message_limit(self.nc) and len(ids) > 1:  # long string ids: ask in halves
            half = len(ids) // 2
            return await self._ask(ids[:half]) + await self._ask(ids[half:])
        reply = done_reply_decoder.decode((await self.nc.request(subjects.done_query(self.job), data, timeout=self.timeout)).data)
        if reply.error is not None:
            raise ValueError(f"the sink cannot tell: {reply.error}")
        if len(reply.done) != len(ids):
            raise ValueError(f"the sink answered {len(reply.done)} of {len(ids)} ids")
        self.none_done = reply.on_disk == 0
        return reply.done
