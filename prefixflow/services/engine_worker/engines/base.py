"""What the engine-worker needs from an engine: the `Engine` protocol and its data types.

An engine turns one tokenized prompt into one `Completion`. Failures of a single request
raise `RequestFailed` (the worker writes that row's error row). Only `EngineDead` means
the engine itself is gone (vLLM's `EngineDeadError`): the worker re-publishes its
unfinished work (`isolate.py`), calls `shutdown()`, `start()` again (the same object) and
`canary()`, and carries on. `start()` must therefore work again after `shutdown()`. Any
other exception is classified by `is_engine_death`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import msgspec

from prefixflow.shared.wire.messages import FinishReason, PromptId, SamplingSpec


class Completion(msgspec.Struct):
    output: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    outputs: list[str] = msgspec.field(default_factory=list)
    """Every completion when n > 1."""
    logprobs: list[dict] = msgspec.field(default_factory=list)
    """Per generated token of the first completion (`Result.logprobs`)."""
    embedding: list[float] = msgspec.field(default_factory=list)
    """Embed task: the pooled vector."""
    output_counts: list[int] = msgspec.field(default_factory=list)
    """When n > 1: the generated tokens of each completion (`output_tokens` is their sum)."""
    finish_reasons: list[FinishReason] = msgspec.field(default_factory=list)
    """When n > 1: why each completion ended (`finish_reason` is the first's)."""


class RequestFailed(Exception):
    """This one request was rejected or failed; the engine is fine."""


class EngineDead(Exception):
    """The engine itself died (vLLM's `EngineDeadError`: its engine-core process crashed
    or was killed). Every request in flight is lost; the engine must be rebuilt."""


def is_engine_death(exc: BaseException, alive: bool) -> bool:
    """Whether a request's failure `exc` means the engine is gone (rebuild it) rather than
    that this request failed (its error row). `alive`: the engine's `alive()` after the
    failure.

    NOTE: only `EngineDead`, or an engine that no longer reports itself alive (vLLM's
    output handler died: every later request would fail), rebuilds; an error the adapter
    did not name (vLLM's `EngineGenerateError`, a bad sampling field) is that request's
    alone. Rebuilding on every unknown error hands all work back and reloads the model."""
    return isinstance(exc, EngineDead) or not alive


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 0
    block_size: int = 0
    generated: int = 0
    """Tokens generated since the worker started, finished requests or not (the window's
    probe measures its rate from it; progress shows it before any row is done)."""
    steps: int = 0
    """Engine steps that produced output (each decoding request gains a token per step)."""
    preemptions: int = 0
    """Requests the engine preempted (its KV cache ran out; they are recomputed)."""
    decode_cost: float = 0.0
    """An output token's cost in uncached prompt tokens, measured (`cost_fit.CostFit`; 0:
    not measured, e.g. an engine without steps)."""
    step: tuple[float, float, float] | None = None
    """A step's (fixed seconds, seconds per computed prompt token, seconds per generated
    token), measured (`cost_fit.StepFit`; None: not measured, e.g. an engine without steps)."""
    batch_tokens: int = 0
    """Prompt tokens one step computes at most (vLLM's `max_num_batched_tokens`; 0: unknown)."""
    max_seqs: int = 0
    """Requests the engine runs at once at most (vLLM's `max_num_seqs`; 0: unknown)."""


def request_seed(sampling: SamplingSpec, prompt_id: PromptId) -> int | None:
    if sampling.seed is None:
        return None
    offset = prompt_id if isinstance(prompt_id, int) else zlib.crc32(prompt_id.encode())
    return (sampling.seed + offset) % (2**31)


class Engine(Protocol):
    async def start(self) -> None:
        """Start (or, after `shutdown()`, start again)."""

    adapters: list[str]
    """LoRA adapters it serves (empty: none; the echo engines answer any)."""
    lora_slots: int
    """Adapters it runs at once (0: no LoRA)."""

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0,
        lora: str = "",
    ) -> Completion:
        """Raises `RequestFailed` (this request only, e.g. an adapter it does not serve)
        or `EngineDead`. `lora`: the LoRA adapter's name (empty: the base model)."""

    def alive(self) -> bool:
        """False once the engine is known dead (even with no request in flight)."""

    async def canary(self) -> None:
        """One tiny request after a (re)start: raises `EngineDead` if the engine cannot
        serve (the worker then counts a failed rebuild, not a strike against a prompt)."""

    def snapshot(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def shutdown(self) -> None: ...


class BatchEngine(Engine, Protocol):
    """An engine that completes a whole work batch at once, without a task per prompt
    (the instant echo engine: the pipeline benchmark then measures the orchestration,
    not the worker's task overhead). The worker uses `generate_batch` when an engine has it."""

    async def generate_batch(self, prompts: list[tuple[bytes, SamplingSpec]]) -> list[Completion]:
        """One completion per (packed token ids, sampling) pair, in order. Raises
        `EngineDead`; has no per-request failures."""
