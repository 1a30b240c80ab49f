"""Done queries: which ids of a job are on disk already (`subjects.done_query(job)`,
msgpack `DoneQuery` -> `DoneReply`). A client resuming a job asks in chunks of a few
thousand ids and sends only the rows still missing.

The answer comes from the job's dedupe set (its ids on disk, read back from the parts
when the job is opened); ids queued for the next part are not on disk yet and answer
False. A job not open is opened from disk in a thread, bound like any other (a job
refused over its out_dir, or failed opening it, answers with the reason). A query for a
job id outside the grammar (`subjects.job_id_error`) answers with the reason, and any
failure answering becomes an error reply: a query never stops the sink. Queries are
answered one at a time, the ids checked in slices so the event loop never stalls on a
large chunk.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.ids import IdSet

if TYPE_CHECKING:
    from prefixflow.services.sink.writer import JobOutput

log = structlog.get_logger()

SLICE = 4096
"""Ids checked between two yields to the event loop."""
UNKNOWN_JOB = "unknown job"



class Outputs(Protocol):
    """What answering needs of the sink (`prefixflow/services/sink/service.py`, `Sink`)."""

    refused: Mapping[str, str]
    jobs: JobCache

    async def output(self, job: str, *, evict: bool = True) -> JobOutput | None: ...


query_decoder = msgspec.msgpack.Decoder(m.DoneQuery)
reply_encoder = msgspec.msgpack.Encoder()


async def done_flags(out: JobOutput, ids: list[int | str]) -> list[bool]:
    """done[i]: ids[i] is in a part on disk (taken and not merely queued)."""
    queued = IdSet()
    queued.update(r.id for r, _ in out.pending)  # at most one part's worth of rows
    seen = out.seen
    done: list[bool] = []
    for start in range(0, len(ids), SLICE):
        if start:
            await asyncio.sleep(0)
        done.extend(i in seen and i not in queued for i in ids[start : start + SLICE])
    return done


async def reply_for(sink: Outputs, job: str, data: bytes) -> m.DoneReply:
    if (why := subjects.job_id_error(job)) is not None:
        return m.DoneReply(error=why)
    try:
        query = query_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        return m.DoneReply(error=f"bad done query: {exc}")
    if job in sink.refused:
        return m.DoneReply(error=sink.refused[job])
    lookup = await sink.jobs.get(job)
    if not lookup.exists:
        return m.DoneReply(error=UNKNOWN_JOB)
    if lookup.spec is None:
        return m.DoneReply(error=lookup.error or UNKNOWN_JOB)
    try:
        out = await sink.output(job, evict=False)  # a fault of the job's own fails it there (None)
    except Exception as exc:  # noqa: BLE001 - the query boundary: a resource or NATS fault; the client sends every row
        log.warning("done query: job output unavailable", job=job, error=repr(exc))
        return m.DoneReply(error=f"output unavailable: {exc}")
    if out is None:
        return m.DoneReply(error=sink.refused.get(job) or UNKNOWN_JOB)
    return m.DoneReply(done=await done_flags(out, query.ids), on_disk=out.rows)


async def answer(sink: Outputs, sub: Subscription, stop: asyncio.Event) -> None:
    """Answer done queries until `stop`."""
    answered = 0
    while not stop.is_set():
        try:
            msg: Msg = await sub.next_msg(timeout=0.5)
        except nats.errors.TimeoutError:
            continue
        except nats.errors.ConnectionClosedError:
            return
        job = subjects.job_of_done_query(msg.subject)
        try:
            reply = await reply_for(sink, job, msg.data)
        except Exception as exc:  # noqa: BLE001 - the query boundary: one bad query never stops the sink
            log.exception("done query failed", job=job)
            reply = m.DoneReply(error=f"done query failed: {type(exc).__name__}: {exc}")
        if not msg.reply:
            continue
        try:
            await msg.respond(reply_encoder.encode(reply))
        except nats.errors.Error as exc:  # the asker gave up or the connection is away: it asks again
            log.warning("done query reply failed", job=job, error=repr(exc))
            continue
        answered += 1
        if reply.error:
            log.info("done query refused", job=job, error=reply.error)
        elif answered % 1000 == 1:
            log.debug("done queries answered", job=job, answered=answered)
