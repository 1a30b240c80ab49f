"""What the engine-worker needs from an engine: the `Engine` protocol and its data types.

An engine turns one tokenized prompt into one `Completion`. Failures of a single request
raise `RequestFailed` (the worker writes an error row); `EngineDead` (or anything else
escaping from `generate`) means the engine itself is broken.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import msgspec

from shared.wire.messages import FinishReason, PromptId, SamplingSpec


class Completion(msgspec.Struct):
    output: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class RequestFailed(Exception):
    """This one request was rejected or failed; the engine is fine."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    kv_blocks: int = 0
    block_size: int = 0




def request_seed(sampling: SamplingSpec, prompt_id: PromptId) -> int | None:
    if sampling.seed is None:
        return None
    offset = prompt_id if isinstance(prompt_id, int) else zlib.crc32(prompt_id.encode())
    return (sampling.seed + offset) % (2**31)


class Engine(Protocol):
    async def start(self) -> None: ...

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0
    ) -> Completion: ...

    def snapshot(self) -> EngineStats: ...

    async def reset_prefix_cache(self) -> bool: ...

    async def shutdown(self) -> None: ...
