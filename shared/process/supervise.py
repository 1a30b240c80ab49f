"""Running a service process: uvloop, signals, and one supervisor for its tasks."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable

import structlog
import uvloop

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


