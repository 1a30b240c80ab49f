"""The router's view of the replicas. Pure logic, no I/O.

`Fleet` is fed by the replicas' status messages: liveness, load (outstanding engine cost
= charged minus completed, corrected by each status), KV capacity, and a per-replica
history of routed prefix keys (`prefix_index.PrefixIndex`), or for replicas that send
their KV events the blocks they hold (`block_index.BlockIndex`). The policies
(`policies.py`) choose replicas from it.

Load in engine cost (`Fleet.charge`): a bucket costs the replica chosen for it its
uncached prompt tokens (its common prefix once, less what that replica holds, and each
prompt's own suffix) plus its output budget at what an output token costs that replica's
engine, in prompt tokens (`decode_cost`, measured by each engine-worker:
`prefixflow/services/engine_worker/cost_fit.py`). The charge travels with the prompts and comes back
as done work in the same unit.

Two block units meet here and are named apart: prefix keys are chains of *hash blocks*
(`hash_block_size` tokens each, the bucketers' key length), while an engine reports its
KV capacity `kv_blocks` in *engine blocks* of `engine_block_size` tokens (16 on GPUs,
128 on CPU). A replica's `history_budget` converts the one into the other.

Flow control is the same for every policy: replicas that stopped reporting, are not
ready, or hold their cap of outstanding work are never chosen. A replica's cap is a
bounded lead: its engine window of work plus `lead_seconds` of work at the rate it was
measured to complete work (`start_windows` windows until it has been busy long enough to
be measured). What no replica has room for waits in the bucketers, where a job that comes
later gets its share of it and a replica that comes up later finds work; a bucket larger
than its replica's room is cut to it, the rest handed back to its bucketer
(`assignments.fit_room`).

Precise cache model: a replica that sends its KV-cache changes (`CacheEvents`, vLLM's KV
events translated to prefix block keys by its worker) is scored by the blocks it actually
holds (`block_index.BlockIndex`) instead of by its history; the others keep the history.
A bucket routed to such a replica counts as held there at once (its prefill will store
it, and the next bucket of that prefix must not go elsewhere meanwhile); the engine's
events then confirm it, or report its eviction.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from operator import attrgetter

from prefixflow.services.router.block_index import BlockIndex
from prefixflow.services.router.prefix_index import NO_MATCH, Match, PrefixIndex
from prefixflow.services.router.replica import HistoryChecks, Replica
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE
from prefixflow.shared.wire.messages import CacheOp

NAME = attrgetter("name")
OUTSTANDING = attrgetter("outstanding")
MIN_HISTORY = 8
RATE_WARMUP = 2.0
RATE_TAU = 5.0
BLOCK_INDEX_ENTRIES = 1 << 20


class Fleet:
    def __init__(
        self,
        *,
        dead_after: float = 5.0,
        cap_tokens: int = 0,
        history: int = 64,
        cap_windows: float = 2.0,
        start_windows: float = 1.0,
        lead_seconds: float = 0.4,
        hash_block_size: int = HASH_BLOCK_SIZE,
        block_index_entries: int = BLOCK_INDEX_ENTRIES,
        settle: float = 3.0,
    ) -> None:
        self.dead_after = dead_after
        self.cap_tokens = cap_tokens
        """Fixed cap on outstanding work tokens per replica; 0: automatic."""
        self.cap_windows = cap_windows
        """The prefix-aware policy's load slack: this many engine windows of average-sized
        prompts (`window_cap`)."""
        self.start_windows = start_windows
        """Automatic cap until a replica's rate is measured: this many engine windows of
        average-sized prompts. (Two let every replica that came up grab two windows - on a
        GPU several rounds of the work it runs at once - before its first results
        measured its rate: on a fleet starting over 30-120 s the last replicas found the
        job queued on the first.)"""
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
        self._decode_sum, self._decode_n = 0.0, 0
        """Sum and count of the replicas' measured `decode_cost` (for the average)."""

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
        adapters: Sequence[str] = (),
        lora_slots: int = 0,
        loras: dict[str, int] | None = None,
    ) -> None:
        """Apply a status message: completed work leaves the outstanding count, which is
        never below what the replica itself reports in flight. `kv_blocks` counts engine
        blocks of `engine_block_size` tokens (0: not reported, taken as hash blocks). `ts`:
        when the replica wrote the status, by its clock (its rate is measured on that clock,
        not on when statuses arrive; default `now`). `decode_cost`: what an output token
        costs its engine in uncached prompt tokens, as it measured it (0: not yet).
        `adapters`, `lora_slots`, `loras`: the LoRA adapters it serves, how many its engine
        runs at once, the prompts it holds per adapter (`adapters.py`). A new
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
        r.adapters.observe(adapters, lora_slots, loras or {})
        if decode_cost > 0:  # the fleet's average, kept as a sum (a status is no pass over the fleet)
            self._decode_sum += decode_cost - r.decode_cost
            self._decode_n += not r.decode_cost
            r.decode_cost = decode_cost
            self.decode_cost = self._decode_sum / self._decode_n
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
        return self.start_windows * r.window * avg

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

    def assign(self, r: Replica, prompts: int, tokens: int, key: Sequence[int], lora: str = "") -> None:
        r.outstanding += tokens
        r.routed_prompts += prompts
        r.adapters.assign(lora, prompts)
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

    def assign_all(self, placed: Sequence[tuple[Replica, int]], costs: Sequence[int], key: Sequence[int],
                   lora: str = "") -> None:
        """`assign` a bucket's pieces, each with its cost."""
        for (r, n), cost in zip(placed, costs, strict=True):
            self.assign(r, n, cost, key, lora)

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
        if output < 0 and costs and sum(n for _, n in placed) == prompts:
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
