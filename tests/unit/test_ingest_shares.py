"""The ingestor's turns between jobs (`prefixflow/services/ingestor/shares.py`): tenants
first, then a tenant's jobs, by rows; a late job waits at most one turn of each other
tenant; bounded consumers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.ingestor.shares import IngestShares
from prefixflow.shared.wire.subjects import tenant_of
from tests.tiers import THOROUGH

TURN_ROWS = 512


def drive(shares: IngestShares, backlog: dict[str, int], arrivals: dict[int, dict[str, int]], steps: int,
          weights: dict[str, int] | None = None):
    """Turns as the ingestor takes them (one job a turn, up to TURN_ROWS rows), jobs
    arriving at given turns; yields (turn, job, rows, backlog before the turn)."""
    holding: set[str] = set()
    for turn in range(steps):
        for job, rows in arrivals.get(turn, {}).items():
            backlog[job] = backlog.get(job, 0) + rows
        shares.wait([j for j, n in backlog.items() if n])
        holding &= set(shares.job_time)
        order = shares.order(holding)
        if not order:
            if any(t > turn for t in arrivals):
                continue
            return
        job = order[0]
        holding.add(job)
        before = dict(backlog)
        take = min(backlog[job], TURN_ROWS)
        backlog[job] -= take
        shares.charge(job, take, (weights or {}).get(job, 1))
        if not backlog[job]:
            shares.done(job)
        yield turn, job, take, before


jobs = st.dictionaries(
    st.tuples(st.sampled_from(["", "alice", "bob", "carol"]), st.integers(0, 5)).map(
        lambda tj: f"{tj[0]}.j{tj[1]}" if tj[0] else f"j{tj[1]}"),
    st.integers(1, 20 * TURN_ROWS), min_size=1, max_size=12)


@THOROUGH
@given(jobs)
def test_tenants_with_rows_waiting_stay_within_one_turn_of_each_other(backlog):
    """Invariant: among tenants that have had rows waiting since the start, rows ingested
    differ by at most one turn at every point (two-level fair queuing, tenants first)."""
    shares = IngestShares()
    got: dict[str, int] = {}
    for _, job, rows, before in drive(shares, dict(backlog), {}, 10_000):
        got[tenant_of(job)] = got.get(tenant_of(job), 0) + rows
        busy = {tenant_of(j) for j, n in before.items() if n}
        if len(busy) > 1:
            # every tenant still waiting has had within one turn of the most served busy one
            top = max(got.get(t, 0) for t in busy)
            assert all(top - got.get(t, 0) <= 2 * TURN_ROWS for t in busy), (got, busy)
    assert sum(got.values()) == sum(backlog.values())


@THOROUGH
@given(jobs, st.integers(1, 400), st.sampled_from(["", "alice", "zed"]))
def test_a_late_job_waits_at_most_two_turns_of_each_tenant_per_sibling(backlog, small, tenant):
    """A job that arrives while others have long backlogs waits for at most two turns'
    rows of each other tenant waiting, for each job of its own tenant waiting (its
    tenant's turns go to its jobs in turn), whatever their backlogs: never behind another
    job's whole backlog (FIFO: up to 20 turns of each job ahead)."""
    shares = IngestShares()
    late = f"{tenant}.late" if tenant else "late"
    backlog = {j: n for j, n in backlog.items() if j != late}
    warmup = 3
    turns = list(drive(shares, dict(backlog), {warmup: {late: small}}, 10_000))
    after = [(t, job) for t, job, _, _ in turns if t >= warmup]
    waiting = next((before for t, _, _, before in turns if t == warmup), {})
    others = len({tenant_of(j) for j, n in waiting.items() if n and tenant_of(j) != tenant})
    siblings = sum(1 for j, n in waiting.items() if n and tenant_of(j) == tenant and j != late)
    first = next(i for i, (_, job) in enumerate(after) if job == late)
    ahead = sum(rows for t, job, rows, _ in turns[len(turns) - len(after):][:first])
    assert ahead <= 2 * TURN_ROWS * (siblings + 1) * (others + 1), (ahead, others, siblings, after[:first + 1])
    assert sum(rows for _, job, rows, _ in turns if job == late) == small


def test_weights_share_a_tenants_turns():
    """Within a tenant, a job of priority 3 gets three times the rows of one of priority 1."""
    shares = IngestShares()
    got = {"a.lo": 0, "a.hi": 0}
    for _, job, rows, _ in drive(shares, {"a.lo": 10**6, "a.hi": 10**6}, {}, 400, weights={"a.hi": 3}):
        got[job] += rows
    assert 2.8 <= got["a.hi"] / got["a.lo"] <= 3.2, got


def test_a_new_job_starts_at_the_current_virtual_time_no_credit():
    """A job that joins late neither runs alone for the time it was absent nor is behind:
    after joining, two jobs alternate."""
    shares = IngestShares()
    seq = [job for _, job, _, _ in drive(shares, {"old": 10**6}, {50: {"new": 10**6}}, 60)]
    assert seq[:50] == ["old"] * 50
    tail = seq[50:]
    assert abs(tail.count("old") - tail.count("new")) <= 1, tail


def test_consumers_are_bounded_and_given_tenants_first():
    """At most `max_consumers` jobs are pulled at once (plus a fair one for a tenant
    holding none); a second tenant's job gets one at once."""
    shares = IngestShares(max_consumers=4)
    shares.wait([f"alice.j{i}" for i in range(10)])
    held = set(shares.order(set()))
    assert len(held) == 4
    shares.wait([f"alice.j{i}" for i in range(10)] + ["bob.one"])
    order = shares.order(held)
    assert "bob.one" in order and len(order) <= 2 * 4


def test_turns_are_short_while_several_jobs_wait():
    shares = IngestShares()
    shares.wait(["a"])
    assert shares.turn(64, 8) == 64
    shares.wait(["a", "b"])
    assert shares.turn(64, 8) == 8
