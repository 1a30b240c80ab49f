"""Stopping a task for sure.

On Python 3.11, `asyncio.wait_for` (nats.py waits for every request's answer with it)
drops a cancel that arrives just as its answer does (CPython gh-86296, fixed in 3.12): the
cancelled task goes on as if nothing happened. A polling loop that only ends when it is
cancelled then runs forever, and whoever awaits it waits forever (the batch API's runner
did: a batch whose job was done stayed `in_progress` until the API restarted)."""

from __future__ import annotations

import asyncio

CANCEL_AGAIN_SECONDS = 0.5
"""How often a task not ended yet is cancelled again."""


async def stop_task(task: asyncio.Task, every: float = CANCEL_AGAIN_SECONDS) -> None:
    """Cancel `task` until it has ended (again every `every` seconds) and wait for it; its
    own exception, if any, is not raised here."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=every)
    if not task.cancelled():
        task.exception()  # retrieved: not logged as "never retrieved"


async def stop_tasks(tasks, every: float = CANCEL_AGAIN_SECONDS) -> None:
    """`stop_task` for each of `tasks`, together."""
    await asyncio.gather(*(stop_task(t, every) for t in list(tasks)))
