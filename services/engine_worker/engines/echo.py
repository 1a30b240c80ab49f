"""The `echo` engine: no model, for measuring the orchestration and for fast tests."""

from __future__ import annotations

import asyncio

from services.engine_worker.engines.base import Completion, EngineStats
from shared.wire.messages import FinishReason, PromptId, SamplingSpec


class EchoEngine:
    """No model: the output is the prompt's last few token ids as text. For measuring
    the orchestration and for fast tests; `delay` seconds per prompt simulate work."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.stats = EngineStats(block_size=128)
        self.running = 0

    async def start(self) -> None:
        return None

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0
    ) -> Completion:
        self.running += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            out = tokens[-min(len(tokens), sampling.max_tokens) :]
            return Completion(" ".join(map(str, out)), FinishReason.LENGTH, len(tokens), 0, len(out))
        finally:
            self.running -= 1

    def snapshot(self) -> EngineStats:
        self.stats.running = self.running
        return self.stats

    async def reset_prefix_cache(self) -> bool:
        return True

    async def shutdown(self) -> None:
        return None
