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


def test_without_probing_the_window_sizes_by_next_window_alone():
    """`Window(probing=False)` (the simulator's GPU fleets): work after a quiet spell starts
    at the full window, no probe; the size still follows the engine (`next_window`), as
    with the probe once it has ended."""
    from prefixflow.services.engine_worker.window import PROBE_SIZE, Window, next_window

    probing, plain = Window(512), Window(512, probing=False)
    for w in (probing, plain):
        w.work_arrives(0.0, 0, 16, 0)
    assert probing.limit == PROBE_SIZE and probing.probes == 1
    assert plain.limit == START_WINDOW and plain.probes == 0 and plain.probe_since is None
    plain.observe(1.0, kv_blocks=1000, running=100, generated=50, inflight=64)
    assert plain.limit == next_window(START_WINDOW, 512, 1000, 100, 0)[0] == 200
    plain.completed(2.0)
    plain.work_arrives(100.0, 0, 16, 60)  # long idle: still no probe
    assert plain.probe_since is None and plain.limit == 200
