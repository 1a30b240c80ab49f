"""Fair sharing between jobs: one prefix buffer ("lane") per job, released by weighted
fair queuing. Pure logic, no I/O (tested on its own; the simulator can run it).

Why here: the bucketer holds the backlog (its buffer and its bucket stream). With one
buffer for every job, a small job's prompts queue behind a large job's thousands, so the
small job waits for the large one (FIFO). With a lane per job:

- intake is per job: a job's lane takes prompts while it holds less than its share of
  the buffer's bounds (`share`, by weight among the jobs with prompts here), so a large
  job cannot fill the buffer and lock the others out;
- release follows virtual time: each lane keeps `vtime` = work tokens released / its
  weight; when the replicas have room (`budget`), the lane furthest behind releases next
  (its overdue buckets first, then its largest), so over time each job's share of the
  engine work follows its weight, and a job that arrives late starts at the current
  virtual time (`clock`): no credit for the time it was absent, no debt either;
- prefix affinity within a job is untouched: a lane is a `PrefixBuffer`, buckets are
  the job's own.

Tenants first, then their jobs (two-level fair queuing): a job id `TENANT.NAME` belongs
to its tenant, and a tenant competes as one group of weight 1 with its own virtual time
(`tenant_vtime`: its lanes' tokens released); the group furthest behind releases next, and
within it the job furthest behind by its own virtual time (tokens / its weight). A job
without a tenant (the operator's) is a group of its own, its lane's virtual time as
before. Intake shares the bounds the same way (`effective`). So one tenant's 100 jobs get
together what another tenant's single job gets, the second tenant's job competes from the
moment it lands (not after each of the 100 has had a turn), and jobs without a tenant
share as before.

Without a budget (eager release off, or the router unreachable) each lane follows the
reference rules (max_wait, size), lanes in virtual-time order. A lane whose job has
nothing left upstream and no new input is flushed (its end of input), whatever the
budget; the total bounds release the largest buckets of the lane furthest over its share.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from prefixflow.services.bucketer.buffer import Bucket, Item, PrefixBuffer
from prefixflow.shared.wire.subjects import tenant_of

LANE_IDLE = 30.0
"""Seconds an empty lane is kept (with its virtual time) after its last input."""


@dataclass(slots=True)
class Lane:
    job: str
    buffer: PrefixBuffer
    weight: float = 1.0
    vtime: float = 0.0
    """Work tokens released from this lane / weight (plus the clock when it joined)."""
    last_input: float = 0.0
    released: int = 0
    """Work tokens released so far (for metrics and tests)."""
    flowing: bool = False
    """Released early since it last ran empty: it stays eligible while it holds prompts
    (the opening-burst gate is for a job's first groups, not for every later turn)."""


class Lanes:
    def __init__(self, make_buffer: Callable[[], PrefixBuffer], *, max_prompts: int, max_bytes: int,
                 min_share: int = 64, slack: int = 0, headroom: int = 0, burst: int = 0) -> None:
        self.make_buffer = make_buffer
        self.max_prompts = max_prompts
        self.max_bytes = max_bytes
        self.min_share = min_share
        """A lane may always hold this many prompts, however many jobs share the buffer."""
        self.slack = slack
        """Prompts past `max_prompts` that intake may bring in (it pulls whole messages
        while a lane is under its share) before the bound forces a release."""
        self.headroom = headroom
        """Prompts past `max_prompts` a lane under its share may still pull: a job that
        arrives while another has filled the buffer starts at once, instead of after that
        job's surplus has drained (its fair turns)."""
        self.burst = burst
        """Work tokens a new job may release ahead of the jobs already flowing (0: none)."""
        self.lanes: dict[str, Lane] = {}
        self.clock = 0.0
        """Virtual time of the fair queue: the least group time of the lanes holding prompts."""
        self.tenant_vtime: dict[str, float] = {}
        """Tenant -> work tokens its lanes released (weight 1), plus the clock when it joined."""

    # --- inspection -------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(lane.buffer) for lane in self.lanes.values())

    def __bool__(self) -> bool:
        return any(len(lane.buffer) for lane in self.lanes.values())

    @property
    def nbytes(self) -> int:
        return sum(lane.buffer.nbytes for lane in self.lanes.values())

    def over(self) -> bool:
        """Past the bounds and the intake's slack: release regardless of fairness."""
        return len(self) > self.max_prompts + self.headroom + self.slack or self.nbytes > self.max_bytes

    def full(self) -> bool:
        """At the bounds (intake stops here, less a lane's headroom): under the reference's
        rules the largest buckets go until it is not."""
        return len(self) >= self.max_prompts or self.nbytes >= self.max_bytes

    def oldest(self) -> float | None:
        """Arrival time of the oldest prompt held, in any lane."""
        times = [t for lane in self.lanes.values() if (t := lane.buffer.oldest()) is not None]
        return min(times) if times else None

    def effective(self, weights: dict[str, float]) -> dict[str, float]:
        """Each job's effective weight among `weights` (job -> its own weight): a tenant's
        jobs together weigh 1 (one default job's weight), split by their own weights; a
        job without a tenant weighs its own weight."""
        per_tenant: dict[str, float] = defaultdict(float)
        for job, w in weights.items():
            per_tenant[tenant_of(job)] += w
        return {job: w / per_tenant[t] if (t := tenant_of(job)) else w for job, w in weights.items()}

    def group_time(self, lane: Lane) -> float:
        """The virtual time `lane` competes with between groups: its tenant's, or its own
        (no tenant)."""
        tenant = tenant_of(lane.job)
        return self.tenant_vtime.get(tenant, self.clock) if tenant else lane.vtime

    def order(self, lane: Lane) -> tuple[float, float, str]:
        """Release order: the group furthest behind, then its job furthest behind."""
        return self.group_time(lane), lane.vtime, lane.job

    def share(self, job: str, weight: float = 1.0, competing: Collection[str] = ()) -> tuple[int, int]:
        """(prompts, bytes) `job`'s lane may hold: the bounds split by effective weight
        (tenants first) among the lanes holding prompts and the jobs in `competing` (with
        prompts waiting upstream)."""
        weights = {j: lane.weight for j, lane in self.lanes.items() if len(lane.buffer)}
        for j in competing:
            weights.setdefault(j, self.lanes[j].weight if j in self.lanes else 1.0)
        weights[job] = self.lanes[job].weight if job in self.lanes else weight
        eff = self.effective(weights)
        part = eff[job] / sum(eff.values())
        return max(self.min_share, int(self.max_prompts * part)), max(1, int(self.max_bytes * part))

    def room(self, job: str, weight: float = 1.0, competing: Collection[str] = ()) -> int:
        """Prompts intake may pull into `job`'s lane: up to its share, and up to the total
        bound plus `headroom` (a lane over its share - its job was alone until now - drains
        by its fair turns while the newcomer pulls; 0: none)."""
        total = len(self)
        if total >= self.max_prompts + self.headroom or self.nbytes >= self.max_bytes:
            return 0
        prompts, nbytes = self.share(job, weight, competing)
        lane = self.lanes.get(job)
        if lane is None:
            return max(0, min(prompts, self.max_prompts + self.headroom - total))
        if lane.buffer.nbytes >= nbytes:
            return 0
        return max(0, min(prompts - len(lane.buffer), self.max_prompts + self.headroom - total))

    # --- intake -----------------------------------------------------------------------

    def start_time(self, job: str) -> float:
        """Where a lane joining now starts: the clock (no tenant), or the least time of its
        tenant's lanes holding prompts (0 if none: within a tenant only the order of its
        jobs counts), its tenant joining at the clock."""
        tenant = tenant_of(job)
        if not tenant:
            return self.clock
        if not any(len(ln.buffer) for ln in self.lanes.values() if tenant_of(ln.job) == tenant):
            self.tenant_vtime[tenant] = max(self.tenant_vtime.get(tenant, self.clock), self.clock)
        busy = [ln.vtime for ln in self.lanes.values() if len(ln.buffer) and tenant_of(ln.job) == tenant]
        return min(busy) if busy else 0.0

    def insert(self, job: str, weight: float, item: Item) -> None:
        lane = self.lanes.get(job)
        if lane is None:
            start = self.start_time(job)
            lane = self.lanes[job] = Lane(job, self.make_buffer(), vtime=start)
        elif not len(lane.buffer):  # rejoining: no credit for the time it was away
            lane.vtime = max(lane.vtime, self.start_time(job))
        lane.weight = max(float(weight), 1e-3)
        lane.last_input = max(lane.last_input, item.arrived)
        lane.buffer.insert(item)

    def put_back(self, job: str, items: list[Item]) -> None:
        """Prompts released but not placed (the router found no room for them: bounded
        lead) return to their job's lane as they were (their arrival times kept), and the
        lane's virtual time is refunded: what was not sent was not served."""
        if not items:
            return
        lane = self.lanes.get(job)
        if lane is None:
            lane = self.lanes[job] = Lane(job, self.make_buffer(), vtime=self.start_time(job))
        work = PrefixBuffer.work(items)
        lane.vtime -= work / lane.weight
        if tenant := tenant_of(job):
            self.tenant_vtime[tenant] = self.tenant_vtime.get(tenant, self.clock) - work
        lane.released -= work
        for item in items:
            lane.buffer.insert(item)
        lane.last_input = max(lane.last_input, max(it.arrived for it in items))

    # --- release ----------------------------------------------------------------------

    def pop(self, now: float, *, budget: float | None, flush: Collection[str] = (),
            eligible: Callable[[Lane], bool] = lambda lane: True) -> list[tuple[str, Bucket]]:
        """Release, as (job, bucket):
        1. every bucket of the lanes in `flush` (their job's end of input);
        2. while over the total bounds (without a `budget`: at them, the reference's size
           rule): the largest buckets of the lane furthest over its share;
        3. with a `budget` (work tokens of free room on the replicas): lanes furthest
           behind in virtual time first, each turn a fair piece of the budget, among the
           lanes `eligible` says may release early (or that already do) (an unbounded budget: one turn per
           lane); without one (None): each lane by the reference rules, in virtual-time
           order.
        Every released token advances its lane's virtual time by tokens / weight."""
        out: list[tuple[str, Bucket]] = []
        for job in flush:
            if (lane := self.lanes.get(job)) is not None and len(lane.buffer):
                self._emit(out, lane, lane.buffer.pop(now, flush=True))
        while self.over() or (budget is None and self.full()):
            lane = max((ln for ln in self.lanes.values() if len(ln.buffer)),
                       key=lambda ln: len(ln.buffer) / self.share(ln.job, ln.weight)[0])
            before = len(out)
            self._emit(out, lane, lane.buffer.pop(now, budget=1, bounded=True, why="size"))
            if len(out) == before:
                break
        if budget is None:
            for lane in sorted(self.lanes.values(), key=self.order):
                if len(lane.buffer):
                    self._emit(out, lane, lane.buffer.pop(now))
        elif math.isinf(budget):
            # Room without a bound (the router knows no cap yet): one turn per lane, not
            # everything - what is released now is committed ahead of later jobs.
            for lane in sorted(self.lanes.values(), key=self.order):
                if len(lane.buffer) and (lane.flowing or eligible(lane)):
                    if not lane.flowing:
                        self._enter(lane)
                    self._emit(out, lane, lane.buffer.pop(now, budget=1, bounded=True))
        else:
            while budget > 0:
                ready = [ln for ln in self.lanes.values() if len(ln.buffer) and (ln.flowing or eligible(ln))]
                if not ready:
                    break
                for ln in ready:
                    if not ln.flowing:
                        self._enter(ln)
                lane = min(ready, key=self.order)
                piece = max(1.0, budget / len(ready))
                budget -= max(1, self._emit(out, lane, lane.buffer.pop(now, budget=piece, bounded=True)))
        self._advance_clock()
        return out

    def _enter(self, lane: Lane) -> None:
        """`lane` starts to release: it competes from the virtual time of the lanes that
        already flow (not from when its first prompts arrived: what the others were given
        while it was still landing its input, engines that would have idled otherwise, is
        no debt of theirs). A new job (nothing released yet) enters up to `burst` tokens
        behind them, at most as far as each of them has released: its first tokens go out
        first beside running jobs, while jobs that start together start even. Between
        groups this is done for its group (a tenant's time, when none of its lanes flows
        yet), within a tenant for its lane among the tenant's flowing lanes."""
        tenant = tenant_of(lane.job)
        flowing = [ln for ln in self.lanes.values() if ln.flowing and len(ln.buffer)]
        others = [ln for ln in flowing if not tenant or tenant_of(ln.job) != tenant]
        group_joins = not tenant or not any(tenant_of(ln.job) == tenant for ln in flowing)
        if others and group_joins:
            floor = min(self.group_time(ln) for ln in others)
            burst = min(self.burst, min(ln.released for ln in others)) if not lane.released else 0
            if tenant:
                t = max(self.tenant_vtime.get(tenant, self.clock), floor) - burst
                self.tenant_vtime[tenant] = t
            else:
                lane.vtime = max(lane.vtime, floor) - burst / lane.weight
        if tenant:
            siblings = [ln for ln in flowing if tenant_of(ln.job) == tenant]
            if siblings:
                lane.vtime = max(lane.vtime, min(ln.vtime for ln in siblings))
        lane.flowing = True

    def _emit(self, out: list[tuple[str, Bucket]], lane: Lane, buckets: list[Bucket]) -> int:
        if not len(lane.buffer):
            lane.flowing = False
        work = sum(PrefixBuffer.work(b.items) for b in buckets)
        lane.vtime += work / lane.weight
        if tenant := tenant_of(lane.job):
            self.tenant_vtime[tenant] = self.tenant_vtime.get(tenant, self.clock) + work
        lane.released += work
        out.extend((lane.job, b) for b in buckets)
        return work

    def _advance_clock(self) -> None:
        """The least group time of the lanes holding prompts; when none holds any (each
        released all it had, more on its way), the most any has reached: a job that
        arrives then must not be owed what the others were served meanwhile."""
        busy = [self.group_time(lane) for lane in self.lanes.values() if len(lane.buffer)]
        if busy:
            self.clock = max(self.clock, min(busy))
        elif self.lanes:
            self.clock = max(self.clock, max(self.group_time(lane) for lane in self.lanes.values()))

    def forget(self, now: float, keep: Collection[str] = ()) -> list[str]:
        """Drop lanes empty for `LANE_IDLE` seconds (jobs not in `keep`); their names."""
        gone = [job for job, lane in self.lanes.items()
                if not len(lane.buffer) and job not in keep and now - lane.last_input >= LANE_IDLE]
        for job in gone:
            del self.lanes[job]
        live = {tenant_of(job) for job in self.lanes}
        for tenant in [t for t in self.tenant_vtime if t not in live]:
            del self.tenant_vtime[tenant]
        return gone
