"""Poison messages: a message that keeps failing is quarantined, never retried forever.

Every consumer checks a message's delivery count before working on it. Past
`POISON_AFTER` deliveries, the message is copied to the dead-letter stream
(`pfx.dead.<subject>`, headers `Pfx-Error`, `Pfx-Deliveries`), the prompts it carries
come out as error rows so the job still completes, and the message is terminated.

The engine-worker counts per prompt, not per message: an engine death re-publishes the
work it held (`prefixflow/services/engine_worker/isolate.py`: suspects bisected and run alone), so
its messages gain no deliveries; a work message past `POISON_AFTER` (its holder process
itself kept dying) is split the same way, and only a prompt that killed the engine alone
`isolate.STRIKES` times is dead-lettered (as a one-prompt work batch) and an error row.

Only real failures may cause a redelivery: a crash of the holder, a decode, engine or
write error (nak). Backpressure never does: a full stream makes the publisher wait
(`prefixflow/shared/bus/publish.py`), a message waiting for room stays leased (`in_progress`), and
failover fetches a dead replica's work only when a live one has room. So healthy prompts
never reach the limit however loaded the cluster is.
"""

from __future__ import annotations

from collections import defaultdict

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.bus.publish import message_limit, publish
from prefixflow.shared.process import metrics

log = structlog.get_logger()

POISON_AFTER = 5
"""Deliveries after which a message is treated as poison."""


PRIOR_DELIVERIES = "Pfx-Prior-Deliveries"
"""Header: failed deliveries a message had before failover moved it to another replica
(the failover's own delivery is not counted: moving is not failing)."""


def deliveries(msg: Msg) -> int:
    """Deliveries so far, including those before a failover moved the message."""
    n = msg.metadata.num_delivered
    try:
        return n + int((msg.headers or {}).get(PRIOR_DELIVERIES, 0))
    except ValueError:
        return n


def is_poison(msg: Msg) -> bool:
    return deliveries(msg) > POISON_AFTER


def moved_headers(msg: Msg) -> dict[str, str]:
    """Headers for a copy of `msg` that failover publishes elsewhere: the failed
    deliveries so far travel with it (the current one, failover's own, is not one)."""
    return {PRIOR_DELIVERIES: str(max(deliveries(msg) - 1, 0))}


async def dead_letter(js: JetStreamContext, msg: Msg, reason: str, *, data: bytes | None = None, part: str = "",
                      refused: bool = False) -> None:
    """Copy `msg` to the dead-letter stream with why (the caller ends the original).
    `data`, `part`: dead-letter only this part of it (the engine-worker's culprit prompt,
    as a one-prompt work batch; `part` names it), with `reason` as the whole error.
    `refused`: refused on sight (an invalid job id), not failed: `reason` is the whole
    error, no poison count."""
    n = deliveries(msg)
    log.error("message refused" if refused else "poison message quarantined", subject=msg.subject, deliveries=n,
              reason=reason, part=part or None)
    error = reason if part or refused else f"poison after {n} deliveries: {reason}"
    headers = {"Pfx-Error": error[:512], "Pfx-Deliveries": str(n), "Pfx-Subject": msg.subject}
    # The same message dead-lettered again (its holder crashed before ending it): one copy.
    meta = msg.metadata
    headers["Nats-Msg-Id"] = f"dead:{meta.stream}:{meta.sequence.stream}" + (f":{part}" if part else "")
    data = dead_payload(js, msg.data if data is None else data, headers)
    await publish(js, subjects.dead(msg.subject), data, headers=headers)
    metrics.DEAD_LETTERS.labels(metrics.stream_of(msg.subject)).inc()


async def reject(js: JetStreamContext, msg: Msg, reason: str) -> None:
    """Dead-letter `msg` with `reason` (refused on sight: a job id outside the grammar,
    `subjects.job_id_error`) and terminate it: never retried, never an error row (there is
    no valid job to write one for)."""
    await dead_letter(js, msg, reason, refused=True)
    await msg.term()


def dead_payload(js: JetStreamContext, data: bytes | None, headers: dict[str, str]) -> bytes:
    """`data` for the dead-letter stream, cut to what fits a message beside our headers: a
    foreign message may have used the whole `max_payload` (header `Pfx-Truncated`: its
    original size)."""
    data = data or b""
    limit = message_limit(js, subjects.DEAD_STREAM.max_msg_size)
    if len(data) > limit:
        headers["Pfx-Truncated"] = str(len(data))
        data = data[:limit]
    return data


async def quarantine(
    js: JetStreamContext, msg: Msg, reason: str, rows: list[tuple[str, m.Result]] = (), *, origin: str = ""
) -> None:
    """Dead-letter `msg`, publish `rows` (job, error result) as results of `origin` (the
    caller's: `subjects.results`) and terminate `msg`."""
    assert origin or not rows, "error rows need the origin they are published under"
    await dead_letter(js, msg, reason)
    by_job: dict[str, list[m.Result]] = defaultdict(list)
    for job, row in rows:
        by_job[job].append(row)
    limit = message_limit(js, subjects.RESULTS_STREAM.max_msg_size)
    for job, results in by_job.items():
        for batch in m.encode_batches(results, lambda run, job=job: m.ResultBatch(job, run), limit, 512):
            await publish(js, subjects.results(origin, job), batch.data)
    await msg.term()


def error_rows(prompts: list[m.Prompt], why: str) -> list[tuple[str, m.Result]]:
    """Error rows for the prompts of a quarantined message."""
    return [(p.job, m.error_result(p.id, why, prompt_tokens=p.prompt_tokens, src=p.src, row=p.row, grant=p.grant))
            for p in prompts]
