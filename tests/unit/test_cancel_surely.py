"""`cancel_surely`: a task that drops a cancellation (as nats.py's connect loop does when
Python 3.11's `wait_for` loses one to a refused connection) still ends, so a service told
to stop while its nats-server is not up exits (tests/nats/test_supervision.py)."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.shared.bus import connection
from prefixflow.shared.bus.connection import cancel_surely


def retrying_loop(drops: int, swallowed: list[int]):
    """A loop that swallows its first `drops` cancellations and goes on retrying."""

    async def loop() -> None:
        while True:
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if len(swallowed) >= drops:
                    raise
                swallowed.append(1)

    return loop()


@pytest.mark.parametrize("drops", [0, 1, 3])
def test_a_task_that_drops_cancellations_still_ends(drops, monkeypatch):
    monkeypatch.setattr(connection, "CANCEL_AGAIN_EVERY", 0.05)

    async def go() -> tuple[bool, int]:
        swallowed: list[int] = []
        task = asyncio.ensure_future(retrying_loop(drops, swallowed))
        await asyncio.sleep(0.05)
        await asyncio.wait_for(cancel_surely(task), 5)
        return task.cancelled(), len(swallowed)

    cancelled, swallowed = asyncio.run(go())
    assert cancelled and swallowed == drops


def test_one_plain_cancel_is_not_enough_for_such_a_task():
    """What the helper is for: a single cancel of the same task leaves it running."""

    async def go() -> bool:
        task = asyncio.ensure_future(retrying_loop(1, []))
        await asyncio.sleep(0.05)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.3)
        running = not done
        await cancel_surely(task)
        return running

    assert asyncio.run(go())


def test_a_task_that_ended_with_an_error_is_left_as_it_is():
    async def go() -> None:
        async def fails() -> None:
            raise OSError("refused")

        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        await cancel_surely(task)
        assert isinstance(task.exception(), OSError)

    asyncio.run(go())
