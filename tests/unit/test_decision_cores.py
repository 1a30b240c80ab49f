"""The decision cores on their own, with small builders (no NATS, no clock but a number):
`prefixflow.services.bucketer.release.Release` (what to pull, what to release, where a
cut goes) and `prefixflow.services.router.decision.Decider` (a route request -> a reply)."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.bucketer.buffer import Bucket, Item, PrefixBuffer
from prefixflow.services.bucketer.release import EAGER_MIN_WAIT, Inflow, Release
from prefixflow.services.router import decision
from prefixflow.services.router.decision import RETRY_CAPPED, RETRY_NONE_LIVE, Decider
from prefixflow.shared.process.config import BucketerConfig, RouterConfig
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit

_ids = itertools.count()


def release(**cfg) -> Release:
    base = dict(buffer_prompts=64, min_bucket=4, pool_size=4, max_bucket=16, hash_block_size=4, max_wait=5.0,
                idle_flush=0.5, eager_delay=2.0)
    return Release(BucketerConfig(**(base | cfg)))


def item(prefix: int, now: float = 0.0, output: int = 8) -> Item:
    """A 16-token prompt whose first 8 tokens are `prefix`'s; payload: a unique id."""
    i = next(_ids)
    tokens = [prefix * 100 + k for k in range(8)] + [i * 7 + k for k in range(8)]
    return Item(tk.pack(tokens), now, i, None, 16 + output, "", output)


def fill(core: Release, job: str, n: int, now: float = 0.0, prefixes: int = 4) -> list[Item]:
    items = [item(k % prefixes, now) for k in range(n)]
    for it in items:
        core.insert(job, 1, it)
    return items


ROOM = m.RouterRoom(tokens=10_000, live=2, eager=True)


def test_budget_follows_the_routers_room_reply():
    core = release()
    assert core.budget(None) is None  # router away: the reference rules
    assert core.budget(ROOM) == 10_000.0 and not core.reference_rules
    assert core.budget(m.RouterRoom(tokens=-1, live=1)) == math.inf  # no cap known yet
    assert core.budget(m.RouterRoom(tokens=500, live=1, eager=False)) is None  # daft: no early release
    assert core.reference_rules
    assert core.no_budget() == 0.0 and release(eager=False).no_budget() is None


def test_eager_release_waits_for_input_to_land_unless_the_lane_is_full():
    core = release()
    fill(core, "a", 20)
    landing = Inflow(waiting={"a": 3}, upstream=["a"])
    # Input still on its way and the lane not full: not before --eager-delay.
    assert not core.wants_room(EAGER_MIN_WAIT + 0.01, landing)
    assert core.release(EAGER_MIN_WAIT + 0.01, landing, core.budget(ROOM)) == []
    assert core.wants_room(2.0, landing)
    # Landed (nothing waiting here or upstream): eligible after EAGER_MIN_WAIT.
    assert not core.wants_room(EAGER_MIN_WAIT / 2, Inflow())
    assert core.wants_room(EAGER_MIN_WAIT + 0.01, Inflow())
    # A full lane (its intake stopped) is eligible though input is still waiting.
    fill(core, "a", 44)
    assert core.fetch("a", 1, landing) == 0
    assert core.wants_room(EAGER_MIN_WAIT + 0.01, landing)
    out = core.release(EAGER_MIN_WAIT + 0.01, landing, core.budget(ROOM))
    assert out and all(job == "a" for job, _ in out)


def test_reference_rules_flush_a_landed_idle_lane_and_release_at_the_bound():
    core = release()
    fill(core, "a", 10)
    # No input for idle_flush, but some still upstream: kept (a slow ingest batch).
    assert core.release(1.0, Inflow(upstream=["a"]), None) == []
    out = core.release(1.0, Inflow(), None)
    assert sum(len(b.items) for _, b in out) == 10 and not core
    # At the bound (64 prompts), the largest buckets go (the reference's size rule).
    fill(core, "b", 64, now=2.0, prefixes=8)
    out = core.release(2.01, Inflow(upstream=["b"]), None)
    assert out and {why for _, b in out for _, why in b.released} == {"size"}
    assert len(core) < 64


def test_route_request_and_place_put_the_cut_back():
    core = release()
    fill(core, "a", 12, prefixes=1)
    [(job, bucket)] = core.release(1.0, Inflow(), core.budget(ROOM))
    req = core.route_request("node0", bucket, "b1")
    assert (req.bucketer, req.bucket, req.prompts) == ("node0", "b1", 12)
    assert req.tokens == PrefixBuffer.work(bucket.items) == 12 * 24 and req.output == 12 * 8
    vtime = core.lanes.lanes["a"].vtime
    placed = core.place(job, bucket, [m.Assignment("r0", 5, 100), m.Assignment("", 7), ])
    assert [(p.replica, len(p.items)) for p in placed] == [("r0", 5)]
    assert sum(placed[0].shares) == 100
    assert len(core) == 7  # the cut is back in its lane, its arrival kept
    assert core.lanes.lanes["a"].vtime == vtime - 7 * 24  # and not counted as served
    assert core.place(job, Bucket(bucket.items[:2]), [m.Assignment("r1", 2, 0)])[0].shares == []  # not charged


@given(
    sizes=st.lists(st.integers(1, 30), min_size=1, max_size=5),
    rooms=st.lists(st.integers(-1, 400), min_size=1, max_size=12),
    cut=st.integers(0, 3),
)
def test_every_prompt_is_placed_exactly_once(sizes, rooms, cut):
    """Jobs arriving in bursts, rooms as the router answers them, and a router that cuts
    the last `cut` prompts of each bucket when it can: each prompt is placed once, and
    nothing stays in the lanes once the room lasts."""
    core = release()
    inserted: list[int] = []
    placed: list[int] = []
    now = 0.0
    for k, n in enumerate(sizes):
        inserted += [it.payload for it in fill(core, f"j{k % 3}", n, now)]
    for step in itertools.count():
        now += 0.3
        reply = m.RouterRoom(tokens=rooms[step % len(rooms)] if step < 50 else -1, live=2)
        inflow = Inflow()
        budget = core.budget(reply) if core.wants_room(now, inflow) else core.no_budget()
        for job, bucket in core.release(now, inflow, budget):
            n = len(bucket.items)
            kept = min(cut, n - 1) if step < 50 else 0
            answer = [m.Assignment("r0", n - kept, 3 * n)] + ([m.Assignment("", kept)] if kept else [])
            for p in core.place(job, bucket, answer):
                placed += [it.payload for it in p.items]
                assert len(p.shares) == len(p.items)
        if not core:
            break
        assert step < 200, "prompts held forever"
    assert sorted(placed) == sorted(inserted)


# --- the router's decider ---------------------------------------------------------------


def status(name: str, now: float, outstanding: int = 0, ready: bool = True) -> m.EngineStatus:
    return m.EngineStatus(replica=name, ts=now, ready=ready, outstanding_tokens=outstanding, window=4, kv_blocks=64,
                          block_size=16)


def test_decider_answers_retry_after_and_asks_the_policy_again_only_after_a_change(monkeypatch):
    core = Decider(RouterConfig(policy="prefix-aware", replica_cap_tokens=1000))
    req = m.RouteRequest("node0", 4, 600, [1, 2])
    assert core.decide(0.0, req).reply.retry_after == RETRY_NONE_LIVE  # none up yet
    assert core.observe(0.0, status("a", 0.0))  # new, with room: freed
    first = core.decide(0.1, req)
    assert first.outcome == "routed" and [a.replica for a in first.reply.assignments] == ["a"]
    core.decide(0.1, m.RouteRequest("node0", 4, 600, [3]))  # a at its cap now
    asked = []
    route = core.policy.route
    monkeypatch.setattr(core.policy, "route", lambda *a, **k: asked.append(1) or route(*a, **k))
    capped = core.decide(0.2, req)
    assert capped.outcome == "retry_after" and capped.reply.retry_after == RETRY_CAPPED and len(asked) == 1
    assert core.decide(0.3, req).outcome == "retry_after" and len(asked) == 1  # nothing changed: not asked
    assert not core.observe(0.4, status("a", 0.4, outstanding=1200))  # still full
    assert core.decide(0.5, req).outcome == "retry_after" and len(asked) == 2
    assert core.observe(0.6, status("b", 0.6))
    again = core.decide(0.7, req)
    assert [a.replica for a in again.reply.assignments] == ["b"] and len(asked) == 3
    assert core.room(0.7) == m.RouterRoom(tokens=400, live=2, eager=True)
    monkeypatch.setattr(decision, "ANSWERS_KEPT", 1)
    core.decide(0.8, m.RouteRequest("node0", 1, 10, bucket="x"))
    assert core.decide(0.8, m.RouteRequest("node0", 1, 10, bucket="x")).outcome == "repeated"
