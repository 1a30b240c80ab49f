"""Process plumbing shared by the services: uvloop, signals, fetch and publish helpers."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import nats.errors
import structlog
import uvloop
from nats.js import JetStreamContext
from nats.js.errors import APIError

log = structlog.get_logger()


def run_service(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Run `main(stop)` on uvloop; SIGTERM / SIGINT set `stop` (the service then stops
    fetching, finishes or hands back its in-flight work, drains NATS and returns)."""

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        signalled: list[float] = []

        def on_signal(sig: signal.Signals) -> None:
            log.info("stopping", signal=sig.name)
            signalled.append(time.monotonic())
            stop.set()

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        await main(stop)
        log.info("stopped", shutdown_seconds=round(time.monotonic() - signalled[0], 2) if signalled else None)

    uvloop.run(runner())


async def fetch(sub: JetStreamContext.PullSubscription, batch: int, timeout: float) -> list:
    """Pull up to `batch` messages; [] when none arrived within `timeout`.

    NOTE: nats.py's `fetch(batch, timeout)`, once a long poll delivers its first message,
    waits out the rest of `timeout` for the remaining batch, adding up to `timeout` of
    latency at every stage whenever a burst starts. So: long-poll for one message, then
    take whatever else is already there (a no-wait drain)."""
    try:
        msgs = await sub.fetch(1, timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []
    if batch > 1:
        # When nothing else is there this still polls for DRAIN_WAIT: keep it tiny, as a
        # stage that keeps up with its input pays it on every message.
        try:
            msgs += await sub.fetch(batch - 1, timeout=DRAIN_WAIT)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            pass
    return msgs


DRAIN_WAIT = 0.002


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


async def keep_in_progress(msgs_fn: Callable[[], list], interval: float, stop: asyncio.Event) -> None:
    """Tell the server every `interval` seconds that the messages from `msgs_fn()` are
    still being worked on, so a long generation is not redelivered elsewhere."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
        for m in list(msgs_fn()):
            try:
                await m.in_progress()
            except Exception:  # noqa: BLE001 - connection blips: the next round retries
                pass
