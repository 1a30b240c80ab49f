"""Publishing with the stream's ack, and acking inputs."""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from shared.process import metrics

log = structlog.get_logger()


class PublishError(Exception):
    """JetStream refused a message for good (it can never fit the stream), or it was not
    accepted within the caller's `attempts`. A real failure: the caller's input counts
    it toward poison."""


MESSAGE_TOO_LARGE = 10054
"""JetStream error code: the message exceeds the stream's max_msg_size (never retried)."""


async def publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    headers: dict[str, str] | None = None,
    attempts: int | None = None,
    timeout: float = 5.0,
) -> None:
    """Publish and wait for the stream's ack, backing off while the stream is full
    (discard=new) or the server is unreachable. This wait *is* the backpressure: the
    caller holds its input unacked (and leased) meanwhile, for as long as it takes.

    NOTE: backpressure is not failure. A full stream or a server restart never turns
    into a nak here (a nak would count toward the poison limit and make healthy prompts
    error rows under load); only a message the stream can never take raises, and with
    `attempts` set (clients that want to give up) running out of them does."""
    delay = 0.05
    attempt = 0
    while True:
        try:
            await js.publish(subject, payload, timeout=timeout, headers=headers)
            return
        except APIError as exc:
            if exc.err_code == MESSAGE_TOO_LARGE:
                raise PublishError(f"{subject}: {exc.description}") from exc
            error = exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError, NoStreamResponseError) as exc:
            # NOTE: NoStreamResponseError: the stream has no leader for a moment (on a
            # cluster, the server that led it just died and the others are electing one).
            error = exc
        metrics.PUBLISH_WAITS.labels(metrics.stream_of(subject)).inc()
        if attempt == 0 or attempt % 20 == 19:
            log.warning("publish waiting (stream full or server away)", subject=subject, attempt=attempt, error=repr(error))
        attempt += 1
        if attempts is not None and attempt >= attempts:
            raise PublishError(f"could not publish to {subject} after {attempts} attempts")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 2.0)


async def ack_all(msgs) -> None:
    await asyncio.gather(*(m.ack() for m in msgs), return_exceptions=True)


