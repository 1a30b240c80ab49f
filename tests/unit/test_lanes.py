"""prefixflow.services.bucketer.lanes: fair sharing between jobs (one prefix buffer per job, weighted
fair queuing). Pure logic: builders of items and lanes, no NATS."""

from __future__ import annotations

import collections
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.services.bucketer.buffer import Item, PrefixBuffer
from prefixflow.services.bucketer.lanes import LANE_IDLE, Lanes
from prefixflow.shared.prefix import tokens as tk
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit

_ids = itertools.count()


def make_lanes(max_prompts: int = 1000, min_share: int = 8, headroom: int = 0, burst: int = 0) -> Lanes:
    def buffer() -> PrefixBuffer:
        return PrefixBuffer(max_prompts=max_prompts, min_bucket=4, max_wait=5.0, block_size=4, pool_size=4, max_bucket=16)

    return Lanes(buffer, max_prompts=max_prompts, max_bytes=1 << 30, min_share=min_share, headroom=headroom,
                 burst=burst)


def item(job: str, prefix: int, now: float = 0.0, length: int = 16) -> Item:
    """A prompt of `length` tokens whose first half is one of the job's prefixes; its
    payload is (job, unique id)."""
    i = next(_ids)
    base = hash((job, prefix)) % 1000 * 10
    tokens = [base + k for k in range(length // 2)] + [i * 7 + k for k in range(length - length // 2)]
    return Item(tk.pack(tokens), now, (job, i))


def fill(lanes: Lanes, job: str, weight: float, n: int, now: float = 0.0, prefixes: int = 8) -> None:
    for k in range(n):
        lanes.insert(job, weight, item(job, k % prefixes, now))


def released_work(out) -> collections.Counter:
    work: collections.Counter = collections.Counter()
    for job, bucket in out:
        work[job] += PrefixBuffer.work(bucket.items)
    return work


@pytest.mark.parametrize("weights", [(1, 1), (1, 3), (2, 5)])
def test_release_follows_the_weights_while_both_jobs_have_work(weights):
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "a", weights[0], 3000, prefixes=300)
    fill(lanes, "b", weights[1], 3000, prefixes=300)
    work: collections.Counter = collections.Counter()
    for step in range(60):  # the replicas free ~400 work tokens at a time
        work += released_work(lanes.pop(1.0 + step * 0.01, budget=400))
    share_b = work["b"] / (work["a"] + work["b"])
    want = weights[1] / sum(weights)
    assert abs(share_b - want) <= 0.1 * want, (work, want)


def test_a_job_that_arrives_late_is_served_at_once_not_after_the_backlog():
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "big", 1, 5000, prefixes=500)
    for step in range(20):  # the big job has been running for a while
        lanes.pop(1.0 + step * 0.01, budget=500)
    fill(lanes, "small", 1, 40, now=2.0)
    out = lanes.pop(2.0, budget=500)
    assert released_work(out)["small"] > 0
    # The small job is done after a few rounds, long before the big job's backlog.
    rounds = 1
    while len(lanes.lanes["small"].buffer):
        lanes.pop(2.0 + rounds * 0.01, budget=500)
        rounds += 1
    assert rounds <= 4 and len(lanes.lanes["big"].buffer) > 4000


def test_a_rejoining_job_gets_no_credit_for_its_absence():
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "a", 1, 4000, prefixes=400)
    fill(lanes, "b", 1, 16)
    for step in range(30):
        lanes.pop(1.0 + step * 0.01, budget=400)
    assert not len(lanes.lanes["b"].buffer)
    fill(lanes, "b", 1, 2000, now=2.0, prefixes=200)  # b comes back with a lot of work
    work = released_work(lanes.pop(2.0, budget=4000))
    assert 0.3 <= work["b"] / (work["a"] + work["b"]) <= 0.7, work


def test_share_splits_the_bounds_by_weight_and_gates_intake():
    lanes = make_lanes(max_prompts=1000, min_share=8)
    assert lanes.room("a") == 1000
    fill(lanes, "a", 1, 600)
    assert not lanes.room("a", competing=["b"])  # 600 >= 1000/2 while b waits upstream
    assert lanes.room("a") == 400  # alone it may hold the whole buffer
    fill(lanes, "b", 3, 10)
    assert lanes.share("b")[0] == 750 and lanes.share("a")[0] == 250
    assert lanes.room("b") == 390 and not lanes.room("a")  # b up to the total bound, a drains first
    fill(lanes, "a", 1, 390)
    assert not lanes.room("b")  # the buffer is full: nobody pulls until a's turns drain it
    # With headroom, a job that arrives at a full buffer starts at once (up to its share,
    # and the bound plus the headroom), while the job that filled it drains.
    roomy = make_lanes(max_prompts=1000, min_share=8, headroom=250)
    fill(roomy, "a", 1, 1000)
    assert roomy.room("a") == 0 and roomy.room("b") == 250
    fill(roomy, "b", 1, 250)
    assert roomy.room("b") == 0 and roomy.room("c") == 0 and not roomy.over()
    assert lanes.share("c", competing=[f"j{i}" for i in range(500)])[0] == 8  # never below min_share


def test_without_a_budget_lanes_follow_the_reference_rules():
    lanes = make_lanes(max_prompts=1000)
    fill(lanes, "a", 1, 10, now=0.0)
    assert lanes.pop(1.0, budget=None) == []  # nothing due yet
    out = lanes.pop(6.0, budget=None)  # max_wait passed
    assert sum(len(b.items) for _, b in out) == 10


def test_flush_releases_a_finished_job_whatever_the_budget():
    lanes = make_lanes()
    fill(lanes, "a", 1, 50)
    fill(lanes, "b", 1, 7)
    out = lanes.pop(0.5, budget=0, flush=["b"])
    assert {job for job, _ in out} == {"b"} and sum(len(b.items) for _, b in out) == 7


def test_the_total_bound_releases_from_the_lane_furthest_over_its_share():
    lanes = make_lanes(max_prompts=100, min_share=8)
    fill(lanes, "a", 1, 20)
    fill(lanes, "b", 1, 90)
    out = lanes.pop(0.5, budget=0)
    assert {job for job, _ in out} == {"b"} and len(lanes) <= 100


def test_idle_empty_lanes_are_forgotten():
    lanes = make_lanes()
    fill(lanes, "a", 1, 5, now=0.0)
    lanes.pop(0.1, budget=0, flush=["a"])
    assert lanes.forget(1.0) == []
    assert lanes.forget(LANE_IDLE + 1, keep=["a"]) == []
    assert lanes.forget(LANE_IDLE + 1) == ["a"] and not lanes.lanes


@settings(COSTLY)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["insert", "pop", "flush"]),
            st.sampled_from(["a", "b", "c"]),
            st.integers(min_value=1, max_value=60),
            st.one_of(st.none(), st.integers(min_value=0, max_value=3000)),
        ),
        max_size=40,
    )
)
def test_every_prompt_is_released_exactly_once(ops):
    lanes = make_lanes(max_prompts=150, min_share=8)
    sent: list = []
    inserted: list = []
    now = 0.0
    for op, job, n, budget in ops:
        now += 0.5
        if op == "insert":
            for k in range(n):
                it = item(job, k % 5, now)
                inserted.append(it.payload)
                lanes.insert(job, {"a": 1, "b": 2, "c": 5}[job], it)
        else:
            out = lanes.pop(now, budget=budget, flush=[job] if op == "flush" else ())
            sent += [it.payload for _, b in out for it in b.items]
            assert all(it.payload[0] == j for j, b in out for it in b.items), "a bucket holds one job's prompts"
        assert len(lanes) <= 150 + 60 or op == "insert"
        assert lanes.clock <= min((ln.vtime for ln in lanes.lanes.values() if len(ln.buffer)), default=lanes.clock)
    sent += [it.payload for _, b in lanes.pop(now + 100, budget=None, flush=list(lanes.lanes)) for it in b.items]
    assert sorted(sent) == sorted(inserted) and len(set(sent)) == len(sent)


def test_unbounded_room_releases_one_turn_per_lane_not_the_backlog():
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "a", 1, 2000, prefixes=100)
    fill(lanes, "b", 1, 30, prefixes=3)
    out = lanes.pop(1.0, budget=float("inf"))
    assert {job for job, _ in out} == {"a", "b"}
    assert sum(len(b.items) for job, b in out if job == "a") <= 40  # one bucket, not 2,000 prompts


def test_a_lane_that_released_stays_eligible_while_it_holds_prompts():
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "a", 1, 400, now=0.0, prefixes=40)
    fill(lanes, "b", 1, 400, now=0.0, prefixes=40)
    gate = lambda lane: lane.job == "b" or lanes.lanes["a"].released == 0  # noqa: E731 - a's burst landed once
    work: collections.Counter = collections.Counter()
    for step in range(10):
        fill(lanes, "a", 1, 20, now=1.0 + step, prefixes=40)  # a's input keeps coming: never "settled"
        work += released_work(lanes.pop(1.0 + step, budget=600, eligible=gate))
    assert work["a"] > 0.3 * (work["a"] + work["b"]), work


def test_a_job_joining_while_every_lane_is_drained_gets_no_credit():
    lanes = make_lanes(max_prompts=100_000)
    for step in range(5):  # a runs alone and releases all it holds each time (its input trickles in)
        fill(lanes, "a", 1, 50, now=float(step), prefixes=5)
        lanes.pop(float(step) + 0.5, budget=100_000)
    assert not len(lanes) and lanes.lanes["a"].vtime > 0
    fill(lanes, "b", 1, 500, now=6.0, prefixes=50)
    fill(lanes, "a", 1, 500, now=6.0, prefixes=50)
    work = released_work(lanes.pop(6.5, budget=8000))
    assert 0.3 <= work["a"] / (work["a"] + work["b"]) <= 0.7, work


def test_room_a_lane_took_while_the_other_was_landing_is_no_debt():
    lanes = make_lanes(max_prompts=100_000)
    fill(lanes, "a", 1, 6000, now=0.0, prefixes=600)
    fill(lanes, "b", 3, 2000, now=0.0, prefixes=200)  # arrives together, but still landing
    gate = lambda lane: lane.job == "a" or lanes.lanes["b"].flowing  # noqa: E731
    lanes.pop(1.0, budget=50_000, eligible=gate)  # idle replicas: a alone takes a lot of room
    assert lanes.lanes["a"].released >= 50_000 and not lanes.lanes["b"].released
    work: collections.Counter = collections.Counter()
    for step in range(10):  # b has landed: from now on 3:1, a does not stall while b "catches up"
        work += released_work(lanes.pop(2.0 + step, budget=1000, eligible=lambda lane: True))
    assert work["a"] > 0 and 2.0 <= work["b"] / work["a"] <= 4.5, work


def _running_big(lanes: Lanes) -> None:
    fill(lanes, "big", 1, 5000, prefixes=500)
    for step in range(20):  # the big job has been running for a while
        lanes.pop(1.0 + step * 0.01, budget=500)


@pytest.mark.parametrize("weight", [1, 3])
def test_a_new_small_job_within_the_burst_goes_out_before_the_running_one(weight):
    lanes = make_lanes(max_prompts=100_000, burst=2000)
    _running_big(lanes)
    fill(lanes, "small", weight, 80, now=2.0)  # 80 x 16 = 1,280 work tokens, under the burst
    work: collections.Counter = collections.Counter()
    rounds = 0
    while len(lanes.lanes["small"].buffer):
        work += released_work(lanes.pop(2.0 + rounds * 0.01, budget=500))
        rounds += 1
    assert work["small"] == 80 * 16
    assert work["big"] <= 500, work  # at most the turn that found the small lane still landing
    assert rounds <= 3


@pytest.mark.parametrize("burst", [0, 1600, 4000])
def test_a_new_large_job_gets_only_the_burst_ahead_then_its_share(burst):
    lanes = make_lanes(max_prompts=100_000, burst=burst)
    _running_big(lanes)
    fill(lanes, "new", 1, 3000, now=2.0, prefixes=300)
    work: collections.Counter = collections.Counter()
    for step in range(40):
        work += released_work(lanes.pop(2.0 + step * 0.01, budget=400))
    ahead = work["new"] - work["big"]
    assert abs(ahead - burst) <= 400, (work, burst)  # within one turn of the burst


def test_a_rejoining_job_gets_no_second_burst():
    lanes = make_lanes(max_prompts=100_000, burst=2000)
    _running_big(lanes)
    fill(lanes, "b", 1, 16, now=2.0)
    for step in range(5):
        lanes.pop(2.0 + step * 0.01, budget=400)
    assert not len(lanes.lanes["b"].buffer)
    fill(lanes, "b", 1, 2000, now=3.0, prefixes=200)  # b comes back with a lot of work
    work: collections.Counter = collections.Counter()
    for step in range(10):
        work += released_work(lanes.pop(3.0 + step * 0.01, budget=400))
    assert abs(work["b"] - work["big"]) <= 400, work


@pytest.mark.parametrize("weights", [(1, 3), (3, 1)])
def test_jobs_submitted_together_share_by_weight_whatever_the_burst(weights):
    """The second of two jobs that start together gets no burst beyond what the first
    has released: the burst is for joining running jobs, not a prize for coming second."""
    lanes = make_lanes(max_prompts=100_000, burst=100_000)
    fill(lanes, "a", weights[0], 3000, prefixes=300)
    work = released_work(lanes.pop(1.0, budget=400))  # a's input landed first: one turn
    fill(lanes, "b", weights[1], 3000, now=1.0, prefixes=300)
    for step in range(60):
        work += released_work(lanes.pop(1.01 + step * 0.01, budget=400))
    share_b = work["b"] / (work["a"] + work["b"])
    want = weights[1] / sum(weights)
    assert abs(share_b - want) <= 0.1 * want, (work, want)


def test_prompts_put_back_are_released_again_and_cost_no_turn():
    """A released bucket the router placed only in part (bounded lead): the rest goes back
    to its lane with its arrival time, the lane's virtual time is refunded, and the
    prompts come out again (each prompt placed exactly once in the end)."""
    lanes = make_lanes()
    fill(lanes, "a", 1, 64, prefixes=2)
    fill(lanes, "b", 1, 64, prefixes=2)
    before = {job: lane.vtime for job, lane in lanes.lanes.items()}
    out = lanes.pop(10.0, budget=300)
    job, bucket = out[0]
    held = len(lanes)
    lanes.put_back(job, bucket.items[1:])
    assert len(lanes) == held + len(bucket.items) - 1
    spent = PrefixBuffer.work(bucket.items[:1]) + sum(PrefixBuffer.work(b.items) for j, b in out[1:] if j == job)
    assert lanes.lanes[job].vtime == pytest.approx(before[job] + spent)
    placed = collections.Counter(it.payload for it in bucket.items[:1])
    placed.update(it.payload for j, b in out[1:] for it in b.items)
    for step in range(200):
        for _, b in lanes.pop(11.0 + step, budget=300):
            placed.update(it.payload for it in b.items)
        if not len(lanes):
            break
    assert len(placed) == 128 and set(placed.values()) == {1}


@pytest.mark.parametrize("jobs", [1, 3])
def test_reference_rules_release_the_largest_buckets_at_the_bound(jobs):
    """Without a budget (the reference's rules: a policy without early release, or no
    router), lanes that together hold the buffer's bound - intake has stopped there - release
    their largest buckets by the size rule until the buffer is below its bound, long before
    any prompt is overdue; below the bound nothing goes."""
    lanes = make_lanes(max_prompts=64, min_share=8, headroom=16)
    for k in range(jobs):
        fill(lanes, f"j{k}", 1, 64 // jobs + (1 if k < 64 % jobs else 0), prefixes=6)
    assert len(lanes) == 64
    out = lanes.pop(0.1, budget=None)
    assert out and len(lanes) < 64
    assert {why for _, bucket in out for _, why in bucket.released} == {"size"}
    fill(lanes, "j0", 1, 1, now=0.2, prefixes=6)
    if len(lanes) < 64:
        assert lanes.pop(0.2, budget=None) == []
