"""Connecting to NATS (retry until the server is up, then reconnect forever) and closing.

`url` may list several servers, comma separated: nats.py fails over between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import nats
import structlog
from nats.aio.client import Client

log = structlog.get_logger()


async def connect(
    url: str,
    name: str,
    *,
    wait: float = 120.0,
    on_reconnect: Callable[[], Awaitable[None] | None] | None = None,
) -> Client:
    """Connect, retrying for up to `wait` seconds until the server is up (services may
    start before nats-server); once connected, reconnect forever. `on_reconnect` runs
    after every reconnect (the router uses it: silence during an outage is not death)."""

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def reconnected() -> None:
        log.info("nats reconnected")
        if on_reconnect is not None:
            result = on_reconnect()
            if asyncio.iscoroutine(result):
                await result

    async def on_error(exc: Exception) -> None:
        log.debug("nats error", error=repr(exc))

    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await nats.connect(
                servers=url.split(","),
                name=name,
                connect_timeout=2,
                reconnect_time_wait=0.5,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                disconnected_cb=on_disconnect,
                reconnected_cb=reconnected,
                error_cb=on_error,
            )
        except (OSError, nats.errors.NoServersError, asyncio.TimeoutError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.info("waiting for nats-server", url=url, error=repr(exc))
            await asyncio.sleep(0.5)


async def close(nc: Client, *subs) -> None:
    """Unsubscribe pull subscriptions, then drain. (nats.py's drain waits its full
    timeout on an open pull subscription, which would blow the 5 s stop window.)"""
    for sub in subs:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - already closed
            pass
    try:
        await asyncio.wait_for(nc.drain(), 2.0)
    except Exception:  # noqa: BLE001 - drain timed out or connection gone: just close
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - nothing left to close
            pass


