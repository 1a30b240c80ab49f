"""`stop_task` ends a task even when a cancel is lost (as `asyncio.wait_for` loses one on
Python 3.11 when the answer arrives with it): the batch API's runner waited forever on a
follower whose cancel was lost."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.shared.process.tasks import stop_task, stop_tasks
from tests.tiers import COSTLY


async def poller(lost: int, rounds: list[int]) -> None:
    """Polls forever; the first `lost` cancels it receives are lost (it goes on)."""
    while True:
        try:
            await asyncio.sleep(0.001)
        except asyncio.CancelledError:
            if lost > 0:
                lost -= 1
                continue
            raise
        rounds[0] += 1


@settings(COSTLY)  # each example runs an event loop
@given(st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_every_task_ends_however_many_cancels_it_loses(losses):
    async def main() -> None:
        counters = [[0] for _ in losses]
        tasks = [asyncio.create_task(poller(lost, c)) for lost, c in zip(losses, counters)]
        await asyncio.sleep(0.005)
        await asyncio.wait_for(stop_tasks(tasks, every=0.01), 5)
        assert all(t.done() for t in tasks)

    asyncio.run(main())


def test_a_plain_cancel_leaves_such_a_task_running():
    """The failure `stop_task` exists for: one cancel, lost, and the task runs on."""
    async def main() -> bool:
        counter = [0]
        task = asyncio.create_task(poller(1, counter))
        await asyncio.sleep(0.005)
        task.cancel()
        await asyncio.sleep(0.05)
        running = not task.done()
        await stop_task(task, every=0.01)
        return running

    assert asyncio.run(main())


def test_a_task_that_failed_is_stopped_without_raising():
    async def boom() -> None:
        raise ValueError("its own")

    async def main() -> None:
        task = asyncio.create_task(boom())
        await asyncio.sleep(0)
        await stop_task(task)
        assert isinstance(task.exception(), ValueError)

    asyncio.run(main())


pytestmark = pytest.mark.unit
