"""The engine-worker's window as the router sees it (`EngineStatus.window`): a worker whose
engine is still starting must not report its configured maximum, or the replica ready first
is offered that much work before it has run anything."""

from __future__ import annotations

import pytest

from prefixflow.services.engine_worker.engines.base import EngineStats
from prefixflow.services.engine_worker.service import EngineWorker
from prefixflow.services.engine_worker.window import START_WINDOW
from prefixflow.shared.process.config import EngineWorkerConfig

pytestmark = pytest.mark.unit


class Engine:
    adapters: list[str] = []
    lora_slots = 0

    def __init__(self) -> None:
        self.stats = EngineStats()

    def snapshot(self) -> EngineStats:
        return self.stats


def worker(engine: str = "vllm") -> tuple[EngineWorker, Engine]:
    w = EngineWorker(EngineWorkerConfig(engine=engine, window=256))
    w.engine = Engine()
    return w, w.engine


def test_a_starting_engine_keeps_the_start_window_until_it_runs_something():
    w, engine = worker()
    for _ in range(3):  # status ticks while vLLM loads: no KV cache reported yet
        w.adapt_window()
        assert w.status().window == START_WINDOW
    w.ready, engine.stats.kv_blocks = True, 80
    w.adapt_window()
    assert w.status().window == START_WINDOW  # nothing ran yet: nothing measured
    engine.stats.running = 20
    w.adapt_window()
    assert w.status().window == 40  # twice what it runs


def test_an_engine_without_a_kv_cache_keeps_the_configured_window():
    w, _ = worker("echo")
    w.ready = True
    w.adapt_window()
    assert w.status().window == 256
