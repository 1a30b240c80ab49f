"""Routing policies: which replica gets a bucket. Pure logic, no I/O.

`Fleet` is the router's view of the replicas: liveness from status messages, load as
outstanding prompt tokens (routed minus completed, corrected upward by each status), and
a bounded history of the prefix keys routed to each replica. A policy maps a bucket to
assignments over the fleet, or to None when every live replica is at its cap.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.prefix_keys import matched_blocks


@dataclass
class Replica:
    name: str
    last_seen: float = 0.0
    ready: bool = False
    outstanding: int = 0
    """Prompt tokens routed here and not yet completed."""
    done_tokens: int = 0
    """Last cumulative completed-token count the replica reported."""
    kv_blocks: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=64))
    """Prefix keys routed here, most recent last."""


class Fleet:
    def __init__(self, *, dead_after: float = 5.0, cap_tokens: int = 2_000_000, history: int = 64) -> None:
        self.dead_after = dead_after
        self.cap_tokens = cap_tokens
        self.history = history
        self.replicas: dict[str, Replica] = {}

    def observe(self, name: str, now: float, *, ready: bool, outstanding: int, done_tokens: int, kv_blocks: int) -> None:
        """Apply a status message."""
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = Replica(name, history=deque(maxlen=self.history))
        completed = done_tokens - r.done_tokens if done_tokens >= r.done_tokens else done_tokens
        r.done_tokens = done_tokens
        r.outstanding = max(r.outstanding - completed, outstanding, 0)
        r.last_seen, r.ready, r.kv_blocks = now, ready, kv_blocks

    def live(self, now: float) -> list[Replica]:
        return sorted(
            (r for r in self.replicas.values() if r.ready and now - r.last_seen < self.dead_after),
            key=lambda r: r.name,
        )

    def assign(self, replica: Replica, tokens: int, key: Sequence[int]) -> None:
        replica.outstanding += tokens
        if key:
            replica.history.append(tuple(key))


class Policy:
    name = "base"

    def choose(self, fleet: Fleet, now: float, tokens: int, key: Sequence[int]) -> Replica | None:
        raise NotImplementedError

    def route(self, fleet: Fleet, now: float, tokens: int, key: Sequence[int]) -> Replica | None:
        replica = self.choose(fleet, now, tokens, key)
        if replica is not None:
            fleet.assign(replica, tokens, key)
        return replica


def _open(fleet: Fleet, now: float) -> list[Replica]:
    """Live replicas below their cap."""
    return [r for r in fleet.live(now) if r.outstanding < fleet.cap_tokens]


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, fleet, now, tokens, key):
        candidates = _open(fleet, now)
        if not candidates:
            return None
        return candidates[next(self._counter) % len(candidates)]


class LeastLoaded(Policy):
    name = "least-loaded"

    def choose(self, fleet, now, tokens, key):
        candidates = _open(fleet, now)
        return min(candidates, key=lambda r: (r.outstanding, r.name)) if candidates else None


def best_match(replica: Replica, key: Sequence[int]) -> tuple[int, int]:
    """(matched blocks, recency) of the best history entry for `key`."""
    best = (0, -1)
    for recency, past in enumerate(replica.history):
        score = (matched_blocks(key, past), recency)
        if score > best:
            best = score
    return best


class PrefixAware(Policy):
    """Among open replicas within `slack` tokens of the least loaded, the one whose
    history holds the longest block-prefix match (ties: most recent, then least
    loaded); no match anywhere: the least loaded."""

    name = "prefix-aware"

    def __init__(self, slack_tokens: int = 65536) -> None:
        self.slack = slack_tokens

    def choose(self, fleet, now, tokens, key):
        candidates = _open(fleet, now)
        if not candidates:
            return None
        floor = min(r.outstanding for r in candidates)
        eligible = [r for r in candidates if r.outstanding <= floor + self.slack]
        if key:
            scored = [(best_match(r, key), -r.outstanding, r.name, r) for r in eligible]
            (blocks, _), _, _, winner = max(scored, key=lambda s: s[:3])
            if blocks > 0:
                return winner
        return min(eligible, key=lambda r: (r.outstanding, r.name))


def make_policy(name: str, *, slack_tokens: int = 65536) -> Policy:
    match name:
        case "round-robin":
            return RoundRobin()
        case "least-loaded":
            return LeastLoaded()
        case "prefix-aware":
            return PrefixAware(slack_tokens)
    raise ValueError(f"unknown policy {name!r}")
