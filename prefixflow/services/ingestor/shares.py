"""Which job the ingestor pulls next: tenants first, then a tenant's jobs. Pure logic, no
I/O (the ingestor calls it; tested on its own).

Why: every job's rows arrive on its own subject (`pfx.ingest.<job>`). Read through one
FIFO consumer, a job submitted after a large one waits behind the large one's whole
backlog whenever ingestion is the bottleneck (a loaded machine, long prompts to tokenize,
a full downstream), even though the bucketer shares the engines fairly afterwards. So the
ingestor pulls each job through its own consumer, and takes turns:

- **Two-level fair queuing by rows.** Each tenant has a virtual time (rows ingested for
  it); the tenant furthest behind goes next, and within it the job furthest behind (its
  rows / its priority). A job id `TENANT.NAME` belongs to its tenant; jobs without one
  (the operator's) are one tenant, ''. So one tenant's 100 jobs get together what
  another tenant's one job gets.
- **No credit, no debt.** A tenant or job that starts waiting starts at the current
  virtual time of those waiting (the least), not at zero: it does not get to run alone
  for all the time it was absent, and it is not behind the others either.
- **Short turns while others wait.** A turn is one pull: `fetch_batch` messages when one
  job is waiting, `contended` messages when several are (so a small job waits at most
  one short turn of each job ahead of it before its own).
- **Bounded.** At most `max_consumers` jobs hold a consumer at once (given out tenants
  first, `prefixflow/services/bucketer/consumers.py` `admit`); the rest wait in the
  stream. Virtual times of jobs and tenants with nothing waiting are forgotten.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

from prefixflow.services.bucketer.consumers import admit
from prefixflow.shared.wire.subjects import tenant_of


class IngestShares:
    def __init__(self, max_consumers: int = 64) -> None:
        self.max_consumers = max_consumers
        self.tenant_time: dict[str, float] = {}
        self.job_time: dict[str, float] = {}
        self.first_seen: dict[str, float] = {}
        self.jobs_of: Counter[str] = Counter()
        """Tenant -> its jobs waiting (kept with `job_time`)."""
        self.ticks = 0.0
        """Order in which jobs were first seen waiting (for `admit`)."""

    def _clock(self, times: Mapping[str, float]) -> float:
        return min(times.values()) if times else 0.0

    def wait(self, waiting: Collection[str]) -> None:
        """The jobs with messages waiting now; those not waiting any more are forgotten,
        new ones join at the current virtual time."""
        waiting = set(waiting)
        for job in [j for j in self.job_time if j not in waiting]:
            self.done(job)
        tenant_clock = self._clock(self.tenant_time)
        job_clock: dict[str, float] = {}  # tenant -> the least virtual time of its jobs waiting
        for job, t in self.job_time.items():
            tenant = tenant_of(job)
            job_clock[tenant] = min(t, job_clock.get(tenant, t))
        for job in sorted(waiting - self.job_time.keys()):
            tenant = tenant_of(job)
            if tenant not in self.tenant_time:
                self.tenant_time[tenant] = tenant_clock
            self.job_time[job] = job_clock.get(tenant, 0.0)
            self.jobs_of[tenant] += 1
            self.ticks += 1
            self.first_seen[job] = self.ticks

    def order(self, holding: Collection[str]) -> list[str]:
        """The waiting jobs that may be pulled now, the next turn's first: those holding a
        consumer (`holding`), and those that get one now within `max_consumers`, by
        (tenant's virtual time, job's virtual time)."""
        held = [j for j in holding if j in self.job_time]
        new = admit([j for j in self.job_time if j not in holding], held, self.first_seen, self.max_consumers)
        return sorted(held + new, key=lambda j: (self.tenant_time[tenant_of(j)], self.job_time[j], self.first_seen[j]))

    def turn(self, fetch_batch: int, contended: int) -> int:
        """Messages the next pull takes."""
        return fetch_batch if len(self.job_time) <= 1 else max(1, min(contended, fetch_batch))

    def charge(self, job: str, rows: int, weight: int = 1) -> None:
        """`rows` of `job` were ingested (at its priority `weight`)."""
        if job not in self.job_time:
            return
        self.job_time[job] += max(rows, 1) / max(weight, 1)
        self.tenant_time[tenant_of(job)] += max(rows, 1)

    def done(self, job: str) -> None:
        """`job` has nothing waiting (a pull came back empty): out of the turns until
        the stream shows it waiting again."""
        if self.job_time.pop(job, None) is None:
            return
        self.first_seen.pop(job, None)
        tenant = tenant_of(job)
        self.jobs_of[tenant] -= 1
        if self.jobs_of[tenant] <= 0:
            del self.jobs_of[tenant]
            self.tenant_time.pop(tenant, None)
