"""The engine's queue order (`EngineOrder`): prefix groups together within a job, jobs
and tenants by turns, no credit saved while idle, bounded state."""

from __future__ import annotations

import random
from collections import OrderedDict

from hypothesis import given, strategies as st

from prefixflow.services.engine_worker.grouping import SCALE, EngineOrder
from prefixflow.shared.prefix import tokens as tk
from tests.tiers import THOROUGH


def prompt(group: int, tail: int, block: int = 4) -> bytes:
    return tk.pack([group] * block + [tail])


def former_ranks(groups: list[int], max_age: int) -> list[int]:
    """The former global order (one count over every prompt: a group's rank is the count
    when it was first seen, renumbered past `max_age`), as the oracle for one job."""
    rank: OrderedDict[int, int] = OrderedDict()
    out, n = [], 0
    for g in groups:
        n += 1
        r = rank.get(g)
        if r is None or n - r > max_age:
            r = rank[g] = n
        out.append(r)
    return out


def test_groups_keep_the_rank_they_were_first_seen_with():
    g = EngineOrder(block_size=4)
    a1, b1, a2, c1, b2 = (g.admit(p)[0] for p in (prompt(1, 0), prompt(2, 0), prompt(1, 1), prompt(3, 0), prompt(2, 1)))
    assert a1 == a2 < b1 == b2 < c1  # group 1 first, then 2, then 3, whatever the arrival order


def test_prompts_shorter_than_a_block_group_by_whole_prompt():
    g = EngineOrder(block_size=4)
    assert g.admit(tk.pack([7, 7]))[0] == g.admit(tk.pack([7, 7]))[0]
    assert g.admit(tk.pack([7, 8]))[0] != g.admit(tk.pack([7, 7]))[0]


def test_old_groups_are_renumbered_so_nothing_starves():
    g = EngineOrder(block_size=4, max_age=10)
    first = g.admit(prompt(1, 0))[0]
    for i in range(20):
        g.admit(prompt(100 + i, 0))
    again = g.admit(prompt(1, 1))[0]
    assert again > first  # stale group: treated as new, behind the ones seen meanwhile


@THOROUGH
@given(st.lists(st.integers(0, 12), min_size=1, max_size=300), st.integers(1, 40), st.randoms(use_true_random=False))
def test_one_job_keeps_the_former_global_order(groups, max_age, rnd):
    """With one job the order is the former one (first seen first, renumbered past
    max_age) whatever leaves the engine when: the same comparisons between any two."""
    order = EngineOrder(block_size=4, max_age=max_age)
    got, live = [], []
    for i, grp in enumerate(groups):
        prio, ticket = order.admit(prompt(grp, i))
        got.append(prio)
        live.append(ticket)
        while live and rnd.random() < 0.4:
            order.done(live.pop(rnd.randrange(len(live))))
    want = former_ranks(groups, max_age)
    for i in range(len(groups)):
        for j in range(i + 1, min(len(groups), i + 30)):
            assert (got[i] < got[j]) == (want[i] < want[j]) and (got[i] == got[j]) == (want[i] == want[j])


def sorted_owners(admitted: list[tuple[int, int, str]]) -> list[str]:
    """Owners in the order vLLM runs them: priority, then arrival."""
    return [owner for _, _, owner in sorted(admitted)]


def while_both_run(owners: list[str]) -> list[str]:
    """The run order up to the last prompt of whichever owner runs out first."""
    last = {o: i for i, o in enumerate(owners)}
    return owners[: min(last.values()) + 1] if len(last) == 2 else []


@THOROUGH
@given(st.integers(1, 4), st.integers(1, 4), st.integers(0, 200), st.integers(20, 200), st.randoms(use_true_random=False))
def test_a_newcomer_takes_turns_at_once_by_weight(w_old, w_new, head, n, rnd):
    """Job `old` has `head` prompts in the engine (new groups each) when job `new` arrives;
    then both keep sending, in any interleaving. In vLLM's order (priority, then arrival)
    of the prompts sent since, `new` is never behind its share: in every prefix its count
    over its weight is at least `old`'s less two prompts' worth, whatever `old` holds in
    the engine (the former order put every prompt of `new` behind all of `old`'s). `old`
    catches up once `new` has run as much past the engine's time as `old` held."""
    order = EngineOrder(block_size=4)
    k = 0
    for _ in range(head):
        order.admit(prompt(k, 0), "old", w_old)
        k += 1
    admitted = []
    sent = {"old": 0, "new": 0}
    while sent["old"] < n or sent["new"] < n:
        job = "new" if not sent["new"] else rnd.choice([j for j in ("old", "new") if sent[j] < n])
        prio, _ = order.admit(prompt(k, 0), job, w_old if job == "old" else w_new)
        k += 1
        admitted.append((prio, len(admitted), job))
        sent[job] += 1
    counts = {"old": 0, "new": 0}
    for owner in while_both_run(sorted_owners(admitted)):
        counts[owner] += 1
        assert counts["new"] / w_new >= counts["old"] / w_old - (1 / w_old + 1 / w_new) - 1e-9, counts


@THOROUGH
@given(st.integers(1, 10), st.integers(40, 120), st.randoms(use_true_random=False))
def test_tenants_share_first_then_their_jobs(jobs_a, n, rnd):
    """Tenant a runs `jobs_a` jobs, tenant b one; prompts in any interleaving. In vLLM's
    order of the prompts sent since the second tenant came, it is never behind the first
    by more than twice a's job count plus one, however many jobs a holds (taking turns by
    jobs, b would get 1 prompt in `jobs_a + 1`: behind by ~65 in 80 prompts at 10 jobs)."""
    order = EngineOrder(block_size=4)
    k = 0
    queues = [f"a.j{i}" for i in range(jobs_a)] * n + ["b.only"] * n
    rnd.shuffle(queues)
    admitted = []
    for arrival, job in enumerate(queues):
        prio, _ = order.admit(prompt(k, 0), job)
        k += 1
        admitted.append((prio, arrival, job.split(".")[0]))
    early = queues[0].split(".")[0]
    late = "b" if early == "a" else "a"
    since = next(i for i, job in enumerate(queues) if job.startswith(late))  # what the late one finds is the engine's
    counts = {"a": 0, "b": 0}
    for owner in while_both_run(sorted_owners(admitted[since:])):
        counts[owner] += 1
        assert counts[late] >= counts[early] - 2 * (jobs_a + 1), counts


@THOROUGH
@given(st.integers(2, 20), st.integers(1, 3), st.integers(40, 100), st.integers(1, 5), st.randoms(use_true_random=False))
def test_a_newcomer_is_not_held_behind_young_groups_of_many_jobs(jobs_a, groups_b, m, head, rnd):
    """The case that starved a newcomer: tenant a's many jobs, one prefix group each, all
    seen before tenant b's job came; then a sends three prompts for each of b's. In the
    former order (a group's first sight, one count over all jobs) every prompt of a's
    sorted before all of b's: 3m ahead of b's last. Here a group keeps its early time for
    at most `max_age` prompts' cost of its job's clock, which for a tenant's job runs at
    its share: b's last prompt runs after at most its own count of a's, plus the slack
    (`max_age` at a's half) and a prompt per job of a's."""
    max_age = 8
    order = EngineOrder(block_size=4, max_age=max_age)
    jobs = [f"a.j{i}" for i in range(jobs_a)]
    for _ in range(head):
        for i, job in enumerate(jobs):
            order.admit(prompt(i, 0), job)
    sends = ["a"] * (3 * m) + ["b"] * m
    rnd.shuffle(sends)
    sends.insert(0, sends.pop(sends.index("b")))  # from b's arrival on
    admitted = []
    for k, who in enumerate(sends):
        if who == "a":
            i = rnd.randrange(jobs_a)
            prio, _ = order.admit(prompt(i, k), jobs[i])
        else:
            prio, _ = order.admit(prompt(1000 + rnd.randrange(groups_b), k), "b.small")
        admitted.append((prio, k, who))
    owners = sorted_owners(admitted)
    last_b = max(i for i, o in enumerate(owners) if o == "b")
    ahead = owners[:last_b].count("a")
    assert ahead <= m + max_age // 2 + jobs_a + 2, (ahead, m)


def test_no_credit_is_saved_while_idle():
    """Job b ran one prompt long ago; a ran alone since. b back: it starts at the engine's
    virtual time, not at its old clock (it would sort before everything of a's)."""
    order = EngineOrder(block_size=4)
    _, t = order.admit(prompt(0, 0), "b")
    order.done(t)
    live = []
    for i in range(1, 200):
        prio, t = order.admit(prompt(i, 0), "a")
        live.append((prio, t))
        if len(live) > 10:
            order.done(live.pop(0)[1])
    back, _ = order.admit(prompt(999, 0), "b")
    assert back >= min(p for p, _ in live), (back, live[:3])


def test_state_is_bounded_with_a_long_prompt_in_the_engine():
    """One prompt stays in the engine (a long row) while 50,000 others come and go over
    10,000 jobs: the heap, the jobs and each job's groups stay bounded."""
    order = EngineOrder(block_size=4, max_groups=100, max_jobs=64)
    order.admit(prompt(0, 0), "stuck")
    rnd = random.Random(1)
    live: list[int] = []
    for i in range(50_000):
        live.append(order.admit(prompt(rnd.randrange(10_000), i), f"t{i % 3}.j{i // 5}")[1])
        if len(live) > 32:
            order.done(live.pop(0))
        assert len(order._live) <= 4 * order.inflight() + 64
    assert len(order.jobs) <= 64 + 33
    assert all(len(j.groups) <= 100 for j in order.jobs.values())
    assert order.inflight() == 33


def test_priorities_fit_vllms_int64_over_a_long_run():
    order = EngineOrder(block_size=4)
    prio = 0
    for i in range(20_000):
        prio, t = order.admit(prompt(i, 0), f"a.j{i % 200}", cost=8)
        order.done(t)
    assert 0 <= prio < 2**63 and prio == int(prio) and SCALE > 0
