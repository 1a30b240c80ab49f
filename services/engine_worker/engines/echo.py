"""The `echo` engines: no model, for measuring the orchestration and for fast tests.

Faults are simulated here, never in the worker: the engine dies like a dead vLLM engine
core (`EngineDead` for the request that hit it and for every request then in flight,
until `shutdown()` and `start()` rebuild it) on a prompt holding `crash_token`, and once
after `crash_after` prompts.
"""

from __future__ import annotations

import asyncio

from services.engine_worker.engines.base import Completion, EngineDead, EngineStats
from shared.prefix import tokens as tk
from shared.wire.messages import FinishReason, PromptId, SamplingSpec


class EchoEngine:
    """No model: the output is the prompt's last few token ids as text; `delay` seconds
    per prompt simulate work (a task per prompt, as with vLLM)."""

    def __init__(self, delay: float = 0.0, *, crash_token: int = -1, crash_after: int = 0, start_seconds: float = 0.0) -> None:
        self.delay = delay
        self.start_seconds = start_seconds
        self.crash_token = crash_token
        self.crash_after = crash_after
        self.stats = EngineStats(block_size=128)
        self.running = 0
        self.seen = 0
        """Prompts submitted since the process started (across rebuilds)."""
        self.dead = False

    async def start(self) -> None:
        if self.start_seconds:
            await asyncio.sleep(self.start_seconds)
        self.dead = False

    def _check(self, tokens: list[int] | None, packed: bytes = b"") -> None:
        """Die (and stay dead until rebuilt) if this prompt kills the engine."""
        self.seen += 1
        if self.crash_after and self.seen == self.crash_after + 1:
            self.dead = True  # once
        if self.crash_token >= 0 and self.crash_token in (tokens if tokens is not None else tk.unpack(packed)):
            self.dead = True
        if self.dead:
            raise EngineDead("echo engine died")

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0
    ) -> Completion:
        self._check(tokens)
        self.running += 1
        try:
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.dead:  # died meanwhile: every request in flight is lost
                raise EngineDead("echo engine died")
            out = tokens[-min(len(tokens), sampling.max_tokens) :]
            self.stats.generated += len(out)
            return Completion(" ".join(map(str, out)), FinishReason.LENGTH, len(tokens), 0, len(out))
        finally:
            self.running -= 1

    def alive(self) -> bool:
        return not self.dead

    def snapshot(self) -> EngineStats:
        self.stats.running = self.running
        return self.stats

    async def reset_prefix_cache(self) -> bool:
        if self.dead:
            raise EngineDead("echo engine died")
        return True

    async def shutdown(self) -> None:
        return None


class InstantEchoEngine(EchoEngine):
    """The echo engine with no delay: a whole work batch at once (`generate_batch`), and
    as output only the number of tokens it would have echoed (no token list is built)."""

    async def generate_batch(self, prompts: list[tuple[bytes, SamplingSpec]]) -> list[Completion]:
        out = []
        for packed, sampling in prompts:
            if self.crash_after or self.crash_token >= 0:
                self._check(None, packed)
            n = tk.count(packed)
            k = min(n, sampling.max_tokens)
            out.append(Completion(f"{k} tokens", FinishReason.LENGTH, n, 0, k))
        return out
