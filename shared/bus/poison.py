"""Poison messages: a message that keeps failing is quarantined, never retried forever.

Every consumer checks a message's delivery count before working on it. Past
`POISON_AFTER` deliveries (each one a crash, a timeout or a nak), the message is copied
to the dead-letter stream (`pfx.dead.<subject>`, headers `Pfx-Error`, `Pfx-Deliveries`),
the prompts it carries come out as error rows so the job still completes, and the
message is terminated. The consumer's `max_deliver` is a backstop above this bound.
"""

from __future__ import annotations

from collections import defaultdict

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared.wire import messages as m
from shared.wire import subjects
from shared.bus.publish import publish

log = structlog.get_logger()

POISON_AFTER = 5
"""Deliveries after which a message is treated as poison."""


PRIOR_DELIVERIES = "Pfx-Prior-Deliveries"
"""Header: deliveries a message had before it was moved (failover re-routing)."""


def deliveries(msg: Msg) -> int:
    """Deliveries so far, including those before a failover moved the message."""
    try:
        n = msg.metadata.num_delivered
    except Exception:  # noqa: BLE001 - not a JetStream message
        n = 1
    try:
        return n + int((msg.headers or {}).get(PRIOR_DELIVERIES, 0))
    except ValueError:
        return n


def is_poison(msg: Msg) -> bool:
    return deliveries(msg) > POISON_AFTER


async def quarantine(js: JetStreamContext, msg: Msg, reason: str, rows: list[tuple[str, m.Result]] = ()) -> None:
    """Dead-letter `msg`, publish `rows` (job, error result) and terminate `msg`."""
    n = deliveries(msg)
    log.error("poison message quarantined", subject=msg.subject, deliveries=n, reason=reason, error_rows=len(rows))
    headers = {"Pfx-Error": f"poison after {n} deliveries: {reason}"[:512], "Pfx-Deliveries": str(n), "Pfx-Subject": msg.subject}
    await publish(js, subjects.dead(msg.subject), msg.data, headers=headers)
    by_job: dict[str, list[m.Result]] = defaultdict(list)
    for job, row in rows:
        by_job[job].append(row)
    for job, results in by_job.items():
        for run in m.chunked(results, m.result_size, 512):
            await publish(js, subjects.results(job), m.encode(m.ResultBatch(job, run)))
    await msg.term()


def error_rows(prompts: list[m.Prompt], why: str) -> list[tuple[str, m.Result]]:
    """Error rows for the prompts of a quarantined message."""
    return [
        (p.job, m.Result(p.id, p.columns, error=why, finish_reason=m.FinishReason.ERROR, prompt_tokens=len(p.tokens) // 4))
        for p in prompts
    ]
