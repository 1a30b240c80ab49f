"""The `echo` engines: no model, for measuring the orchestration and for fast tests.

Faults are simulated here, never in the worker: the engine dies like a dead vLLM engine
core (`EngineDead` for the request that hit it and for every request then in flight,
until `shutdown()` and `start()` rebuild it) on a prompt holding `crash_token`, and once
after `crash_after` prompts.

A test knob with no configuration: a row whose sampling has the stop string `STALL`
(`{"sampling": {"stop": ["<pfx:echo-stall>"]}}`) never finishes on the echo engine with
a delay (`--echo-delay`, and `--echo-token-delay` per output token; the instant one
answers whole batches at once and ignores them)
until its request is cancelled, as a vLLM request that generates for ever would (the
row deadline's test: `--row-timeout`, docs/limits.md).

Outputs have the sizes and the fields the vLLM engine gives (`engines/vllm.py`), so
message sizes are real without a model: `max(min_tokens, min(prompt, max_tokens))`
tokens (the prompt's last ones, repeated as needed), `n` completions in `outputs` when
n > 1 (with temperature > 0 each distinct: the echo rotated by its index), with `logprobs: k` one entry per token of the first completion holding the token
and k + 1 alternatives (vLLM's most: the top k and the sampled one), and in the embed
task (`PFX_TASK=embed`) an embedding of `PFX_ECHO_EMBED_DIM` floats (default 256, the
local model's hidden size) instead of text. They have no model, so no LoRA adapters:
a row naming one is answered like any other.
"""

from __future__ import annotations

import asyncio
import os

from prefixflow.services.engine_worker.cost_fit import MAX_RATIO, MIN_RATIO
from prefixflow.services.engine_worker.engines.base import Completion, EngineDead, EngineStats
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire.messages import FinishReason, PromptId, SamplingSpec


STALL = "<pfx:echo-stall>"
"""A stop string that makes the (delayed) echo engine never finish the row (a test knob)."""
EMBED_DIM = 256
"""Embedding width without `PFX_ECHO_EMBED_DIM` (the local tiny model's hidden size)."""


def echo_length(tokens: list[int], sampling: SamplingSpec) -> int:
    """Output tokens of an echo completion: the prompt's length within min/max_tokens."""
    return max(sampling.min_tokens, min(len(tokens), sampling.max_tokens))


def echo_completion(tokens: list[int], sampling: SamplingSpec, task: str = "generate", embed_dim: int = EMBED_DIM) -> Completion:
    """What the echo engines answer for one prompt, with the vLLM engine's fields and sizes."""
    if task == "embed":
        base = sum(tokens) % 997
        return Completion("", FinishReason.STOP, len(tokens), 0, 0,
                          embedding=[((base + i * 31) % 1009) / 1009.0 - 0.5 for i in range(embed_dim)])
    k = echo_length(tokens, sampling)
    source = tokens or [0]
    out = (source * (k // len(source) + 1))[-k:] if k else []  # the prompt's last k tokens, repeated as needed
    text = " ".join(map(str, out))
    logprobs = []
    if sampling.logprobs is not None:
        alternatives = sampling.logprobs + 1
        logprobs = [
            {"token": str(t), "logprob": -0.125 - i % 7 / 8,
             "top": [{"token": str(t + j), "logprob": -0.125 - j / 8} for j in range(alternatives)]}
            for i, t in enumerate(out)
        ]
    if sampling.n == 1:
        return Completion(text, FinishReason.LENGTH, len(tokens), 0, k, logprobs=logprobs)
    # n completions: distinct when sampled (as vLLM's would be; a merged request's rows
    # each get their own), the same when greedy. The i-th: the echo rotated by i tokens.
    texts = [text if not sampling.temperature or not out else " ".join(map(str, out[i % k:] + out[:i % k]))
             for i in range(sampling.n)]
    return Completion(text, FinishReason.LENGTH, len(tokens), 0, k * sampling.n, outputs=texts, logprobs=logprobs,
                      output_counts=[k] * sampling.n, finish_reasons=[FinishReason.LENGTH] * sampling.n)


class EchoEngine:
    """No model: the output is the prompt's last few token ids as text; `delay` seconds
    per prompt simulate work (a task per prompt, as with vLLM). `task`, `embed_dim`:
    default `PFX_TASK` and `PFX_ECHO_EMBED_DIM` (the engine factory passes neither)."""

    def __init__(
        self, delay: float = 0.0, *, crash_token: int = -1, crash_after: int = 0, start_seconds: float = 0.0,
        task: str | None = None, embed_dim: int | None = None, token_delay: float = 0.0,
    ) -> None:
        self.task = task if task is not None else os.environ.get("PFX_TASK", "generate")
        self.embed_dim = embed_dim if embed_dim is not None else int(os.environ.get("PFX_ECHO_EMBED_DIM") or EMBED_DIM)
        self.delay = delay
        self.token_delay = token_delay
        """Seconds per output token, on top of `delay` (`--echo-token-delay`)."""
        self.start_seconds = start_seconds
        self.crash_token = crash_token
        self.crash_after = crash_after
        self.stats = EngineStats(block_size=128)
        self.running = 0
        self.seen = 0
        """Prompts submitted since the process started (across rebuilds)."""
        self.dead = False
        self.adapters: list[str] = []
        self.lora_slots = 0
        self.prompts_served = 0
        self.prompt_tokens_served = 0

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
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0,
        lora: str = "",
    ) -> Completion:
        self._check(tokens)
        self.running += 1
        try:
            if self.delay or self.token_delay:
                await asyncio.sleep(self.delay + self.token_delay * echo_length(tokens, sampling))
            if STALL in sampling.stop:
                await asyncio.Event().wait()  # until cancelled (the row's deadline)
            if self.dead:  # died meanwhile: every request in flight is lost
                raise EngineDead("echo engine died")
            done = echo_completion(tokens, sampling, self.task, self.embed_dim)
            self.stats.generated += done.output_tokens
            self.cost(len(tokens))
            return done
        finally:
            self.running -= 1

    def alive(self) -> bool:
        return not self.dead

    async def canary(self) -> None:
        """Serves if not dead (the fault hooks count real prompts only)."""
        if self.dead:
            raise EngineDead("echo engine died")

    def cost(self, prompt_tokens: int) -> None:
        """What its delays make an output token cost in prompt tokens (`decode_cost`, as a
        vLLM engine measures it): `token_delay` over the prompt's share `delay` / prompt
        tokens, averaged over the prompts served (0 without a per-token delay; the most a
        fit reports when only output tokens take time)."""
        self.prompts_served += 1
        self.prompt_tokens_served += prompt_tokens
        if self.token_delay > 0:
            per_prompt_token = self.delay * self.prompts_served / max(self.prompt_tokens_served, 1)
            ratio = self.token_delay / per_prompt_token if per_prompt_token > 0 else MAX_RATIO
            self.stats.decode_cost = min(max(ratio, MIN_RATIO), MAX_RATIO)

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
    for a plain row (one completion, no logprobs, text) as output only the number of
    tokens it would have echoed (no token list is built); rows whose size is the point
    (n > 1, logprobs, embeddings) get the full echo."""

    async def generate_batch(self, prompts: list[tuple[bytes, SamplingSpec]]) -> list[Completion]:
        out = []
        for packed, sampling in prompts:
            if self.crash_after or self.crash_token >= 0:
                self._check(None, packed)
            if self.task == "embed" or sampling.n > 1 or sampling.logprobs is not None:
                done = echo_completion(tk.unpack(packed), sampling, self.task, self.embed_dim)
            else:
                n = tk.count(packed)
                k = max(sampling.min_tokens, min(n, sampling.max_tokens))
                done = Completion(f"{k} tokens", FinishReason.LENGTH, n, 0, k)
            self.stats.generated += done.output_tokens
            out.append(done)
        return out
