"""Routing policies: which replica(s) get a bucket. Pure logic, no I/O.

A policy turns a bucket (prompt count, load, prefix key) into assignments among the
replicas `fleet.Fleet` says are open, or None when no live replica has room (the router
then answers retry-after); `Policy.route` charges each assignment its engine cost
(`Fleet.charge`) and records it in the fleet.

Policies:
- `round-robin`, `least-loaded`: baselines.
- `daft`: the reference (Daft's vllm-prefix-caching provider) exactly: load is the
  cumulative number of prompts ever routed; eligible replicas have load < min + 256;
  among them the one whose last 8 routed keys hold this exact key most recently; a
  keyless batch (or no match) goes to the least loaded.
- `prefix-aware` (default): load is outstanding engine cost; eligible replicas are within
  `slack` of the least loaded; the score is the longest block-prefix match against
  a history sized like the replica's KV cache (so a partial match counts, and a prefix
  the cache has surely evicted does not); ties go to the most recent, then the least
  loaded; affinity never starves a replica (while one holds less than one engine window
  of work, a busier best match is passed over); a bucket larger than `split_factor` x a
  replica's fair share is split; a hot prefix group is spread (`hot.py`); asked by a
  bucketer, it places no more of a bucket on a replica than its room (at least a minimum
  piece) and hands the rest back (`assignments.fit_room`: bounded lead).

Cost: the router decides for the whole fleet, so a decision is one pass over the
replicas plus one index lookup per block of the key (`PrefixIndex`, `BlockIndex`),
whatever the length of the histories; nothing sorts all replicas.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from prefixflow.services.router.adapters import adapter_candidates, spare_slots, spread_cold
from prefixflow.services.router.assignments import Assignments, commit, extend_merged, fit_room
from prefixflow.services.router.fleet import NAME, OUTSTANDING, Fleet, Replica
from prefixflow.services.router.hot import HotPrefixes, group_of, rendezvous
from prefixflow.services.router.prefix_index import NO_MATCH, Match
from prefixflow.shared.process import config as cfgmod

MIN_SPLIT_PROMPTS = 8


Part = tuple  # (prompts, tokens, key[, output[, lora]])


def part_output(part: Part) -> int:
    """A route part's output budget (-1: not told)."""
    return part[3] if len(part) > 3 else -1


def part_lora(part: Part) -> str:
    """A route part's LoRA adapter (empty: the base model)."""
    return part[4] if len(part) > 4 else ""


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
    defers = False
    """Whether it bounds each replica's lead when the asker can take prompts back
    (`fit_room`): the product's policy does; the baselines and the reference do not."""

    def route(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int],
              output: int = -1, lora: str = "", defer: bool = False) -> Assignments | None:
        """Pick replicas for a bucket and record the assignment in `fleet`: its load is its
        engine cost (`Fleet.estimate` to choose, `Fleet.charge` on the replicas chosen)
        once `output`, the output budget among its `tokens`, is told. `lora`: its LoRA
        adapter (empty: the base model). `defer`: the asker takes back what the chosen
        replicas have no room for (a bucketer): with a policy that bounds the lead
        (`defers`), such prompts come back as a (None, n) assignment (`fit_room`)."""
        self.last_matches = []
        self.last_costs = []
        chosen = self.choose(fleet, now, prompts, fleet.estimate(prompts, tokens, output, key), key, lora)
        if not chosen:
            return None
        if defer and self.defers:
            chosen = fit_room(fleet, chosen, prompts, tokens, output, key)
        self.last_matches, self.last_costs = commit(fleet, chosen, prompts, tokens, output, key, lora)
        return chosen

    def choose(self, fleet: Fleet, now: float, prompts: int, tokens: int, key: Sequence[int],
               lora: str = "") -> Assignments | None:
        raise NotImplementedError

    def route_parts(
        self, fleet: Fleet, now: float, parts: Sequence[Part], key: Sequence[int] = (), defer: bool = False
    ) -> Assignments | None:
        """Route a batch given its parts as (prompts, tokens, key[, output]): a pooled
        batch (no `key`), or a keyed bucket whose prompts share longer prefixes in groups.
        Baselines and the reference route it as one batch with the bucket's key (and the
        adapter of its parts, when they share one)."""
        outputs = [part_output(p) for p in parts]
        output = -1 if any(o < 0 for o in outputs) else sum(outputs)
        loras = {part_lora(p) for p in parts}
        return self.route(fleet, now, sum(p[0] for p in parts), sum(p[1] for p in parts), list(key), output,
                          loras.pop() if len(loras) == 1 else "", defer)


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, fleet, now, prompts, tokens, key, lora=""):
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

    def choose(self, fleet, now, prompts, tokens, key, lora=""):
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

    def choose(self, fleet, now, prompts, tokens, key, lora=""):
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
    defers = True

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

    def choose(self, fleet, now, prompts, tokens, key, lora=""):
        candidates = fleet.open(now)
        if not candidates:
            return None
        return self.place(fleet, candidates, prompts, tokens, key, now, lora)

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
              now: float = 0.0, lora: str = "") -> Assignments:
        """(replica, prompts) for one bucket among `candidates`: its best replica, or the
        best `pieces` of them for a bucket far larger than the work they hold. A hot
        group's bucket goes to the least loaded replicas of its set instead: each of them
        holds the prefix after its first piece, so load decides, not the match. A LoRA
        adapter's bucket goes among the candidates that have the adapter's work already
        or a free adapter slot (`adapters.py`)."""
        may_split = True
        if lora:
            spare = spare_slots(fleet.live(now))
            candidates = adapter_candidates(candidates, lora, fleet.hungry, spare)
            may_split = spread_cold(candidates, lora, spare)
        hot_set = self.spread(fleet, candidates, tokens, key, now)
        if hot_set is not None:
            parts = self.pieces(hot_set, prompts, tokens) if may_split else 1
            ranked = heapq.nsmallest(parts, hot_set, key=by_load)
        else:
            parts = self.pieces(candidates, prompts, tokens) if may_split else 1
            ranked = self.ranked(fleet, candidates, key, parts)
        if parts == 1:
            return [(ranked[0], prompts)]
        base, extra = divmod(prompts, parts)
        return [(r, base + (1 if i < extra else 0)) for i, r in enumerate(ranked)]

    def route_parts(self, fleet, now, parts, key=(), defer=False):
        """Each part goes where its own prefix is (the reference loses this: it sends a
        pooled batch with no key, and a keyed bucket by its shortest common prefix, say
        the system prompt every row of a labelling job shares, where its parts are the
        few-shot groups under it). A part far larger than the work the replicas hold is
        split like a bucket. Consecutive parts for one replica are merged. Each part is
        one decision (it sees the load and history the previous parts left). With `defer`
        each piece is cut to its replica's room (`fit_room`) and the parts left when no
        replica has room go back; without it the cap admits the batch as a whole: parts
        are ranked among the replicas with room while any has room, then among all live
        ones (still by affinity: an admitted batch's tail must not scatter its prefixes)."""
        self.last_matches = []
        self.last_costs = []
        candidates = fleet.open(now)
        if not candidates:
            return None
        out: Assignments = []
        for i, part in enumerate(parts):
            prompts, tokens, part_key = part[:3]
            output, lora = part_output(part), part_lora(part)
            if i:  # the previous part changed loads (and caps, through the average prompt)
                candidates = fleet.open(now) or ([] if defer else fleet.live(now))
            if not candidates:
                extend_merged(out, [(None, prompts)], self.last_costs, [0])
                continue
            placed = self.place(fleet, candidates, prompts, fleet.estimate(prompts, tokens, output, part_key),
                                part_key, now, lora)
            if defer:
                placed = fit_room(fleet, placed, prompts, tokens, output, part_key)
            matches, costs = commit(fleet, placed, prompts, tokens, output, part_key, lora)
            self.last_matches += matches
            extend_merged(out, placed, self.last_costs, costs)
        return out


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
