"""Routing policies: which replica(s) get a bucket. Pure logic, no I/O.

`Fleet` is the router's view of the replicas, fed by their status messages: liveness,
load (outstanding work tokens = routed minus completed, corrected by each status), KV
capacity, and a per-replica history of routed prefix keys. A policy turns a bucket
(prompt count, work tokens, prefix key) into assignments, or None when no live replica
has room (the router then answers retry-after).

Two block units meet here and are named apart: prefix keys are chains of *hash blocks*
(`hash_block_size` tokens each, the bucketers' key length), while an engine reports its
KV capacity `kv_blocks` in *engine blocks* of `engine_block_size` tokens (16 on GPUs,
128 on CPU). A replica's `history_budget` converts the one into the other.

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
ready, or hold their cap of outstanding work are never chosen. A replica's cap is a
bounded lead: its engine window of work plus `lead_seconds` of work at the rate it was
measured to complete work (`cap_windows` windows until it has been busy long enough to be
measured). What no replica has room for waits in the bucketers, where a job that comes
later gets its share of it and a replica that comes up later finds work.

Precise cache model: a replica that sends its KV-cache changes (`CacheEvents`, vLLM's KV
events translated to prefix block keys by its worker) is scored by the blocks it actually
holds (`block_index.BlockIndex`) instead of by its history; the others keep the history.
A bucket routed to such a replica counts as held there at once (its prefill will store
it, and the next bucket of that prefix must not go elsewhere meanwhile); the engine's
events then confirm it, or report its eviction.

Cost: the router decides for the whole fleet, so a decision is one pass over the
replicas plus one index lookup per block of the key (`PrefixIndex`, `BlockIndex`),
whatever the length of the histories; nothing sorts all replicas.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from services.router.block_index import BlockIndex
from services.router.hot import HotPrefixes, group_of, rendezvous
from shared.prefix.block_keys import HASH_BLOCK_SIZE
from shared.process import config as cfgmod
from shared.wire.messages import CacheOp

Key = tuple[int, ...]
NAME = attrgetter("name")
OUTSTANDING = attrgetter("outstanding")
Match = tuple[int, int]
"""(matched hash blocks, routing clock of the latest history entry matching that far)."""
NO_MATCH: Match = (0, 0)
MIN_SPLIT_PROMPTS = 8
"""A bucket is split into pieces of at least this many prompts (each piece recomputes
its prefix once)."""
MIN_HISTORY = 8
"""Keys kept per replica whatever the KV budget (the reference looks at the last 8)."""
RATE_WARMUP = 2.0
"""Busy seconds of a replica before its completion rate is taken as measured."""
RATE_TAU = 5.0
"""Time constant of the rate's moving average, seconds (completions come in waves)."""
BLOCK_INDEX_ENTRIES = 1 << 20
"""Default bound of the precise cache model, in (replica, block) entries (200-300 MB when
full, measured): 64 replicas of 16k hash blocks each (a 100k-block GPU cache of 16-token
blocks holds 12.5k of 128 tokens)."""


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


class _Prefix:
    """A node of `PrefixIndex`: one block-aligned prefix and the replicas holding it."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[Replica, list[int]] = {}
        """Replica -> [its history entries through this prefix, the latest one's clock]."""


class PrefixIndex:
    """Every replica's history indexed by prefix, so a match costs one dict lookup per
    block of the key (like vLLM's `find_longest_cache_hit`: stop at the first miss)
    instead of a comparison with every history entry of every replica.

    A prefix is identified by (its parent prefix, its last block hash). Keys built by
    `block_hashes` are hash chains, where the last hash alone would identify the prefix;
    interning the parent keeps the index exact for any keys (the tests use tiny
    alphabets) at the same cost of one lookup per block.

    Holding is prefix-closed (an entry through a prefix passes through all its
    ancestors), so a replica's match length for a key is the depth of the deepest prefix
    on the key's path that it holds, and the walk ends at the first prefix nobody holds.
    Each holder keeps the clock of its latest entry through the prefix: eviction is FIFO
    per replica, so that entry is the last of them to leave and the clock stays exact.
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[_Prefix | None, int], _Prefix] = {}

    def __len__(self) -> int:
        """Prefixes held by at least one replica."""
        return len(self._prefixes)

    def add(self, r: Replica, key: Key, stamp: int) -> None:
        parent = None
        for block in key:
            node = self._prefixes.get((parent, block))
            if node is None:
                node = self._prefixes[parent, block] = _Prefix()
            held = node.holders.get(r)
            if held is None:
                node.holders[r] = [1, stamp]
            else:
                held[0] += 1
                held[1] = stamp
            parent = node

    def remove(self, r: Replica, key: Key) -> None:
        """Drop one of r's entries for `key` (its oldest: history leaves in FIFO order)."""
        parent = None
        for block in key:
            node = self._prefixes[parent, block]
            held = node.holders[r]
            held[0] -= 1
            if not held[0]:
                del node.holders[r]
                if not node.holders:  # nobody holds it, hence none of its descendants
                    del self._prefixes[parent, block]
            parent = node

    def path(self, key: Sequence[int]) -> list[_Prefix]:
        """The key's prefixes that some replica holds, shortest first."""
        out: list[_Prefix] = []
        node = None
        for block in key:
            node = self._prefixes.get((node, block))
            if node is None:
                break
            out.append(node)
        return out

    def matches(self, key: Sequence[int]) -> dict[Replica, Match]:
        """The best history match of every replica that matches `key` by at least one
        block: its length and the clock of the latest entry matching that far. Costs
        one lookup per matched block plus the holders of those prefixes."""
        found: dict[Replica, Match] = {}
        for depth, node in enumerate(self.path(key), 1):
            for r, held in node.holders.items():
                found[r] = (depth, held[1])  # deeper prefixes overwrite shallower ones
        return found

    def best_match(self, r: Replica, key: Sequence[int]) -> Match:
        """r's best history match for `key`; NO_MATCH if none."""
        best = NO_MATCH
        for depth, node in enumerate(self.path(key), 1):
            held = node.holders.get(r)
            if held is None:
                break
            best = (depth, held[1])
        return best


class Fleet:
    def __init__(
        self,
        *,
        dead_after: float = 5.0,
        cap_tokens: int = 0,
        history: int = 64,
        cap_windows: float = 2.0,
        lead_seconds: float = 0.4,
        hash_block_size: int = HASH_BLOCK_SIZE,
        block_index_entries: int = BLOCK_INDEX_ENTRIES,
        settle: float = 3.0,
    ) -> None:
        self.dead_after = dead_after
        self.cap_tokens = cap_tokens
        """Fixed cap on outstanding work tokens per replica; 0: automatic."""
        self.cap_windows = cap_windows
        """Automatic cap until a replica's rate is measured: this many engine windows of
        average-sized prompts (also the prefix-aware policy's load slack)."""
        self.lead_seconds = lead_seconds
        """Automatic cap once its rate is measured: one engine window plus this many seconds
        of work at that rate."""
        self.history = history
        """Keys kept per replica while its KV capacity is unknown."""
        self.hash_block_size = hash_block_size
        """Tokens per block of a prefix key (the unit of `history_budget`)."""
        self.replicas: dict[str, Replica] = {}
        self._by_name: list[Replica] = []
        """`replicas` sorted by name, kept as replicas join (`live` filters, never sorts)."""
        self.index = PrefixIndex()
        self.avg_prompt_tokens = 0.0
        self.clock = itertools.count(1)
        """Global routing clock: history entries compare by recency across replicas."""
        self.blocks = BlockIndex(block_index_entries)
        """The precise cache model: blocks the replicas that send KV events hold."""
        self.precise: dict[str, tuple[str, int]] = {}
        """Replicas scored by `blocks`: name -> (epoch, last batch number) of their events."""
        self.cache_gaps = 0
        """Cache-event batches lost (the model may be wrong until the blocks turn over)."""
        self.history_checks = HistoryChecks()
        """How the history would have scored the replicas that send events (measured)."""
        self.settle = settle
        """Seconds a ready replica may report holding nothing, with nothing routed to it
        meanwhile, before the work still counted on it is written off as lost."""
        self.written_off = 0
        """Work tokens written off so far (see `write_off`)."""
        self.decode_cost = 1.0
        """An output token's cost in uncached prompt tokens across the fleet: the average of
        what the replicas report (1 until one does)."""

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
        engine_block_size: int = 0,
        cache_epoch: str = "",
        ts: float | None = None,
        decode_cost: float = 0.0,
    ) -> None:
        """Apply a status message: completed work leaves the outstanding count, which is
        never below what the replica itself reports in flight. `kv_blocks` counts engine
        blocks of `engine_block_size` tokens (0: not reported, taken as hash blocks). `ts`:
        when the replica wrote the status, by its clock (its rate is measured on that clock,
        not on when statuses arrive; default `now`). `decode_cost`: what an output token
        costs its engine in uncached prompt tokens, as it measured it (0: not yet). A new
        `cache_epoch` (its engine's cache started empty) forgets its history: its
        prefixes are no longer there."""
        r = self.replicas.get(name)
        if r is None:
            r = self.replicas[name] = Replica(name)
            bisect.insort(self._by_name, r, key=NAME)
        if done_tokens < r.done_tokens:  # the worker restarted: its own count is the truth
            r.outstanding = outstanding
            self.forget_cache(name)  # its events (if it still sends them) start a new epoch
            r.rate, r.busy_seconds, r.busy_done = 0.0, 0.0, 0
        else:
            if r.held and r.ready and ready:  # it held work since its last status: busy
                self.measure(r, (now if ts is None else ts) - r.last_ts, done_tokens - r.done_tokens)
            r.outstanding = max(r.outstanding - (done_tokens - r.done_tokens), outstanding, 0)
        r.done_tokens, r.held, r.last_ts = done_tokens, outstanding, now if ts is None else ts
        if cache_epoch and cache_epoch != r.cache_epoch:
            if r.cache_epoch:  # (KV events carry their own epochs)
                self.forget_history(r)
            r.cache_epoch = cache_epoch
        self.write_off(r, now, ready=ready, holds=outstanding)
        r.last_seen, r.ready, r.kv_blocks, r.window = now, ready, kv_blocks, window
        if ready:
            r.last_ready = now
        r.engine_block_size = engine_block_size
        if decode_cost > 0:
            r.decode_cost = decode_cost
            measured = [x.decode_cost for x in self.replicas.values() if x.decode_cost]
            self.decode_cost = sum(measured) / len(measured)
        if kv_blocks:
            kv_tokens = kv_blocks * (engine_block_size or self.hash_block_size)
            r.history_budget = kv_tokens // self.hash_block_size
        else:
            r.history_budget = None

    @staticmethod
    def measure(r: Replica, dt: float, done: int) -> None:
        """Fold `done` work tokens completed over `dt` busy seconds into r's rate: their
        average over the first `RATE_WARMUP` busy seconds, then a moving average."""
        if dt <= 0:
            return
        if not r.rate:
            r.busy_seconds += dt
            r.busy_done += done
            if r.busy_seconds >= RATE_WARMUP and r.busy_done > 0:
                r.rate = r.busy_done / r.busy_seconds
            return
        r.rate += min(dt / RATE_TAU, 1.0) * (done / dt - r.rate)

    def write_off(self, r: Replica, now: float, *, ready: bool, holds: int) -> None:
        """Heal the outstanding count: work routed to a replica that never reaches it
        (the bucketer's publish failed after routing, a reply lost past the router's
        memory of answers) is never completed, and would keep the replica at its cap
        for good. A ready replica
        that holds nothing pulls whatever its queue has; when it has held nothing for
        `settle` seconds and nothing was routed to it meanwhile, its queue is empty and
        what the router still counts on it is lost: written off."""
        if not ready or holds or not r.outstanding:
            r.drained = None
        elif r.drained is None or r.drained[1] != r.routed_prompts:
            r.drained = (now, r.routed_prompts)
        elif now - r.drained[0] >= self.settle:
            self.written_off += r.outstanding
            r.outstanding, r.drained = 0, None

    def is_live(self, r: Replica, now: float) -> bool:
        return r.ready and now - r.last_seen < self.dead_after

    def by_name(self) -> list[Replica]:
        """All replicas, by name: kept sorted as they join (never sorted per decision)."""
        if len(self._by_name) != len(self.replicas):  # a replica added other than by observe
            self._by_name = sorted(self.replicas.values(), key=NAME)
        return self._by_name

    def live(self, now: float) -> list[Replica]:
        """Ready replicas heard from within `dead_after`, by name."""
        dead_after = self.dead_after  # NOTE: `is_live` inlined: a pass per decision
        return [r for r in self.by_name() if r.ready and now - r.last_seen < dead_after]

    def cap(self, r: Replica) -> float:
        """Outstanding work tokens r may hold: the fixed cap, else its bounded lead."""
        if self.cap_tokens:
            return self.cap_tokens
        if r.window and self.avg_prompt_tokens:
            return self._lead_cap(r, self.avg_prompt_tokens)
        return math.inf

    def _lead_cap(self, r: Replica, avg: float) -> float:
        if r.rate:
            return r.window * avg + self.lead_seconds * r.rate
        return self.cap_windows * r.window * avg

    def window_cap(self, r: Replica) -> float:
        """`cap_windows` engine windows of average prompts (inf while unknown)."""
        if r.window and self.avg_prompt_tokens:
            return self.cap_windows * r.window * self.avg_prompt_tokens
        return math.inf

    def hungry(self, r: Replica) -> bool:
        """Outstanding work below one engine window: the replica is about to run dry."""
        return bool(r.window and self.avg_prompt_tokens) and r.outstanding < r.window * self.avg_prompt_tokens

    def is_open(self, r: Replica, now: float) -> bool:
        """Live with room for more work."""
        return self.is_live(r, now) and r.outstanding < self.cap(r)

    def open(self, now: float) -> list[Replica]:
        """Live replicas with room for more work, by name."""
        # NOTE: `is_live` and `cap` inlined: this pass over every replica runs for every
        # decision.
        dead_after, avg, lead_cap = self.dead_after, self.avg_prompt_tokens, self._lead_cap
        if self.cap_tokens or not avg:
            cap = self.cap_tokens or math.inf  # the same for every replica
            return [r for r in self.by_name() if r.ready and now - r.last_seen < dead_after and r.outstanding < cap]
        return [
            r
            for r in self.by_name()
            if r.ready and now - r.last_seen < dead_after and (not r.window or r.outstanding < lead_cap(r, avg))
        ]

    def assign(self, r: Replica, prompts: int, tokens: int, key: Sequence[int]) -> None:
        r.outstanding += tokens
        r.routed_prompts += prompts
        if prompts:
            self.avg_prompt_tokens = 0.9 * self.avg_prompt_tokens + 0.1 * (tokens / prompts) if self.avg_prompt_tokens else tokens / prompts
        if key:
            if r.name in self.precise:
                self.blocks.stored(r.name, key)  # held there once its prefill runs
            entry = tuple(key)
            stamp = next(self.clock)
            r.history.append((entry, stamp))
            self.index.add(r, entry, stamp)
            r.history_blocks += len(entry)
            while len(r.history) > MIN_HISTORY and (
                r.history_blocks > r.history_budget if r.history_budget is not None else len(r.history) > self.history
            ):
                old, _ = r.history.popleft()
                self.index.remove(r, old)
                r.history_blocks -= len(old)

    def assign_all(self, placed: Sequence[tuple[Replica, int]], costs: Sequence[int], key: Sequence[int]) -> None:
        """`assign` a bucket's pieces, each with its cost."""
        for (r, n), cost in zip(placed, costs, strict=True):
            self.assign(r, n, cost, key)

    def estimate(self, prompts: int, tokens: int, output: int, key: Sequence[int]) -> int:
        """The engine cost of a bucket wherever it goes (nothing of it cached yet): see
        `charge`. `output` < 0 (not told): its `tokens`."""
        if output < 0:
            return tokens
        return self._cost(prompts, prompts, tokens, output, key, 0, self.decode_cost)

    def charge(self, r: Replica, n: int, prompts: int, tokens: int, output: int, key: Sequence[int]) -> int:
        """What `n` of a bucket's `prompts` prompts (`tokens` work tokens of which `output`
        output budget, common prefix `key`) cost replica r, in uncached prompt tokens:
        cached prompt tokens are free (the part of the prefix r holds, and for all but the
        first of the n the whole common prefix: the first computes it), each output token
        costs r's measured `decode_cost`. Ask before `assign`: it counts what r held
        before. `output` < 0 (not told): the n prompts' share of `tokens`."""
        if output < 0:
            return tokens * n // max(prompts, 1)
        held = self.best_match(r, key)[0] * self.hash_block_size if key else 0
        return self._cost(n, prompts, tokens, output, key, held, r.decode_cost or self.decode_cost)

    def _cost(self, n: int, prompts: int, tokens: int, output: int, key: Sequence[int], held: int,
              decode_cost: float) -> int:
        prompt_tokens = (tokens - output) * n / prompts
        per_prompt = (tokens - output) / prompts
        shared = max(0.0, min(len(key) * self.hash_block_size, per_prompt - 1))  # the last token is always computed
        uncached = max(prompt_tokens - (n - 1) * shared - min(held, shared), n)
        return round(uncached + decode_cost * output * n / prompts)

    def charges(self, placed: Sequence[tuple[Replica, int]], prompts: int, tokens: int, output: int,
                key: Sequence[int]) -> list[int]:
        """`charge` for each piece of a bucket (the shares of `tokens` add up to it when
        `output` is not told)."""
        costs = [self.charge(r, n, prompts, tokens, output, key) for r, n in placed]
        if output < 0 and costs:
            costs[-1] += tokens - sum(costs)
        return costs

    def best_match(self, r: Replica, key: Sequence[int]) -> Match:
        """(matched hash blocks, routing clock) of r's best history entry for `key`:
        the longest match, the most recent among equals; NO_MATCH if none. For a replica
        that sends KV events: (blocks of `key` its cache holds, 0)."""
        if not key:
            return NO_MATCH
        if r.name in self.precise:
            n = self.blocks.longest_match(key).get(r.name, 0)
            return (n, 0) if n else NO_MATCH
        return self.index.best_match(r, key)

    def matches(self, key: Sequence[int]) -> dict[Replica, Match]:
        """Every replica's match for `key` (as `best_match`) that is at least one block:
        by its cache for the replicas that send KV events, by its history for the others."""
        found = self.index.matches(key)
        if not self.precise:
            return found
        history = {r.name: match for r, match in found.items() if r.name in self.precise}
        found = {r: match for r, match in found.items() if r.name not in self.precise}
        cached = {}
        for name, n in self.blocks.longest_match(key).items():
            r = self.replicas.get(name)
            if r is not None and name in self.precise:
                found[r] = (n, 0)
                cached[name] = n
        self.history_checks.compare(history, cached)
        return found

    def apply_cache_events(self, replica: str, epoch: str, seq: int, ops: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Apply a replica's `CacheEvents`: from now on it is scored by what it holds. A
        new epoch (a new worker) starts from nothing; a lost batch is counted (the model
        then heals as blocks are stored and removed, and its bound evicts what a lost
        removal left behind)."""
        known = self.precise.get(replica)
        if known is None or known[0] != epoch:
            self.blocks.cleared(replica)
        elif seq != known[1] + 1:
            self.cache_gaps += max(seq - known[1] - 1, 1)
        self.precise[replica] = (epoch, seq)
        for op, keys in ops:
            if op == CacheOp.STORED:
                self.blocks.stored(replica, keys)
            elif op == CacheOp.REMOVED:
                self.blocks.removed(replica, keys)
            elif op == CacheOp.CLEARED:
                self.blocks.cleared(replica)

    def forget_cache(self, name: str) -> None:
        """Stop scoring `name` by KV events (until it sends a new epoch of them)."""
        if self.precise.pop(name, None) is not None:
            self.blocks.cleared(name)

    def room(self, now: float) -> float:
        """Work tokens the open replicas can take before reaching their caps."""
        return sum(max(0.0, self.cap(r) - r.outstanding) for r in self.open(now))

    def forget_history(self, *replicas: Replica) -> None:
        """Forget the prefix history of these replicas (of all when none are given)."""
        for r in replicas or self.replicas.values():
            while r.history:
                self.index.remove(r, r.history.popleft()[0])
            r.history_blocks = 0


Assignments = list[tuple[Replica, int]]
Part = tuple  # (prompts, tokens, key) or (prompts, tokens, key, output)


def part_output(part: Part) -> int:
    """A route part's output budget (-1: not told)."""
    return part[3] if len(part) > 3 else -1


class Policy:
    name = "base"
    eager = True
    """Whether the bucketer may release buckets early when replicas have room (the
    reference does not: `Daft` sets it False)."""
    last_matches: list[int] = []
    """Of the last decision (for metrics): for each prefix-keyed bucket or part routed,
    the hash blocks of its key the chosen replica's history held before it."""
    last_costs: list[int] = []
    """Of the last decision: what each returned assignment was charged (`Fleet.charge`)."""

    def route(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int],
              output: int = -1) -> Assignments | None:
        """Pick replicas for a bucket and record the assignment in `fleet`: its load is its
        engine cost (`Fleet.estimate` to choose, `Fleet.charge` on the replicas chosen)
        once `output`, the output budget among its `tokens`, is told."""
        self.last_matches = []
        self.last_costs = []
        chosen = self.choose(fleet, now, prompts, fleet.estimate(prompts, tokens, output, key), key)
        if not chosen:
            return None
        if key:
            self.last_matches = [fleet.best_match(r, key)[0] for r, _ in chosen]
        self.last_costs = fleet.charges(chosen, prompts, tokens, output, key)
        fleet.assign_all(chosen, self.last_costs, key)
        return chosen

    def choose(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int]) -> Assignments | None:
        raise NotImplementedError

    def route_parts(
        self, fleet: Fleet, now: float, parts: Sequence[Part], key: Sequence[int] = ()
    ) -> Assignments | None:
        """Route a batch given its parts as (prompts, tokens, key[, output]): a pooled
        batch (no `key`), or a keyed bucket whose prompts share longer prefixes in groups.
        Baselines and the reference route it as one batch with the bucket's key."""
        outputs = [part_output(p) for p in parts]
        output = -1 if any(o < 0 for o in outputs) else sum(outputs)
        return self.route(fleet, now, sum(p[0] for p in parts), sum(p[1] for p in parts), list(key), output)


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return [(candidates[next(self._counter) % len(candidates)], prompts)]


def by_load(r: Replica) -> tuple[int, str]:
    """Least loaded first, ties by name."""
    return r.outstanding, r.name


def least_loaded(replicas: Sequence[Replica], *, last: bool = False) -> Replica:
    """The least loaded replica, ties to the first name (with `last`, the last name).
    Two C-speed passes instead of a key call per replica: it runs over the whole fleet
    for every decision."""
    low = min(map(OUTSTANDING, replicas))
    tied = (r for r in replicas if r.outstanding == low)
    return max(tied, key=NAME) if last else min(tied, key=NAME)


class LeastLoaded(Policy):
    name = "least-loaded"

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return [(least_loaded(candidates), prompts)]


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
            # The last 8 keys only, read from the end (the history may be far longer).
            for past, stamp in itertools.islice(reversed(r.history), self.HISTORY):
                if past == wanted and stamp > best_stamp:
                    best, best_stamp = r, stamp
        return [(best or least, prompts)]


class PrefixAware(Policy):
    name = "prefix-aware"

    def __init__(self, slack_tokens: int = 0, split_factor: float = 2.0, hot_factor: float = 1.0) -> None:
        self.hot = HotPrefixes(factor=hot_factor) if hot_factor > 0 else None
        """Recent work per prefix group: a group past `hot_factor` fair shares is spread
        over the replicas its work needs (`hot.py`; None: never)."""
        self.slack_tokens = slack_tokens
        """Load slack within which a prefix match beats a lighter replica (0: automatic,
        the replica's fixed cap, else `cap_windows` of its windows, or 64k tokens). NOTE: half a cap proved too little once the
        feed window adapts to a small KV cache: balancing then overrode affinity."""
        self.split_factor = split_factor

    def slack(self, fleet: Fleet, r: Replica) -> float:
        if self.slack_tokens:
            return self.slack_tokens
        cap = fleet.cap_tokens or fleet.window_cap(r)
        return cap if math.isfinite(cap) else 65536

    def within_slack(self, fleet: Fleet, candidates: list[Replica]) -> list[Replica]:
        """Candidates within their slack of the least loaded."""
        floor = min(map(OUTSTANDING, candidates))
        if self.slack_tokens or fleet.cap_tokens or not fleet.avg_prompt_tokens:
            limit = floor + self.slack(fleet, candidates[0])  # the same for every replica
            return [r for r in candidates if r.outstanding <= limit]
        # NOTE: `slack` inlined for the automatic caps (a pass over every replica).
        cap_windows, avg = fleet.cap_windows, fleet.avg_prompt_tokens
        return [r for r in candidates if r.outstanding <= floor + (cap_windows * r.window * avg if r.window else 65536)]

    def ranked(self, fleet: Fleet, candidates: list[Replica], key: Sequence[int], n: int = 1) -> list[Replica]:
        """The `n` most preferred candidates, best first. Eligible replicas (within slack
        of the least loaded) come first: by longest match, most recent, least loaded (then
        name, descending); if no eligible replica matches, by load. The others follow, by
        load. Affinity never starves a replica: while one is hungry (under one window of
        work) and the best match is not, only hungry replicas are eligible.

        A few passes over the candidates plus the prefix index's walk of the key: only
        the `n` first are ordered (`n` > 1 only for a split), never the whole fleet."""
        eligible = self.within_slack(fleet, candidates)
        matches = fleet.matches(key) if key else {}
        if matches:
            is_eligible = set(eligible)
            matches = {r: m for r, m in matches.items() if r in is_eligible}

        def by_match(r: Replica) -> tuple[Match, int, str]:
            return matches.get(r, NO_MATCH), -r.outstanding, r.name

        # The top of the eligible by `by_match` (with no match: least loaded, last name).
        first = max(matches, key=by_match) if matches else least_loaded(eligible, last=True)
        if not fleet.hungry(first) and fleet.avg_prompt_tokens:
            avg = fleet.avg_prompt_tokens  # NOTE: `hungry` inlined (a pass over every replica)
            hungry = [r for r in eligible if r.window and r.outstanding < r.window * avg]
            if hungry:
                eligible = hungry
                matches = {r: m for r, m in matches.items() if fleet.hungry(r)}
        if n == 1:
            return [max(matches, key=by_match) if matches else least_loaded(eligible)]
        if matches:
            top = heapq.nlargest(n, eligible, key=by_match)
        else:
            top = heapq.nsmallest(n, eligible, key=by_load)
        if len(top) < n:
            is_eligible = set(eligible)
            top += heapq.nsmallest(n - len(top), (r for r in candidates if r not in is_eligible), key=by_load)
        return top

    def pieces(self, candidates: list[Replica], prompts: int, tokens: int) -> int:
        """Over how many replicas a bucket is split: one, unless its work exceeds
        `split_factor` times what each candidate holds on average; then into pieces of
        about that average (each recomputes the prefix once; all stay busy), at least
        `MIN_SPLIT_PROMPTS` prompts each. On an idle fleet any bucket that large is split."""
        n = len(candidates)
        if n < 2 or prompts < 2 * MIN_SPLIT_PROMPTS:
            return 1
        share = sum(map(OUTSTANDING, candidates)) / n
        if tokens <= self.split_factor * share:
            return 1
        return max(1, min(n, prompts // MIN_SPLIT_PROMPTS, math.ceil(tokens / share) if share else n))

    def choose(self, fleet, now, prompts, tokens, key):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return self.place(fleet, candidates, prompts, tokens, key, now)

    def spread(self, fleet: Fleet, candidates: list[Replica], tokens: int, key: Sequence[int],
               now: float) -> list[Replica] | None:
        """For a hot group (`hot.py`): the candidates of its rendezvous set, as many live
        replicas as its recent work needs (all candidates if none of the set is one);
        None for any other bucket."""
        if self.hot is None or not key:
            return None
        group = group_of(key)
        live = fleet.live(now)
        k = self.hot.replicas_needed(group, tokens, len(live), now)
        self.hot.add(group, tokens, now)
        if k <= 1:
            return None
        members = {id(r) for r in rendezvous(group, ((r.name, r) for r in live), k)}
        return [r for r in candidates if id(r) in members] or candidates

    def place(self, fleet: Fleet, candidates: list[Replica], prompts: int, tokens: int, key: Sequence[int],
              now: float = 0.0) -> Assignments:
        """(replica, prompts) for one bucket among `candidates`: its best replica, or the
        best `pieces` of them for a bucket far larger than the work they hold. A hot
        group's bucket goes to the least loaded replicas of its set instead: each of them
        holds the prefix after its first piece, so load decides, not the match."""
        hot_set = self.spread(fleet, candidates, tokens, key, now)
        if hot_set is not None:
            parts = self.pieces(hot_set, prompts, tokens)
            ranked = heapq.nsmallest(parts, hot_set, key=by_load)
        else:
            parts = self.pieces(candidates, prompts, tokens)
            ranked = self.ranked(fleet, candidates, key, parts)
        if parts == 1:
            return [(ranked[0], prompts)]
        base, extra = divmod(prompts, parts)
        return [(r, base + (1 if i < extra else 0)) for i, r in enumerate(ranked)]

    def route_parts(self, fleet, now, parts, key=()):
        """Each part goes where its own prefix is (the reference loses this: it sends a
        pooled batch with no key, and a keyed bucket by its shortest common prefix, say
        the system prompt every row of a labelling job shares, where its parts are the
        few-shot groups under it). A part far larger than the work the replicas hold is
        split like a bucket. Consecutive parts for one replica are merged. The cap admits
        the batch as a whole: parts are ranked among the replicas with room while any has
        room, then among all live ones (still by affinity: an admitted batch's tail must
        not scatter its prefixes). Each part is one decision (it sees the load and history
        the previous parts left)."""
        self.last_matches = []
        self.last_costs = []
        candidates = fleet.open(now)
        if not candidates:
            return None
        out: Assignments = []
        for i, part in enumerate(parts):
            prompts, tokens, part_key = part[:3]
            output = part_output(part)
            if i:  # the previous part changed loads (and caps, through the average prompt)
                candidates = fleet.open(now) or fleet.live(now)
            placed = self.place(fleet, candidates, prompts, fleet.estimate(prompts, tokens, output, part_key),
                                part_key, now)
            if part_key:
                self.last_matches += [fleet.best_match(r, part_key)[0] for r, _ in placed]
            costs = fleet.charges(placed, prompts, tokens, output, part_key)
            fleet.assign_all(placed, costs, part_key)
            extend_merged(out, placed, self.last_costs, costs)
        return out


def extend_merged(out: Assignments, placed: Assignments, out_costs: list[int], costs: Sequence[int]) -> None:
    """Append assignments to `out` (and their costs to `out_costs`), merging one for the
    replica `out` ends with."""
    for (r, n), cost in zip(placed, costs, strict=True):
        if out and out[-1][0] is r:
            out[-1] = (r, out[-1][1] + n)
            out_costs[-1] += cost
        else:
            out.append((r, n))
            out_costs.append(cost)


POLICIES = cfgmod.POLICIES


def make_policy(name: str, *, slack_tokens: int = 0, split_factor: float = 2.0, hot_factor: float = 1.0) -> Policy:
    match name:
        case "round-robin":
            return RoundRobin()
        case "least-loaded":
            return LeastLoaded()
        case "daft":
            return Daft()
        case "prefix-aware":
            return PrefixAware(slack_tokens, split_factor, hot_factor)
    raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}")
