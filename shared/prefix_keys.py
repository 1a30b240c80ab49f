"""Block-aligned prefix keys: a hash chain over KV-block-sized chunks of token ids.

`block_hashes(tokens, 128)[i]` identifies the first (i + 1) * 128 tokens, the way vLLM's
prefix cache identifies a cached block by its parent's hash plus its own tokens. Two
prompts that share their first k full blocks share the first k hashes, so a router can
score a partial match (same system prompt, different few-shot examples) by the length of
the common leading run. Hashes are stable across processes and machines (blake2b, not
Python's salted `hash`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shared import tokens as tk


def block_hashes(tokens: bytes, block_size: int, max_blocks: int | None = None) -> list[int]:
    """Hash chain over the full blocks of packed `tokens` (a trailing partial block is
    ignored, as vLLM caches only full blocks). 63-bit ints: they fit msgpack int64."""
    n_blocks = tk.count(tokens) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    step = block_size * tk.WIDTH
    out: list[int] = []
    parent = b""
    for i in range(n_blocks):
        parent = hashlib.blake2b(parent + tokens[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(parent, "little") >> 1)
    return out


def matched_blocks(key: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading block hashes two keys share."""
    n = min(len(key), len(other))
    i = 0
    while i < n and key[i] == other[i]:
        i += 1
    return i
