"""Prefix bucketing buffer: pure logic, no I/O (tested on its own).

Prompts wait in a bounded buffer ordered by token ids. Walking that order, neighbours
whose common prefix is under `threshold` of the shorter prompt start a new bucket (the
reference rule). Bucket boundaries are maintained incrementally: an insert or a removal
only re-examines its neighbours (most only bump one bucket's size), so insert, pop and
"largest bucket" cost O(log n) (sorted containers; a lazily cleaned max-heap of bucket
sizes) instead of a re-sort per pop.

Release (`pop`):
1. every bucket holding a prompt that has waited `max_wait` (the reference has no time
   limit; we guarantee one);
2. while the buffer is over `max_prompts` / `max_bytes`: the largest bucket (reference);
3. on `flush` (end of input): everything, largest first (reference);
4. with a `budget` (free room the router reports on the replicas): the largest buckets
   up to that much work, so engines are never idle while prompts wait (not in the
   reference, which buffers until full).
Buckets of at least `min_bucket` go out keyed by their common prefix; smaller ones are
pooled into mixed batches of at least `min_bucket` with no key (reference). Everything
released leaves the buffer: nothing is held forever and nothing is released twice.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from sortedcontainers import SortedDict, SortedList

from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes

Key = tuple[str, bytes, int]
"""Sort key of an item: (LoRA adapter, packed token ids, arrival sequence number): an
adapter's prompts sort apart, so no bucket mixes adapters (their caches are apart)."""


@dataclass(slots=True)
class Item:
    tokens: bytes
    """Packed token ids (`prefixflow.shared.prefix.tokens.pack`)."""
    arrived: float
    payload: object = None
    """Whatever the caller needs back (the wire prompt)."""
    ref: Hashable = None
    """Identity of the source message (for the caller's ack bookkeeping)."""
    weight: int = 0
    """Work this prompt brings (prompt + output tokens); 0: its token count."""
    lora: str = ""
    """Its LoRA adapter (empty: the base model)."""
    output: int = 0
    """Its output budget (max_tokens) among `weight`: the router charges it at what an
    output token costs."""


@dataclass(slots=True)
class Bucket:
    items: list[Item]
    key: list[int] = field(default_factory=list)
    """Block-hash chain of the common prefix; empty for a pooled (mixed) batch."""
    prefix_len: int = 0
    """Common prefix of the items, in tokens."""
    parts: list[tuple[int, list[int]]] = field(default_factory=list)
    """(prompt count, prefix key) of each part, in item order, so a router can place each
    part by its own prefix: for a pooled batch, its small buckets; for a keyed bucket
    whose prompts share longer prefixes in groups (a system prompt, then one of several
    few-shot prefixes), those groups (`groups`); else empty."""
    pooled: bool = False
    """A mixed batch of small buckets (no key)."""
    released: list[tuple[int, str]] = field(default_factory=list)
    """(prompts, why) of each bucket released into this one, in item order (one for a
    keyed bucket, one per part of a pooled batch); why is one of `RELEASE_REASONS`."""

    @property
    def tokens(self) -> int:
        return sum(tk.count(i.tokens) for i in self.items)


MIN_GROUP = 2
"""Prompts of a keyed bucket sharing a longer prefix form a group of their own (a part
routed by its own key) from this many on."""

RELEASE_REASONS = ("max_wait", "size", "flush", "eager")
"""Why a bucket left the buffer: a prompt waited `max_wait`; the buffer was over its
bounds (`size`); end of input or shutdown (`flush`); the replicas had room (`eager`)."""


def linked(a: bytes, b: bytes, threshold: float) -> bool:
    """The reference rule: neighbours stay in one bucket when their common prefix is at
    least `threshold` of the shorter prompt."""
    shorter = min(len(a), len(b)) // tk.WIDTH
    if shorter == 0:
        return False
    # common prefix >= threshold * shorter  <=>  the first ceil(threshold * shorter)
    # tokens are equal: one memcmp, no search for the exact common prefix.
    need = math.ceil(threshold * shorter) * tk.WIDTH
    return a[:need] == b[:need]


def split_sorted(token_lists: list[bytes], threshold: float) -> list[int]:
    """Bucket sizes of an already sorted sequence (the static reference computation)."""
    sizes: list[int] = []
    for i, t in enumerate(token_lists):
        if i and linked(token_lists[i - 1], t, threshold):
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


class PrefixBuffer:
    def __init__(
        self,
        *,
        max_prompts: int = 5000,
        max_bytes: int = 256 * 1024 * 1024,
        min_bucket: int = 16,
        threshold: float = 0.33,
        max_wait: float = 5.0,
        block_size: int = 128,
        pool_size: int = 0,
        max_bucket: int = 0,
    ) -> None:
        self.max_prompts = max_prompts
        self.max_bytes = max_bytes
        self.min_bucket = min_bucket
        self.threshold = threshold
        self.max_wait = max_wait
        self.block_size = block_size
        self.pool_size = max(pool_size, min_bucket)
        """Pooled batches go out at this size (>= min_bucket, as in the reference)."""
        self.max_bucket = max(max_bucket, 2 * min_bucket) if max_bucket else 0
        """A larger released bucket goes out as consecutive slices of about this many
        prompts, each routed on its own under the replicas' caps (0: whole)."""
        self._items: SortedDict = SortedDict()  # Key -> Item, in token order
        self._starts: SortedList = SortedList()  # keys that begin a bucket
        self._by_size: list[tuple[int, int, Key]] = []  # max-heap (-size, seq, start), lazily cleaned
        self._size: dict[Key, int] = {}  # start key -> bucket size
        self._ages: list[tuple[float, int, Key]] = []  # min-heap, lazily cleaned
        self._seq = itertools.count()
        self._bytes = 0

    # --- inspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def full(self) -> bool:
        return len(self._items) >= self.max_prompts or self._bytes >= self.max_bytes

    def over(self) -> bool:
        return len(self._items) > self.max_prompts or self._bytes > self.max_bytes

    def bucket_sizes(self) -> list[int]:
        """Sizes of the current buckets in token order (for tests and metrics)."""
        return [self._size[s] for s in self._starts]

    def oldest(self) -> float | None:
        self._clean_ages()
        return self._ages[0][0] if self._ages else None

    # --- structure maintenance --------------------------------------------------------

    def _index(self, key: Key) -> int:
        return self._items.bisect_left(key)

    def _start_of(self, key: Key) -> Key:
        return self._starts[self._starts.bisect_right(key) - 1]

    def _set_size(self, start: Key, size: int) -> None:
        self._size[start] = size
        heapq.heappush(self._by_size, (-size, start[2], start))
        if len(self._by_size) > 2 * len(self._size) + 1024:  # drop the stale entries
            self._by_size = [(-n, s[2], s) for s, n in self._size.items()]
            heapq.heapify(self._by_size)

    def _drop_start(self, start: Key) -> int:
        """Remove a bucket boundary; returns the size the bucket had."""
        size = self._size.pop(start)
        self._starts.remove(start)
        return size

    def _add_start(self, start: Key, size: int) -> None:
        self._starts.add(start)
        self._set_size(start, size)

    def _recount(self, start: Key) -> None:
        i = self._starts.index(start)
        end = self._index(self._starts[i + 1]) if i + 1 < len(self._starts) else len(self._items)
        self._set_size(start, end - self._index(start))

    def _link(self, a: Key, b: Key) -> bool:
        return a[0] == b[0] and linked(a[1], b[1], self.threshold)

    # --- insert -----------------------------------------------------------------------

    def insert(self, item: Item) -> None:
        key: Key = (item.lora, item.tokens, next(self._seq))
        pos = self._items.bisect_left(key)
        prev: Key | None = self._items.peekitem(pos - 1)[0] if pos > 0 else None
        nxt: Key | None = self._items.peekitem(pos)[0] if pos < len(self._items) else None
        self._items[key] = item
        self._bytes += len(item.tokens)
        heapq.heappush(self._ages, (item.arrived, key[2], key))

        # Most inserts join a bucket without moving any boundary: a size update. Only a
        # split needs recounting (index lookups).
        if prev is None:
            # New first item: it joins the first bucket or starts its own.
            if nxt is not None and self._link(key, nxt):
                self._add_start(key, self._drop_start(nxt) + 1)
            else:
                self._add_start(key, 1)
            return
        start = self._start_of(prev)
        join_prev = self._link(prev, key)
        join_next = nxt is not None and self._link(key, nxt)
        if nxt is not None and nxt not in self._size:  # inside the bucket of prev and nxt
            if join_prev and join_next:
                self._set_size(start, self._size[start] + 1)
                return
            # The bucket splits: at key, at nxt, or both.
            if not join_prev:
                self._add_start(key, 0)
            if not join_next:
                self._add_start(nxt, 0)
            for s in (start, key, nxt):
                if s in self._size:
                    self._recount(s)
        elif join_prev:  # key ends prev's bucket; nxt's bucket (if any) may join too
            merged = self._drop_start(nxt) if join_next else 0
            self._set_size(start, self._size[start] + 1 + merged)
        elif join_next:  # key begins nxt's bucket
            self._add_start(key, self._drop_start(nxt) + 1)
        else:
            self._add_start(key, 1)

    # --- removal ----------------------------------------------------------------------

    def _take(self, start: Key) -> list[Item]:
        """Remove the bucket beginning at `start`; heal the boundary it leaves."""
        i = self._starts.index(start)
        lo = self._index(start)
        hi = self._index(self._starts[i + 1]) if i + 1 < len(self._starts) else len(self._items)
        keys = list(self._items.keys()[lo:hi])
        items = [self._items.pop(k) for k in keys]
        self._bytes -= sum(len(it.tokens) for it in items)
        self._drop_start(start)
        # The buckets on either side are now neighbours: the reference rule may join them.
        if 0 < lo < len(self._items):
            prev, nxt = self._items.peekitem(lo - 1)[0], self._items.peekitem(lo)[0]
            if self._link(prev, nxt):
                self._drop_start(nxt)
                self._recount(self._start_of(prev))
        return items

    @staticmethod
    def work(items: list[Item]) -> int:
        """Work tokens of `items` (what the router counts as load)."""
        return sum(it.weight or tk.count(it.tokens) for it in items)

    def _clean_ages(self) -> None:
        while self._ages and self._ages[0][2] not in self._items:
            heapq.heappop(self._ages)

    def _largest(self) -> Key:
        """Start of the largest bucket (the oldest start among equals)."""
        while True:
            neg, _, start = self._by_size[0]
            if self._size.get(start) == -neg:
                return start
            heapq.heappop(self._by_size)

    # --- release ----------------------------------------------------------------------

    def _keyed(self, items: list[Item]) -> Bucket:
        plen = tk.common_prefix(items[0].tokens, items[-1].tokens) if len(items) > 1 else tk.count(items[0].tokens)
        return Bucket(items, block_hashes(items[0].tokens[: plen * tk.WIDTH], self.block_size, lora=items[0].lora), plen)

    def slices(self, items: list[Item]) -> list[list[Item]]:
        """A released bucket as consecutive slices of `max_bucket` prompts (the last one
        between `min_bucket` and `max_bucket` + `min_bucket`): a bucket holding most of a
        job (a dominant prefix, or every row under one system prompt) must not land on
        one replica at once while the others wait."""
        size = self.max_bucket
        if not size or len(items) <= size:
            return [items]
        cuts = list(range(0, len(items), size))
        if len(items) - cuts[-1] < self.min_bucket:
            cuts.pop()
        return [items[a:b] for a, b in zip(cuts, [*cuts[1:], len(items)])]

    def groups(self, bucket: Bucket) -> list[tuple[int, list[int]]]:
        """A keyed bucket's groups that share more than its key: runs of its (sorted)
        prompts that also share the next block, each of at least `MIN_GROUP` prompts, as
        (prompt count, key of the run's common prefix); prompts in no such run are parts
        keyed by what they share. Empty unless there are two such groups (the bucket is
        then routed as one, by its key)."""
        items = bucket.items
        depth = (len(bucket.key) + 1) * self.block_size * tk.WIDTH
        runs: list[list[Item]] = [[items[0]]]
        for prev, cur in zip(items, items[1:]):
            if len(prev.tokens) >= depth and prev.tokens[:depth] == cur.tokens[:depth]:
                runs[-1].append(cur)
            else:
                runs.append([cur])
        if sum(len(run) >= MIN_GROUP for run in runs) < 2:
            return []
        parts: list[list[Item]] = []
        loose: list[Item] = []
        for run in runs:
            if len(run) >= MIN_GROUP:
                if loose:
                    parts.append(loose)
                    loose = []
                parts.append(run)
            else:
                loose.extend(run)
        if loose:
            parts.append(loose)
        return [(len(part), self._keyed(part).key) for part in parts]

    def pop(self, now: float, *, flush: bool = False, budget: float = 0, bounded: bool = False,
            why: str = "eager") -> list[Bucket]:
        """Release what is due at `now` (everything if `flush`), then, largest first,
        buckets worth up to about `budget` work tokens (the replicas' free room: feeding
        idle engines beats waiting for better buckets).

        `bounded` (a job's turn under fair sharing, `prefixflow/services/bucketer/lanes.py`): release
        only up to `budget`, overdue buckets first, then the largest; the size bound is
        the caller's (it gates intake), so nothing goes out past the budget. `why` labels
        the largest buckets released for the budget ("size" when the caller's bound forced them)."""
        out: list[Bucket] = []
        pool = Bucket([], pooled=True)

        def emit(items: list[Item], why: str) -> None:
            nonlocal pool
            if len(items) >= self.min_bucket:
                for piece in self.slices(items):
                    keyed = self._keyed(piece)
                    keyed.released.append((len(piece), why))
                    keyed.parts = self.groups(keyed)
                    out.append(keyed)
                return
            keyed = self._keyed(items)
            pool.items.extend(items)
            pool.parts.append((len(items), keyed.key))
            pool.released.append((len(items), why))
            if len(pool.items) >= self.pool_size:
                out.append(pool)
                pool = Bucket([], pooled=True)

        # 1. Overdue prompts go now, with their whole bucket (bounded: within the budget).
        while not bounded or budget > 0:
            self._clean_ages()
            if not self._ages or now - self._ages[0][0] < self.max_wait:
                break
            items = self._take(self._start_of(self._ages[0][2]))
            if bounded:
                budget -= self.work(items)
            emit(items, "max_wait")
        # 2. Over the bounds (or flushing): largest buckets first.
        while self._items and (flush or (not bounded and self.over())):
            emit(self._take(self._largest()), "flush" if flush else "size")
        # 3. Work-conserving: the replicas have room, so the largest buckets go now.
        while self._items and budget > 0:
            items = self._take(self._largest())
            budget -= self.work(items)
            emit(items, why)
        if pool.items:  # a partial mixed batch goes too: its prompts were due
            out.append(pool)
        return out
