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

from prefixflow.shared.bus.connection import SHUTDOWN, StoppedWhileConnecting
from prefixflow.shared.outcomes import Exit

log = structlog.get_logger()

EXIT_FAILED = Exit.FAILED
"""Exit code of a service that stopped on an unexpected error."""


def await_chain(coro, limit: int = 24) -> list[str]:
    """Where a suspended coroutine waits: its frame, the frame of what it awaits, and so
    on down (`cr_await`), as "file:line function"."""
    where = []
    while coro is not None and len(where) < limit:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) or getattr(coro, "ag_frame", None)
        if frame is None:
            where.append(type(coro).__name__)  # a future or a task awaited
            break
        where.append(f"{frame.f_code.co_filename.rsplit('/', 2)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) or getattr(coro, "ag_await", None)
    return where


def log_tasks() -> None:
    """SIGUSR1: log where each of the process's tasks waits (`kill -USR1 PID`: a service
    that seems stuck says on what)."""
    for task in asyncio.all_tasks():
        log.warning("task", name=task.get_name(), waits=await_chain(task.get_coro()))


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
        loop.add_signal_handler(signal.SIGUSR1, log_tasks)
        SHUTDOWN.set(stop)  # a stop while NATS is not up yet ends the service's connect wait
        try:
            await main(stop)
        except StoppedWhileConnecting as exc:
            log.info("stopped before connecting", reason=str(exc))
        log.info("stopped", shutdown_seconds=round(time.monotonic() - signalled[0], 2) if signalled else None)

    try:
        uvloop.run(runner())
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - Exception, ExceptionGroup, KeyboardInterrupt
        log.error("service failed: exiting for its supervisor to restart it", error=repr(exc), exc_info=exc)
        sys.exit(EXIT_FAILED)
