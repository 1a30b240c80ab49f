"""Which jobs a bucketer pulls from: a consumer per job, at most `max_job_consumers` of
them in the usual case (a stream takes 1,000 consumers in all, across the nodes), given
out tenants first. Pure logic, no I/O (the bucketer calls it; tested on its own).

With consumers given out oldest job first, one tenant's 64 long jobs would hold every
consumer and another tenant's job would wait at 0 rows until one of them ends. Here the
tenant holding the fewest consumers goes first (its job seen here longest ago first; jobs without a tenant, the operator's, count as one tenant), and
a tenant below its fair number (`limit` / tenants with jobs here) still gets one when
`limit` is reached, up to twice `limit` in all: a new tenant's job starts at once; the
jobs over the limit end as their jobs do (a consumer is closed once its job has nothing
here).
"""

from __future__ import annotations

import heapq
from collections import Counter, defaultdict
from collections.abc import Collection, Mapping

from prefixflow.shared.wire.subjects import tenant_of


def admit(waiting: Collection[str], open_jobs: Collection[str], first_seen: Mapping[str, float], limit: int) -> list[str]:
    """The jobs of `waiting` (none with a consumer open) that get one now, in the order
    given out: while fewer than `limit` are open, any; past it, only a job whose tenant
    holds fewer than its fair number (`limit` // tenants, at least 1), and never more
    than 2 × `limit` in all. The tenant holding the fewest goes first, each tenant's jobs
    in the order they were first seen."""
    held = Counter(tenant_of(j) for j in open_jobs)
    queues: dict[str, list[str]] = defaultdict(list)
    for job in sorted(waiting, key=lambda j: (first_seen[j], j)):
        queues[tenant_of(job)].append(job)
    fair = max(1, limit // max(1, len(set(held) | set(queues))))
    heap = [(held[t], first_seen[q[0]], t) for t, q in queues.items()]
    heapq.heapify(heap)
    taken = {t: 0 for t in queues}
    total = len(open_jobs)
    out: list[str] = []
    while heap and total < 2 * limit:
        n, _, tenant = heapq.heappop(heap)
        if total >= limit and n >= fair:
            break  # every tenant left holds its fair number: the rest wait their turn
        job = queues[tenant][taken[tenant]]
        taken[tenant] += 1
        out.append(job)
        total += 1
        if taken[tenant] < len(queues[tenant]):
            heapq.heappush(heap, (n + 1, first_seen[queues[tenant][taken[tenant]]], tenant))
    return out
