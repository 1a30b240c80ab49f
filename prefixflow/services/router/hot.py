"""Hot prefixes: a prefix group whose recent work exceeds one replica's fair share of the
fleet is spread over as many replicas as its work needs; the rest stays affine.

Why: affinity alone sends every bucket of a prefix to the replica that holds it, so on a
skewed job (Zipf popularity) the most popular prefix piles onto one or two replicas while
the others idle (Preble's load/locality balance). Which replicas: rendezvous hashing of
(prefix, replica name), the `k` highest scores, so the same prefix keeps the same set as
long as the replicas do, a set of k + 1 contains the set of k (a growing group adds
replicas, keeps its caches), and a replica that leaves moves only its own share.

Pure logic, no I/O: the router's policy and the simulator use it as it is.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Hashable, Iterable, Sequence
from typing import TypeVar

R = TypeVar("R")

HOT_TAU = 30.0
"""Seconds over which routed work is remembered (exponential decay)."""
MAX_PREFIXES = 4096
"""Prefix groups tracked at once; past it the least worked ones are forgotten."""
WARM_TOKENS = 16384
"""Recent work per live replica below which no group counts as hot (the first buckets of
a job say nothing yet about which prefixes dominate it)."""


def group_of(key: Sequence[int]) -> Hashable:
    """A bucket's prefix group: its whole key (the prefix its prompts share)."""
    return tuple(key)


def rendezvous(group: Hashable, names: Iterable[tuple[str, R]], k: int) -> list[R]:
    """The `k` items whose (group, name) score is highest, best first. The score is a CRC
    of the name seeded with the group's hash (ints and tuples of ints hash the same in
    every process): a restarted router picks the same sets."""
    seed = hash(group) & 0xFFFFFFFF
    scored = sorted(names, key=lambda item: (zlib.crc32(item[0].encode(), seed), item[0]), reverse=True)
    return [item for _, item in scored[:k]]


class HotPrefixes:
    """Routed work per prefix group, decayed over `tau` seconds, and the fleet's total."""

    def __init__(self, tau: float = HOT_TAU, max_groups: int = MAX_PREFIXES, factor: float = 1.0) -> None:
        self.tau = tau
        self.max_groups = max_groups
        self.factor = factor
        """A group is hot past `factor` replicas' fair shares of the recent work."""
        self.work: dict[Hashable, tuple[float, float]] = {}
        """group -> (decayed work tokens, when last updated)."""
        self.total = 0.0
        self.total_at = 0.0

    def _decayed(self, value: float, since: float, now: float) -> float:
        return value * math.exp(-max(now - since, 0.0) / self.tau)

    def add(self, group: Hashable, tokens: float, now: float) -> None:
        value, at = self.work.get(group, (0.0, now))
        self.work[group] = (self._decayed(value, at, now) + tokens, now)
        self.total = self._decayed(self.total, self.total_at, now) + tokens
        self.total_at = now
        if len(self.work) > self.max_groups:
            keep = sorted(self.work.items(), key=lambda kv: self._decayed(kv[1][0], kv[1][1], now), reverse=True)
            self.work = dict(keep[: self.max_groups // 2])

    def replicas_needed(self, group: Hashable, tokens: float, live: int, now: float) -> int:
        """How many of `live` replicas the group's work needs, this bucket's `tokens`
        included: 1 while its share of the recent work is within `factor` fair shares."""
        if live < 2:
            return 1
        value, at = self.work.get(group, (0.0, now))
        mine = self._decayed(value, at, now) + tokens
        total = self._decayed(self.total, self.total_at, now) + tokens
        if total < WARM_TOKENS * live:
            return 1
        fair = self.factor * total / live
        if mine <= fair:
            return 1
        return min(live, math.ceil(mine / fair - 1e-9))
