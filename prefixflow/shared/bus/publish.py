"""Publishing with the stream's ack, and acking inputs."""

from __future__ import annotations

import asyncio

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import APIError, NoStreamResponseError

from prefixflow.shared.process import metrics

log = structlog.get_logger()


class PublishError(Exception):
    """JetStream refused a message for good (it can never fit the stream), or it was not
    accepted within the caller's `attempts`. A real failure: the caller's input counts
    it toward poison."""


class MessageTooLarge(PublishError):
    """The message is over the server's `max_payload` or the stream's `max_msg_size`: it
    can never be published as it is. Batches are cut under `message_limit`, so this
    means one item alone is too large (the caller turns it into an error row or stores
    it by reference), or the limit shrank (a reconnect to a server with a smaller
    `max_payload`: the caller's input is handed back and cut again)."""


MESSAGE_TOO_LARGE = 10054
"""JetStream error code: the message exceeds the stream's max_msg_size (never retried)."""

HEADROOM = 4096
"""Bytes of a message kept free for the subject, headers and protocol framing. (The
server counts headers in `max_payload`, nats.py checks only the payload; a message over
the server's limit costs the connection.)"""


def message_limit(conn: Client | JetStreamContext | None, max_msg_size: int = 8 * 1024 * 1024) -> int:
    """Most bytes of payload to put in one message: the server's `max_payload`, asked of
    the connection each time (never assumed; it can change on a reconnect), and the
    stream's `max_msg_size`, less `HEADROOM`. Without a connection (unit tests' fakes):
    the stream's limit only."""
    # NOTE: nats.py keeps a JetStream context's connection in `_nc` (no public accessor).
    nc = getattr(conn, "_nc", conn)
    max_payload = getattr(nc, "max_payload", None)
    limit = min(max_payload, max_msg_size) if isinstance(max_payload, int) and max_payload > 0 else max_msg_size
    return max(limit - HEADROOM, 1024)


def _headers_size(headers: dict[str, str] | None) -> int:
    """Bytes of `headers` on the wire ("NATS/1.0\r\n", "key: value\r\n" each, "\r\n")."""
    if not headers:
        return 0
    return 12 + sum(len(k.encode()) + len(str(v).encode()) + 4 for k, v in headers.items())


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
    error rows under load); only a message the stream can never take raises
    (`MessageTooLarge`, never nats.py's `MaxPayloadError`: callers cut batches under
    `message_limit`), and with `attempts` set (clients that want to give up) running out
    of them does (`PublishError`)."""
    delay = 0.05
    attempt = 0
    while True:
        try:
            # NOTE: checked here, headers included: the server counts them in max_payload
            # and answers an oversized message by closing the connection.
            limit = getattr(getattr(js, "_nc", None), "max_payload", None)
            if isinstance(limit, int) and len(payload) + _headers_size(headers) > limit:
                raise MessageTooLarge(f"{subject}: {len(payload)} bytes is over the server's max_payload {limit}")
            await js.publish(subject, payload, timeout=timeout, headers=headers)
            return
        except APIError as exc:
            if exc.err_code == MESSAGE_TOO_LARGE:
                raise MessageTooLarge(f"{subject}: {exc.description}") from exc
            error = exc
        except nats.errors.MaxPayloadError as exc:
            raise MessageTooLarge(f"{subject}: {len(payload)} bytes is over the server's max_payload") from exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.NoRespondersError, NoStreamResponseError,
                nats.errors.OutboundBufferLimitError) as exc:
            # NOTE: NoStreamResponseError: the stream has no leader for a moment (on a
            # cluster, the server that led it just died and the others are electing one).
            # OutboundBufferLimitError: reconnecting, and nats.py's buffer for that is
            # full; the connection comes back (or the service is stopping): wait.
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


