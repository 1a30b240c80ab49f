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
from array import array
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Hash chain over the full blocks of `tokens` (a trailing partial block is ignored,
    as vLLM caches only full blocks)."""
    n_blocks = len(tokens) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    out: list[int] = []
    parent = b""
    for i in range(n_blocks):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(array("I", tokens[i * block_size : (i + 1) * block_size]).tobytes())
        parent = h.digest()
        out.append(int.from_bytes(parent, "little") >> 1)  # 63 bits: fits msgpack int64 too
    return out


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def matched_blocks(key: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading block hashes two keys share."""
    return common_prefix_len(key, other)
