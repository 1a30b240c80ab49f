"""Routing policies: which replica(s) get a bucket. Pure logic, no I/O.

`Fleet` is the router's view of the replicas, fed by their status messages: liveness,
load (outstanding work tokens = routed minus completed, corrected by each status), KV
capacity, and a per-replica history of routed prefix keys. A policy turns a bucket
(prompt count, work tokens, prefix key) into assignments, or None when no live replica
has room (the router then answers retry-after).

Policies:
- `round-robin`, `least-loaded`: baselines.
- `daft`: the reference (Daft's vllm-prefix-caching provider) exactly: load is the
  cumulative number of prompts ever routed; eligible replicas have load < min + 256;
  among them the one whose last 8 routed keys hold this exact key most recently; a
  keyless batch (or no match) goes to the least loaded.
- `prefix-aware` (default): load is outstanding work tokens; eligible replicas are within
  `slack` tokens of the least loaded; the score is the longest block-prefix match against
  a history sized like the replica's KV cache (so a partial match counts, and a prefix
  the cache has surely evicted does not); ties go to the most recent, then the least
  loaded; affinity never starves a replica (while one holds less than one engine window
  of work, a busier best match is passed over); a bucket larger than `split_factor` x a
  replica's fair share is split.

Flow control is the same for every policy: replicas that stopped reporting, are not
ready, or hold their cap of outstanding work are never chosen.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.prefix.block_keys import matched_blocks
from shared.process import config as cfgmod

Key = tuple[int, ...]
MIN_HISTORY = 8
"""Keys kept per replica whatever the KV budget (the reference looks at the last 8)."""


@dataclass
class Replica:
    name: str
    last_seen: float = 0.0
    ready: bool = False
    outstanding: int = 0
    """Work tokens routed here and not yet completed."""
    done_tokens: int = 0
    """Last cumulative completed-work-token count the replica reported."""
    routed_prompts: int = 0
    """Prompts ever routed here (the reference's load measure; never decremented)."""
    kv_blocks: int = 0
    window: int = 0
    history: deque = field(default_factory=deque)
    """(prefix key, routing clock) of buckets routed here, most recent last."""
    history_blocks: int = 0
    """Blocks covered by `history` (kept within the KV capacity)."""


class Fleet:
    def __init__(
        self,
        *,
        dead_after: float = 5.0,
        cap_tokens: int = 0,
        history: int = 64,
        cap_windows: float = 2.0,
    ) -> None:
        self.dead_after = dead_after
        self.cap_tokens = cap_tokens
        """Fixed cap on outstanding work tokens per replica; 0: automatic."""
        self.cap_windows = cap_windows
        """Automatic cap: this many engine windows of average-sized prompts."""
        self.history = history
        self.replicas: dict[str, Replica] = {}
        self.avg_prompt_tokens = 0.0
        self.clock = itertools.count(1)
        """Global routing clock: history entries compare by recency across replicas."""

    def observe(
        self,
        name: str,
        now: float,
        *,
        ready: bool,
        outstanding: int,
        done_tokens: int,
        kv_blocks: int = 0,
        window: int = 0,
    ) -> None:
        """Apply a status message: completed work leaves the outstanding count, which is
        never below what the replica itself reports in flight."""
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = Replica(name)
        if done_tokens < r.done_tokens:  # the worker restarted: its own count is the truth
            r.outstanding = outstanding
        else:
            r.outstanding = max(r.outstanding - (done_tokens - r.done_tokens), outstanding, 0)
        r.done_tokens = done_tokens
        r.last_seen, r.ready, r.kv_blocks, r.window = now, ready, kv_blocks, window

    def live(self, now: float) -> list[Replica]:
        return sorted(
            (r for r in self.replicas.values() if r.ready and now - r.last_seen < self.dead_after),
            key=lambda r: r.name,
        )

    def cap(self, r: Replica) -> float:
        if self.cap_tokens:
            return self.cap_tokens
        if r.window and self.avg_prompt_tokens:
            return self.cap_windows * r.window * self.avg_prompt_tokens
        return math.inf

    def hungry(self, r: Replica) -> bool:
        """Outstanding work below one engine window: the replica is about to run dry."""
        return bool(r.window and self.avg_prompt_tokens) and r.outstanding < r.window * self.avg_prompt_tokens

    def open(self, now: float) -> list[Replica]:
        """Live replicas with room for more work."""
        return [r for r in self.live(now) if r.outstanding < self.cap(r)]

    def assign(self, r: Replica, prompts: int, tokens: int, key: Sequence[int]) -> None:
        r.outstanding += tokens
        r.routed_prompts += prompts
        if prompts:
            self.avg_prompt_tokens = 0.9 * self.avg_prompt_tokens + 0.1 * (tokens / prompts) if self.avg_prompt_tokens else tokens / prompts
        if key:
            r.history.append((tuple(key), next(self.clock)))
            r.history_blocks += len(key)
            budget = r.kv_blocks if r.kv_blocks else None
            while len(r.history) > MIN_HISTORY and (
                (budget is not None and r.history_blocks > budget) or (budget is None and len(r.history) > self.history)
            ):
                r.history_blocks -= len(r.history.popleft()[0])

    def room(self, now: float) -> float:
        """Work tokens the open replicas can take before reaching their caps."""
        return sum(max(0.0, self.cap(r) - r.outstanding) for r in self.open(now))

    def forget_history(self) -> None:
        for r in self.replicas.values():
            r.history.clear()
            r.history_blocks = 0


Assignments = list[tuple[Replica, int]]


class Policy:
    name = "base"
    eager = True
    """Whether the bucketer may release buckets early when replicas have room (the
    reference does not: `Daft` sets it False)."""

    def route(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int]) -> Assignments | None:
        """Pick replicas for a bucket and record the assignment in `fleet`."""
        chosen = self.choose(fleet, now, prompts, tokens, key)
        if not chosen:
            return None
        given = 0
        for i, (r, n) in enumerate(chosen):
            # Split tokens in proportion to prompts; the last part takes the remainder.
            share = tokens - given if i == len(chosen) - 1 else tokens * n // max(prompts, 1)
            given += share
            fleet.assign(r, n, share, key)
        return chosen

    def choose(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int]) -> Assignments | None:
        raise NotImplementedError

    def route_parts(self, fleet: Fleet, now: float, parts: Sequence[tuple[int, int, Sequence[int]]]) -> Assignments | None:
        """Route a pooled batch given its parts as (prompts, tokens, key). Baselines and
        the reference treat it as one keyless batch."""
        return self.route(fleet, now, sum(p[0] for p in parts), sum(p[1] for p in parts), [])


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return [(candidates[next(self._counter) % len(candidates)], prompts)]


class LeastLoaded(Policy):
    name = "least-loaded"

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return [(min(candidates, key=lambda r: (r.outstanding, r.name)), prompts)]


class Daft(Policy):
    """The reference policy, rule for rule (see the module docstring)."""

    name = "daft"
    eager = False
    LOAD_SLACK = 256
    HISTORY = 8

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        floor = min(r.routed_prompts for r in candidates)
        eligible = [r for r in candidates if r.routed_prompts < floor + self.LOAD_SLACK]
        least = min(eligible, key=lambda r: (r.routed_prompts, r.name))
        if not key:
            return [(least, prompts)]
        wanted = tuple(key)
        best, best_stamp = None, 0
        for r in eligible:
            for past, stamp in list(r.history)[-self.HISTORY :]:
                if past == wanted and stamp > best_stamp:
                    best, best_stamp = r, stamp
        return [(best or least, prompts)]


def best_match(r: Replica, key: Sequence[int]) -> tuple[int, int]:
    """(matched blocks, routing clock) of the best history entry for `key`; (0, 0) if none."""
    best = (0, 0)
    for past, stamp in r.history:
        blocks = matched_blocks(key, past)
        if blocks and (blocks, stamp) > best:
            best = (blocks, stamp)
    return best


class PrefixAware(Policy):
    name = "prefix-aware"

    def __init__(self, slack_tokens: int = 0, split_factor: float = 2.0) -> None:
        self.slack_tokens = slack_tokens
        """Load slack within which a prefix match beats a lighter replica (0: automatic,
        the replica's cap, or 64k tokens). NOTE: half a cap proved too little once the
        feed window adapts to a small KV cache: balancing then overrode affinity."""
        self.split_factor = split_factor

    def slack(self, fleet: Fleet, r: Replica) -> float:
        if self.slack_tokens:
            return self.slack_tokens
        cap = fleet.cap(r)
        return cap if math.isfinite(cap) else 65536

    def ranked(self, fleet: Fleet, candidates: list[Replica], key: Sequence[int]) -> list[Replica]:
        """Eligible replicas, best first: longest match, most recent, least loaded.
        Affinity never starves a replica: while one is hungry (under one window of
        work) and the best match is not, only hungry replicas are eligible."""
        floor = min(r.outstanding for r in candidates)
        eligible = [r for r in candidates if r.outstanding <= floor + self.slack(fleet, r)]
        scored = sorted(eligible, key=lambda r: (best_match(r, key) if key else (0, 0), -r.outstanding, r.name), reverse=True)
        if not fleet.hungry(scored[0]) and any(fleet.hungry(r) for r in scored):
            eligible = scored = [r for r in scored if fleet.hungry(r)]
        if not key or best_match(scored[0], key)[0] == 0:
            scored = sorted(eligible, key=lambda r: (r.outstanding, r.name))
        rest = sorted((r for r in candidates if r not in eligible), key=lambda r: (r.outstanding, r.name))
        return scored + rest

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        ranked = self.ranked(fleet, candidates, key)
        # A bucket far larger than one replica's fair share of the work in the system is
        # split over several replicas (each recomputes the prefix once; all stay busy).
        fair = (sum(r.outstanding for r in candidates) + tokens) / len(candidates)
        parts = 1
        if len(candidates) > 1 and prompts > 1 and tokens > self.split_factor * fair:
            parts = min(len(candidates), prompts, math.ceil(tokens / fair))
        if parts == 1:
            return [(ranked[0], prompts)]
        base, extra = divmod(prompts, parts)
        return [(r, base + (1 if i < extra else 0)) for i, r in enumerate(ranked[:parts])]


    def route_parts(self, fleet, now, parts):
        """Each part goes where its own prefix is (the reference loses this: it sends a
        pooled batch with no key). Consecutive parts for one replica are merged. The cap
        admits the batch as a whole: parts are ranked among the replicas with room while
        any has room, then among all live ones (still by affinity: an admitted batch's
        tail must not scatter its prefixes)."""
        if not fleet.open(now):
            return None
        out: Assignments = []
        for prompts, tokens, key in parts:
            r = self.ranked(fleet, fleet.open(now) or fleet.live(now), key)[0]
            fleet.assign(r, prompts, tokens, key)
            if out and out[-1][0] is r:
                out[-1] = (r, out[-1][1] + prompts)
            else:
                out.append((r, prompts))
        return out


POLICIES = cfgmod.POLICIES


def make_policy(name: str, *, slack_tokens: int = 0, split_factor: float = 2.0) -> Policy:
    match name:
        case "round-robin":
            return RoundRobin()
        case "least-loaded":
            return LeastLoaded()
        case "daft":
            return Daft()
        case "prefix-aware":
            return PrefixAware(slack_tokens, split_factor)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
