"""What the router knows of one replica (`Replica`), and the check of the history-based
cache model against the KV-event one (`HistoryChecks`). Pure data: `fleet.Fleet` keeps
them up to date."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from prefixflow.services.router.adapters import Adapters
from prefixflow.services.router.prefix_index import NO_MATCH, Match


@dataclass
class HistoryChecks:
    """Where replicas send KV events, each decision also asks what the history-based model
    would have said: how often it is wrong about what a replica holds, and how often it
    would have preferred another replica (the precise model's gain, measured)."""

    decisions: int = 0
    wrong: int = 0
    """Decisions where the history's matched blocks differ from the cache's for some replica."""
    overestimated: int = 0
    """... of which the history believed more blocks held than the cache holds."""
    misplaced: int = 0
    """Decisions where the replicas with the longest match differ between the two models."""

    def compare(self, history: dict[str, Match], cached: dict[str, int]) -> None:
        """`history`: each replica's history match (blocks, recency); `cached`: the blocks
        its cache holds (replicas with no match left out of both)."""
        self.decisions += 1
        names = history.keys() | cached.keys()
        if any(history.get(n, NO_MATCH)[0] != cached.get(n, 0) for n in names):
            self.wrong += 1
            self.overestimated += any(history.get(n, NO_MATCH)[0] > cached.get(n, 0) for n in names)
        # The history's pick: the longest match, the most recent among equals.
        pick = max(history, key=history.__getitem__) if history else None
        top = max(cached.values(), default=0)
        if (pick is None) != (top == 0) or (pick is not None and cached.get(pick, 0) != top):
            self.misplaced += 1


@dataclass(eq=False)  # NOTE: a replica is an identity (a key of the prefix index), not a value
class Replica:
    name: str
    last_seen: float = 0.0
    ready: bool = False
    last_ready: float = 0.0
    """When it last reported ready (0: never): a replica not ready for `dead_after` (say,
    rebuilding its engine) has its queued work moved like a silent one."""
    outstanding: int = 0
    """Work tokens routed here and not yet completed."""
    done_tokens: int = 0
    """Last cumulative completed-work-token count the replica reported."""
    routed_prompts: int = 0
    """Prompts ever routed here (the reference's load measure; never decremented)."""
    kv_blocks: int = 0
    """KV-cache capacity in engine blocks, as the replica reports it (0: unknown)."""
    engine_block_size: int = 0
    """Tokens per engine KV block (16 on GPUs, 128 on CPU; 0: not reported)."""
    history_budget: int | None = None
    """Hash blocks of history the KV cache can hold: kv_blocks x engine_block_size //
    hash_block_size. None while no KV capacity is known (the fleet's key count applies)."""
    window: int = 0
    history: deque = field(default_factory=deque)
    """(prefix key, routing clock) of buckets routed here, most recent last. Change it
    only through `Fleet` (`assign`, `forget_history`): `Fleet.index` mirrors it."""
    history_blocks: int = 0
    """Hash blocks covered by `history` (kept within `history_budget`)."""
    cache_epoch: str = ""
    """The engine cache's epoch it last reported (`EngineStatus.cache_epoch`)."""
    drained: tuple[float, int] | None = None
    """(since when, `routed_prompts` then) while it reports holding nothing but the
    router counts work outstanding on it (see `Fleet.observe`)."""
    held: int = 0
    """Work tokens it last reported holding (0: it was idle)."""
    last_ts: float = 0.0
    """Its last status's timestamp, by its own clock."""
    rate: float = 0.0
    """Work tokens it completes per second while busy (measured; 0: not yet)."""
    busy_seconds: float = 0.0
    busy_done: int = 0
    """Busy time and completed work tokens before the first `rate` (`RATE_WARMUP`)."""
    decode_cost: float = 0.0
    """What an output token costs its engine in uncached prompt tokens, as it measured and
    reported it (0: not yet; the fleet's then stands in)."""
    adapters: Adapters = field(default_factory=Adapters)
    """The LoRA adapters it serves and holds work of (`adapters.py`)."""
