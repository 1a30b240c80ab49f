"""An event loop of the API's own, on a daemon thread: where a `Client`'s coroutines run.

The sync methods hand their coroutine to this loop and wait for its result on the calling
thread; the async ones (`submit_async`, `wait_async`, ...) await the same future without
blocking their loop. So the API never calls `asyncio.run` on a running loop: a Jupyter
notebook (whose loop runs on the main thread), a script, and an `async def` pipeline all
use it the same way, and the `Client`'s NATS connection lives on one loop for its life.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

STOP_TIMEOUT = 10.0
"""Seconds `close` waits for the loop's tasks to finish cancelling."""


def in_running_loop() -> bool:
    """Whether this thread runs an event loop now (a notebook, an `async def`)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Portal:
    """A daemon thread running an event loop (see the module docstring)."""

    def __init__(self, name: str = "prefixflow-api") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def start(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run `coro` on the loop; its future."""
        if not self.thread.is_alive():
            coro.close()
            raise RuntimeError("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """`coro`'s result, waited for on this thread (`TimeoutError` after `timeout` s; the
        coroutine is cancelled then)."""
        future = self.start(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout} s") from None

    async def call_async(self, coro: Coroutine[Any, Any, T]) -> T:
        """`coro`'s result, awaited from another loop."""
        return await asyncio.wrap_future(self.start(coro))

    def close(self) -> None:
        """Cancel what still runs on the loop, stop it and its thread (idempotent)."""
        if not self.thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(STOP_TIMEOUT)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # NOTE: a task that does not end on cancel: the daemon thread goes with the process
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STOP_TIMEOUT)
        if not self.thread.is_alive():
            self.loop.close()
