"""How well a run kept its prefix groups together: shared by `prefixflow bench` (which
knows each prompt's group from the dataset) and `prefixflow report` (which finds the
groups in a job's output). Pure: no NATS, no files.

A prefix group is a set of prompts that share a prefix. Ideally each group runs on one
replica and only its first prompt misses the prefix in that replica's cache; a group
*split* over replicas computes its prefix once per replica, and a prompt that *misses*
found less than its group's whole (block-aligned) prefix cached.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE, first_block_key
from prefixflow.shared.wire import messages as m


@dataclass
class GroupStat:
    """One prefix group in a run."""

    group: Hashable
    prefix_tokens: int = 0
    """The group's shared prefix, block-aligned (what a cache hit can cover)."""
    prompts: int = 0
    """Ok rows of the group."""
    replicas: Counter = field(default_factory=Counter)
    """Replica -> rows of the group it ran."""
    misses: int = 0
    """Rows that found less than `prefix_tokens` cached."""
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def split(self) -> bool:
        return len(self.replicas) > 1

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


Row = tuple[Any, str | None, int, int, bool]
"""(id, replica, cached tokens, prompt tokens, ok) of one output row."""


def group_table(rows: Iterable[Row], group_of: Mapping[Any, Hashable], prefix_tokens: int | Mapping[Hashable, int]) -> dict[Hashable, GroupStat]:
    """Per group: its ok rows, replicas and misses. `group_of` maps a row id to its group
    (ids it lacks belong to none); `prefix_tokens` is the block-aligned shared prefix, one
    for every group or per group. Error rows count for nothing."""
    groups: dict[Hashable, GroupStat] = {}
    for rid, replica, cached, prompt, ok in rows:
        if not ok:
            continue
        g = group_of.get(rid)
        if g is None:
            continue
        stat = groups.get(g)
        if stat is None:
            need = prefix_tokens if isinstance(prefix_tokens, int) else prefix_tokens.get(g, 0)
            stat = groups[g] = GroupStat(g, need)
        stat.prompts += 1
        stat.replicas[replica or "?"] += 1
        stat.misses += cached < stat.prefix_tokens
        stat.prompt_tokens += prompt
        stat.cached_tokens += cached
    return groups


def group_stats(results: list[m.Result], group_of: dict[Any, int], prefix_tokens: int) -> tuple[int, int]:
    """(groups split over replicas, prompts that missed their prefix): how well a method
    kept each prefix group together. `group_of` maps a prompt id to its prefix group;
    `prefix_tokens` is the block-aligned shared prefix."""
    table = group_table(((r.id, r.replica, r.cached_tokens, r.prompt_tokens, r.error is None) for r in results), group_of, prefix_tokens)
    return sum(g.split for g in table.values()), sum(g.misses for g in table.values())


def prefix_groups(tokens: Sequence[bytes], block_size: int = HASH_BLOCK_SIZE) -> tuple[list[int | None], dict[int, int]]:
    """Groups of packed token lists by their first `block_size` tokens (the key that
    shards prompts over bucketers), and each group's shared prefix in tokens (the common
    prefix of all its members). Returns (group of each list, or None for a list shorter
    than a block; group -> shared prefix tokens). Groups are numbered by first appearance."""
    keys: dict[int, int] = {}
    first: dict[int, bytes] = {}
    shared: dict[int, int] = {}
    out: list[int | None] = []
    for packed in tokens:
        if tk.count(packed) < block_size:
            out.append(None)
            continue
        key = first_block_key(packed, block_size)
        g = keys.get(key)
        if g is None:
            g = keys[key] = len(keys)
            first[g] = packed
            shared[g] = tk.count(packed)
        else:
            shared[g] = min(shared[g], tk.common_prefix(first[g], packed))
        out.append(g)
    return out, shared


def engine_block_size(cached: Iterable[int], default: int = HASH_BLOCK_SIZE) -> tuple[int, bool]:
    """The engine's KV block size as the run shows it: prefix-cache hits come in whole
    blocks, so the greatest common divisor of the hit lengths. Returns (size, inferred);
    `default` when there were no hits."""
    g = 0
    for c in cached:
        if c:
            g = math.gcd(g, int(c))
    return (g, True) if g else (default, False)
