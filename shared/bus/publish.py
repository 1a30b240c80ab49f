"""Publishing with the stream's ack, and acking inputs."""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import APIError

log = structlog.get_logger()


class PublishError(Exception):
    """JetStream did not accept a message after every retry."""


async def publish(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    *,
    headers: dict[str, str] | None = None,
    attempts: int = 40,
    timeout: float = 5.0,
) -> None:
    """Publish and wait for the stream's ack, backing off while the stream is full
    (discard=new) or the server is unreachable. This wait *is* the backpressure: the
    caller holds its input unacked meanwhile. Raises PublishError when out of attempts."""
    delay = 0.05
    for attempt in range(attempts):
        try:
            await js.publish(subject, payload, timeout=timeout, headers=headers)
            return
        except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError, APIError) as exc:
            if attempt == 0 or attempt % 10 == 9:
                log.warning("publish retry", subject=subject, attempt=attempt, error=repr(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
    raise PublishError(f"could not publish to {subject}")


async def ack_all(msgs) -> None:
    await asyncio.gather(*(m.ack() for m in msgs), return_exceptions=True)


