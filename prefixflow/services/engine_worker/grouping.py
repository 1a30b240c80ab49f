"""The order of the prompts in the engine's queue: prefix groups together, jobs by turns.
Pure logic, no I/O (the engine-worker and the simulator call `EngineOrder`).

vLLM admits waiting requests in priority order as long as KV blocks are free, evicting
cached prefix blocks of groups that are not running. With many prefixes interleaved in
its queue, a small KV cache thrashes: each group's prefix is recomputed again and again.
Giving every prompt the priority of its prefix group (groups in the order first seen)
makes vLLM run a group's prompts together, so few prefixes are live at once and each is
computed about once. A group first seen more than `max_age` of its job's prompts ago is
renumbered as new, so a group that keeps receiving prompts cannot starve the others.

Between jobs the order is a virtual time (start-time fair queuing), not one count over
every job. With one count (the group first seen earliest first) every group of the jobs
running when another job arrived sorted before all of the newcomer's prompts in vLLM's
queue, for as long as those groups stayed young: the newcomer ran only when the queue
held nothing else (measured on vLLM: a small job beside another tenant's 100 jobs took
6.6x its time alone, 2.8x beside one large job still being submitted). Here each job
keeps its own clock: a prompt of a group new to its job takes the job's clock, a prompt
of a group it has seen takes that group's time (but never more than `max_age` prompts'
cost behind the job's clock), and every prompt advances the clock by
its cost over the job's share (its `priority` weight among its tenant's jobs in the
engine, tenants equal). A job that had nothing in the engine starts from the engine's
virtual time (the least time of its prompts in the engine, never going back), or from
the furthest behind of its tenant's jobs in the engine if that is later, never from a
credit saved up while idle. A newcomer's prompts so sort among the front of the queue
at once and then take turns by weight; within one job the order is the group order
above, and with one job it is exactly the former global order (a group's rank was the
count of prompts submitted when it was first seen).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from prefixflow.shared.prefix.block_keys import first_block_key
from prefixflow.shared.wire.subjects import tenant_of

SCALE = 16
"""Integer priority steps per unit of virtual time (vLLM takes an int; lower runs first)."""


@dataclass
class _Job:
    tenant: str
    weight: int = 1
    clock: float = 0.0
    """Virtual time of the job's next new group."""
    submitted: int = 0
    """Its prompts submitted so far (a group's age counts in these)."""
    inflight: int = 0
    """Its prompts in the engine now."""
    groups: OrderedDict[int, tuple[float, int]] = field(default_factory=OrderedDict)
    """Group -> (its virtual time, `submitted` when first seen), oldest first."""


class EngineOrder:
    """vLLM priorities for the prompts one engine runs: prefix groups kept together within
    a job, jobs (and tenants) taking turns by weight (see the module's docstring).

    `admit` when a prompt goes into the engine (returns its priority and a ticket),
    `done(ticket)` when it leaves. Bounded: at most `max_jobs` jobs and `max_groups`
    groups per job are remembered (the least recently used idle job, a job's oldest
    group forgotten first)."""

    def __init__(self, block_size: int, max_age: int = 4096, max_groups: int = 65536, max_jobs: int = 4096) -> None:
        self.block_size = block_size
        self.max_age = max_age
        self.max_groups = max_groups
        self.max_jobs = max_jobs
        self.jobs: OrderedDict[str, _Job] = OrderedDict()
        """Jobs seen, least recently admitted first."""
        self.tenant_weight: Counter[str] = Counter()
        """Sum of the weights of each tenant's jobs with prompts in the engine."""
        self.active: dict[str, set[str]] = {}
        """Each tenant's jobs with prompts in the engine."""
        self._live: list[tuple[float, int]] = []
        """(virtual time, ticket) of the prompts in the engine (a heap; left ones removed lazily)."""
        self._left: set[int] = set()
        self._tickets: dict[int, tuple[str, float]] = {}
        self._next = 0
        self.vtime = 0.0
        """The engine's virtual time: the least of its prompts' (kept when it empties)."""

    def group(self, tokens: bytes) -> int:
        return first_block_key(tokens, self.block_size)

    def share(self, job: _Job) -> float:
        """The job's share of the engine while the others in it stay: tenants equal, a
        tenant's jobs by weight."""
        tenants = sum(1 for w in self.tenant_weight.values() if w > 0) or 1
        within = self.tenant_weight[job.tenant] or job.weight
        return job.weight / within / tenants

    def admit(self, tokens: bytes, job: str = "", weight: int = 1, cost: float = 1.0) -> tuple[int, int]:
        """A prompt goes into the engine: its priority (lower runs first) and its ticket."""
        state = self.jobs.get(job)
        if state is None:
            state = self.jobs[job] = _Job(tenant_of(job), max(int(weight), 1), clock=self.vtime)
            self._forget_idle_jobs()
        self.jobs.move_to_end(job)
        if state.inflight == 0:
            state.weight = max(int(weight), 1)
            # No credit saved up while idle: from the engine's time, and within a tenant that
            # has jobs in the engine from the furthest behind of them (its turns so far are
            # the tenant's, not a fresh share each time another of its jobs comes).
            siblings = self.active.setdefault(state.tenant, set())
            floor = min((self.jobs[j].clock for j in siblings), default=self.vtime)
            state.clock = max(state.clock, self.vtime, floor)
            siblings.add(job)
            self.tenant_weight[state.tenant] += state.weight
        state.inflight += 1
        state.submitted += 1
        g = self.group(tokens)
        seen = state.groups.get(g)
        step = max(cost, 0.0) / self.share(state)
        if seen is None or state.submitted - seen[1] > self.max_age:
            seen = (state.clock, state.submitted)
            state.groups.pop(g, None)
            state.groups[g] = seen
            if len(state.groups) > self.max_groups:
                state.groups.popitem(last=False)
        elif seen[0] < (floor := state.clock - self.max_age * max(cost, 0.0)):
            # A group's time stays at most `max_age` prompts' cost behind its job's clock:
            # for a job alone (its share whole) the same as the renumbering above, but a
            # job with a small share (a tenant's hundredth job, whose clock runs a hundred
            # times as fast) cannot keep a young group's early time while its clock runs
            # far ahead, and sort before a newcomer for all of that group's prompts.
            seen = state.groups[g] = (floor, seen[1])
        state.clock += step
        at = seen[0]
        ticket = self._next
        self._next += 1
        self._tickets[ticket] = (job, at)
        heapq.heappush(self._live, (at, ticket))
        self._advance()
        return int(at * SCALE), ticket

    def done(self, ticket: int) -> None:
        """The ticket's prompt left the engine (finished, failed or aborted)."""
        entry = self._tickets.pop(ticket, None)
        if entry is None:
            return
        self._left.add(ticket)
        state = self.jobs.get(entry[0])
        if state is not None:
            state.inflight -= 1
            if state.inflight == 0:
                self.tenant_weight[state.tenant] -= state.weight
                if self.tenant_weight[state.tenant] <= 0:
                    del self.tenant_weight[state.tenant]
                siblings = self.active.get(state.tenant)
                if siblings is not None:
                    siblings.discard(entry[0])
                    if not siblings:
                        del self.active[state.tenant]
        self._advance()

    def _advance(self) -> None:
        live = self._live
        while live and live[0][1] in self._left:
            self._left.discard(heapq.heappop(live)[1])
        if len(live) > 4 * len(self._tickets) + 64:
            # Prompts that left behind one still in the engine with a lesser time (a long
            # row): rebuilt from those in the engine, so the heap stays bounded by them.
            self._live = live = [(at, t) for at, t in live if t in self._tickets]
            heapq.heapify(live)
            self._left.clear()
        if live:
            self.vtime = max(self.vtime, live[0][0])

    def _forget_idle_jobs(self) -> None:
        if len(self.jobs) <= self.max_jobs:
            return
        for job in [j for j, s in self.jobs.items() if s.inflight == 0][: len(self.jobs) - self.max_jobs]:
            del self.jobs[job]

    def inflight(self) -> int:
        return len(self._tickets)
