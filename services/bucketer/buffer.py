"""Prefix bucketing buffer: pure logic, no I/O (tested on its own).

Prompts wait in a bounded buffer ordered by token ids. Neighbours in that order whose
common prefix is under `threshold` of the shorter prompt start a new bucket. Buckets are
released, largest first, when they reach `min_bucket`, when their oldest prompt has
waited `max_wait`, when the buffer is over its bounds, or on `flush()`; small buckets
that must go are pooled into mixed batches. Everything released leaves the buffer, so
nothing is held forever and nothing is released twice.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from shared.prefix_keys import block_hashes, common_prefix_len


@dataclass(slots=True)
class Item:
    tokens: Sequence[int]
    arrived: float
    payload: object = None
    """Whatever the caller needs back (the wire prompt and its source message)."""
    ref: Hashable = None
    """Identity of the source message (for the caller's ack bookkeeping)."""


@dataclass(slots=True)
class Bucket:
    items: list[Item]
    key: list[int] = field(default_factory=list)
    """Block-hash chain of the common prefix; empty for a pooled (mixed) batch."""
    prefix_len: int = 0


def split_buckets(items: list[Item], threshold: float) -> list[list[Item]]:
    """Cut the sorted `items` wherever neighbours share < threshold of the shorter one."""
    buckets: list[list[Item]] = []
    for item in items:
        if buckets:
            prev = buckets[-1][-1]
            shorter = min(len(prev.tokens), len(item.tokens))
            if common_prefix_len(prev.tokens, item.tokens) >= threshold * shorter and shorter > 0:
                buckets[-1].append(item)
                continue
        buckets.append([item])
    return buckets


def bucket_prefix_len(items: list[Item]) -> int:
    """Common prefix of a sorted run = common prefix of its first and last items."""
    return common_prefix_len(items[0].tokens, items[-1].tokens) if len(items) > 1 else len(items[0].tokens)


class PrefixBuffer:
    def __init__(
        self,
        *,
        max_prompts: int = 5000,
        max_bytes: int = 256 * 1024 * 1024,
        min_bucket: int = 16,
        threshold: float = 0.33,
        max_wait: float = 2.0,
        block_size: int = 128,
    ) -> None:
        self.max_prompts = max_prompts
        self.max_bytes = max_bytes
        self.min_bucket = min_bucket
        self.threshold = threshold
        self.max_wait = max_wait
        self.block_size = block_size
        self._items: list[Item] = []
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def full(self) -> bool:
        return len(self._items) >= self.max_prompts or self._bytes >= self.max_bytes

    def insert(self, item: Item) -> None:
        self._items.append(item)
        self._bytes += 4 * len(item.tokens)

    def oldest(self) -> float | None:
        return min((i.arrived for i in self._items), default=None)

    def pop(self, now: float, *, flush: bool = False) -> list[Bucket]:
        """Release what is due at `now` (everything if `flush`), largest buckets first."""
        if not self._items:
            return []
        self._items.sort(key=lambda i: tuple(i.tokens))
        runs = split_buckets(self._items, self.threshold)
        runs.sort(key=len, reverse=True)
        out: list[Bucket] = []
        keep: list[list[Item]] = []
        pooled: list[Item] = []
        over = max(0, len(self._items) - self.max_prompts)
        for run in runs:
            overdue = any(now - i.arrived >= self.max_wait for i in run)
            if len(run) >= self.min_bucket:
                out.append(self._keyed(run))
            elif flush or overdue or over > 0:
                pooled.extend(run)
                over -= len(run)
            else:
                keep.append(run)
        for i in range(0, len(pooled), max(self.min_bucket, 1)):
            out.append(Bucket(pooled[i : i + self.min_bucket]))
        self._items = [i for run in keep for i in run]
        self._bytes = sum(4 * len(i.tokens) for i in self._items)
        return out

    def _keyed(self, run: list[Item]) -> Bucket:
        plen = bucket_prefix_len(run)
        return Bucket(run, block_hashes(run[0].tokens[:plen], self.block_size), plen)
