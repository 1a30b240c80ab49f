"""The engine-worker's rebuild budget and the echo engine's crash knob, as pure logic
(moved from tests/nats/test_engine_recovery.py, whose other tests start clusters)."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.services.engine_worker.engines.base import EngineDead
from prefixflow.services.engine_worker.engines.echo import EchoEngine, InstantEchoEngine
from prefixflow.services.engine_worker.rebuild import RebuildBudget
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def test_rebuild_budget_backs_off_and_runs_out_within_its_window():
    budget = RebuildBudget(limit=3, window=60.0, backoff=1.0)
    assert [budget.next_delay(t) for t in (0.0, 1.0, 2.0)] == [1.0, 2.0, 4.0]
    assert budget.next_delay(3.0) is None, "a fourth rebuild within the window: give up"
    assert budget.next_delay(60.5) == 4.0, "the first attempt left the window"
    assert RebuildBudget(limit=0, window=60.0, backoff=1.0).next_delay(0.0) is None


def test_echo_engine_dies_like_a_vllm_core_and_is_rebuilt():
    sampling = m.SamplingSpec(max_tokens=2)

    async def go() -> None:
        engine = EchoEngine(0.05, crash_after=2)
        await engine.start()
        first = [asyncio.create_task(engine.generate(str(i), i, [1, 2, 3], sampling)) for i in range(2)]
        await asyncio.sleep(0.01)
        with pytest.raises(EngineDead):  # the third prompt kills it...
            await engine.generate("2", 2, [1, 2, 3], sampling)
        for t in first:  # ...and the requests in flight die with it
            with pytest.raises(EngineDead):
                await t
        assert not engine.alive()
        with pytest.raises(EngineDead):
            await engine.reset_prefix_cache()
        await engine.shutdown()
        await engine.start()
        assert engine.alive()
        assert (await engine.generate("3", 3, [1, 2, 3], sampling)).output == "2 3", "dies only once"

        instant = InstantEchoEngine(crash_token=7)
        await instant.start()
        done = await instant.generate_batch([(tk.pack([1, 2, 3]), sampling)])
        assert done[0].output == "2 tokens" and done[0].prompt_tokens == 3
        with pytest.raises(EngineDead):
            await instant.generate_batch([(tk.pack([1, 2]), sampling), (tk.pack([5, 7]), sampling)])
        assert not instant.alive()

    asyncio.run(go())
