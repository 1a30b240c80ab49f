"""Running a service process: uvloop, signals, and an exit code its supervisor can act on.

A service's `run(stop)` runs its loops under one `asyncio.TaskGroup`, so a task that
dies with an unexpected exception cancels the others and the exception reaches here:
the process then logs it and exits with code 1. Its supervisor (systemd, `prefixflow
run`) restarts it and JetStream redelivers whatever it held unacked. Nothing is left
leased by a task that died quietly.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from collections.abc import Awaitable, Callable

import structlog
import uvloop

from prefixflow.shared.outcomes import Exit

log = structlog.get_logger()

EXIT_FAILED = Exit.FAILED
"""Exit code of a service that stopped on an unexpected error."""


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

    try:
        uvloop.run(runner())
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - Exception, ExceptionGroup, KeyboardInterrupt
        log.error("service failed: exiting for its supervisor to restart it", error=repr(exc), exc_info=exc)
        sys.exit(EXIT_FAILED)
