"""Block-aligned prefix keys: a hash chain over KV-block-sized chunks of token ids.

`block_hashes(tokens, 128)[i]` identifies the first (i + 1) * 128 tokens, the way vLLM's
prefix cache identifies a cached block by its parent's hash plus its own tokens. Two
prompts that share their first k full blocks share the first k hashes, so a router can
score a partial match (same system prompt, different few-shot examples) by the length of
the common leading run. Hashes are stable across processes and machines (blake2b, not
Python's salted `hash`).

A LoRA adapter's prompts get a chain of their own (`lora`: the adapter's name; the base
model's chain is unchanged): vLLM's prefix cache is per adapter (the adapter is part of a
block's hash), so the same text under two adapters shares no cached block, and keys,
buckets and the router's cache model must not say it does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from prefixflow.shared.prefix import tokens as tk

HASH_BLOCK_SIZE = 128
"""Tokens per prefix-key block (vLLM calls its own `hash_block_size`): the one default for
sharding keys, bucket keys, router history and prefix groups. It is not the engine's KV
block size (16 tokens on GPUs, 128 on CPU), which every engine reports in its status and
the router converts from."""


def lora_root(lora: str) -> bytes:
    """Where an adapter's hash chain starts (the base model's, `lora` empty: nothing)."""
    return hashlib.blake2b(b"lora\0" + lora.encode(), digest_size=8).digest() if lora else b""


def block_hashes(tokens: bytes, block_size: int, max_blocks: int | None = None, lora: str = "") -> list[int]:
    """Hash chain over the full blocks of packed `tokens` (a trailing partial block is
    ignored, as vLLM caches only full blocks), under LoRA adapter `lora` ("": the base
    model). 63-bit ints: they fit msgpack int64."""
    n_blocks = tk.count(tokens) // block_size
    if max_blocks is not None:
        n_blocks = min(n_blocks, max_blocks)
    step = block_size * tk.WIDTH
    out: list[int] = []
    parent = lora_root(lora)
    for i in range(n_blocks):
        parent = hashlib.blake2b(parent + tokens[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(parent, "little") >> 1)
    return out


def first_block_key(tokens: bytes, block_size: int = HASH_BLOCK_SIZE, lora: str = "") -> int:
    """The hash of a prompt's first block (of the whole prompt if it is shorter): the
    key that shards prompts over bucketers and groups them in the engine's queue."""
    hashes = block_hashes(tokens, block_size, max_blocks=1, lora=lora)
    if hashes:
        return hashes[0]
    return int.from_bytes(hashlib.blake2b(lora_root(lora) + tokens, digest_size=8).digest(), "little") >> 1


def matched_blocks(key: Sequence[int], other: Sequence[int]) -> int:
    """Number of leading block hashes two keys share."""
    n = min(len(key), len(other))
    i = 0
    while i < n and key[i] == other[i]:
        i += 1
    return i
