"""Tenants first (issue 40 item 4), in the bucketer's pure decisions: a tenant's jobs
together get one share of the release (`Lanes`: effective weights), and consumers are
given out tenants first (`consumers.admit`). Jobs without a tenant share as before."""

from __future__ import annotations

import collections

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.bucketer.consumers import admit
from prefixflow.shared.wire.subjects import tenant_of
from tests.unit.test_lanes import fill, make_lanes, released_work

pytestmark = pytest.mark.unit


def by_tenant(work: collections.Counter) -> collections.Counter:
    out: collections.Counter = collections.Counter()
    for job, w in work.items():
        out[tenant_of(job) or job] += w
    return out


@pytest.mark.parametrize("a_jobs,b_jobs", [(1, 1), (10, 1), (30, 1), (8, 3)])
def test_each_tenant_gets_an_equal_share_however_many_jobs_it_runs(a_jobs, b_jobs):
    lanes = make_lanes(max_prompts=1_000_000)
    for i in range(a_jobs):
        fill(lanes, f"alice.j{i}", 1, 3000 // a_jobs, prefixes=max(1, 300 // a_jobs))
    for i in range(b_jobs):
        fill(lanes, f"bob.j{i}", 1, 3000 // b_jobs, prefixes=max(1, 300 // b_jobs))
    work: collections.Counter = collections.Counter()
    for step in range(60):  # the replicas free ~400 work tokens at a time
        work += released_work(lanes.pop(1.0 + step * 0.01, budget=400))
    tenants = by_tenant(work)
    share = tenants["bob"] / (tenants["alice"] + tenants["bob"])
    assert abs(share - 0.5) <= 0.05, (tenants, a_jobs, b_jobs)
    # Within a tenant, its jobs share alike.
    alice = [work[f"alice.j{i}"] for i in range(a_jobs)]
    assert max(alice) - min(alice) <= max(alice) * 0.5 + 64, alice


def test_a_tenants_job_weights_split_its_share():
    lanes = make_lanes(max_prompts=1_000_000)
    fill(lanes, "alice.hi", 3, 3000, prefixes=300)
    fill(lanes, "alice.lo", 1, 3000, prefixes=300)
    fill(lanes, "bob.only", 1, 3000, prefixes=300)
    work: collections.Counter = collections.Counter()
    for step in range(60):
        work += released_work(lanes.pop(1.0 + step * 0.01, budget=400))
    total = sum(work.values())
    assert abs(work["bob.only"] / total - 0.5) <= 0.05, work
    assert abs(work["alice.hi"] / (work["alice.hi"] + work["alice.lo"]) - 0.75) <= 0.075, work


def test_a_tenants_many_jobs_share_the_buffer_as_one():
    lanes = make_lanes(max_prompts=1000, min_share=8)
    for i in range(20):
        fill(lanes, f"alice.j{i}", 1, 10)
    # bob's job may hold half the buffer beside alice's 20 jobs (not 1/21 of it)
    assert lanes.share("bob.x")[0] == 500
    assert lanes.share("alice.j0", competing=["bob.x"])[0] in (24, 25)  # alice's half, split 20 ways
    assert lanes.share("alice.j0")[0] in (49, 50)  # alone here: the whole buffer, split 20 ways


TENANT = st.sampled_from(["", "alice.", "bob.", "carol.", "dave."])
JOBS = st.lists(st.tuples(TENANT, st.integers(0, 400)), min_size=0, max_size=120, unique=True)


@given(JOBS, st.data(), st.integers(1, 40))
def test_admit_gives_consumers_tenants_first_within_twice_the_limit(jobs, data, limit):
    names = [f"{t}j{i}" for t, i in jobs]
    open_jobs = set(data.draw(st.lists(st.sampled_from(names), unique=True, max_size=2 * limit)) if names else [])
    waiting = [j for j in names if j not in open_jobs]
    seen = {j: float(data.draw(st.integers(0, 50))) for j in names}
    out = admit(waiting, open_jobs, seen, limit)
    assert len(out) == len(set(out)) and set(out) <= set(waiting)
    total = len(open_jobs) + len(out)
    assert total <= max(2 * limit, len(open_jobs))
    # Below the limit, any waiting job may start: as many as fit are admitted.
    assert len(out) >= min(len(waiting), max(0, limit - len(open_jobs)))
    held = collections.Counter(tenant_of(j) for j in [*open_jobs, *out])
    tenants = {tenant_of(j) for j in names}
    fair = max(1, limit // max(1, len(tenants)))
    if total < 2 * limit:
        # Nobody left waiting whose tenant is below its fair number.
        for j in waiting:
            if j not in out:
                assert held[tenant_of(j)] >= fair, (j, held, fair)
    # Each tenant's jobs start in the order they were first seen.
    for t in tenants:
        mine = [j for j in out if tenant_of(j) == t]
        left = [j for j in waiting if tenant_of(j) == t and j not in out]
        if mine and left:
            assert max(seen[j] for j in mine) <= min(seen[j] for j in left)


def test_a_new_tenant_gets_a_consumer_beside_another_tenants_full_house():
    open_jobs = {f"alice.j{i}" for i in range(64)}
    waiting = [f"alice.j{i}" for i in range(64, 100)] + ["bob.small"]
    seen = {j: float(i) for i, j in enumerate(sorted(open_jobs)) } | {j: 100.0 + i for i, j in enumerate(waiting)}
    assert admit(waiting, open_jobs, seen, 64) == ["bob.small"]
    # Without tenants the limit holds as before: oldest first, none past it.
    plain = [f"j{i}" for i in range(10)]
    assert admit(plain, set(), {j: float(i) for i, j in enumerate(plain)}, 4) == plain[:4]
    assert admit(plain[4:], set(plain[:4]), {j: float(i) for i, j in enumerate(plain)}, 4) == []
