"""prefixflow.services.router.failover: moving a dead replica's work is never counted as a failure.

Backpressure (no live replica has room) must not nak the moved batch (each nak is a
delivery, and deliveries count toward the poison limit: healthy prompts would become
error rows); the batch waits, leased, until there is room."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.services.router.failover import Failover
from prefixflow.services.router.fleet import Fleet, Replica
from prefixflow.shared.bus.poison import PRIOR_DELIVERIES, deliveries, moved_headers
from prefixflow.shared.wire import messages as m
from tests.unit import fakes

pytestmark = pytest.mark.unit


def FakeMsg(data: bytes, delivered: int = 1, headers: dict | None = None) -> fakes.FakeMsg:
    return fakes.FakeMsg(data, delivered=delivered, headers=headers)


def work(n: int = 3) -> bytes:
    return m.encode(m.WorkBatch("b1", [m.Prompt("j", i, b"\x00\x00\x00\x01" * 8, max_tokens=4) for i in range(n)], [7]))


def test_no_room_means_wait_leased_not_nak(monkeypatch):
    room = {"open": False}
    published: list[str] = []

    def place(prompts, tokens, key, output, lora):
        return ([(Replica("r1"), prompts)], [tokens]) if room["open"] else None

    async def publish(js, subject, payload, headers=None):
        published.append((subject, headers))

    monkeypatch.setattr("prefixflow.services.router.failover.publish", publish)
    failover = Failover(Fleet(), place)
    failover.js = object()
    msg = FakeMsg(work(), delivered=2)

    async def go() -> None:
        assert not await failover.move(msg)
        failover.waiting.append(msg)
        for _ in range(10):  # ten ticks with every replica full
            await failover.retry_waiting()
        assert "nak" not in msg.calls and msg.calls.count("in_progress") == 10
        room["open"] = True
        await failover.retry_waiting()

    asyncio.run(go())
    assert msg.calls[-1] == "ack" and "nak" not in msg.calls
    assert failover.waiting == []
    # The move carries the failed deliveries only: the failover's own is not one.
    assert published == [("pfx.work.r1", {PRIOR_DELIVERIES: "1"})]


def test_rescue_pulls_nothing_while_no_replica_has_room(monkeypatch):
    fleet = Fleet()
    fleet.observe("r1", 0.0, ready=True, outstanding=10, done_tokens=0)
    fleet.cap_tokens = 5  # r1 is over its cap: no room anywhere
    failover = Failover(fleet, lambda *a: None)

    class Pull:
        fetched = 0

        async def fetch(self, batch, timeout):
            Pull.fetched += 1
            return [FakeMsg(work())]

    failover.rescuing["r0"] = Pull()
    failover.js = object()
    monkeypatch.setattr("prefixflow.services.router.failover.time.monotonic", lambda: 1.0)
    asyncio.run(failover.rescue("r0"))
    assert Pull.fetched == 0 and failover.waiting == []


def test_moved_headers_accumulate_failed_deliveries_only():
    first = FakeMsg(work(), delivered=3)  # two failures at r0, then the failover's fetch
    headers = moved_headers(first)
    assert headers == {PRIOR_DELIVERIES: "2"}
    second = FakeMsg(work(), delivered=1, headers=headers)  # now at r1
    assert deliveries(second) == 3


def test_a_replica_not_ready_for_dead_after_is_rescued_like_a_silent_one(monkeypatch):
    """A worker rebuilding its engine keeps reporting, not ready: its queued work must not
    wait the whole rebuild."""
    fleet = Fleet(dead_after=2.0)
    fleet.observe("r0", 100.0, ready=True, outstanding=0, done_tokens=0)
    fleet.observe("r1", 100.0, ready=True, outstanding=0, done_tokens=0)
    failover = Failover(fleet, lambda *a: None)
    rescued: list[str] = []

    async def rescue(name):
        rescued.append(name)

    monkeypatch.setattr(failover, "rescue", rescue)
    clock = {"now": 100.0}
    monkeypatch.setattr("prefixflow.services.router.failover.time.monotonic", lambda: clock["now"])
    for t in (100.5, 101.0, 101.5, 102.5, 103.0):  # r0 keeps reporting, not ready; r1 ready
        clock["now"] = t
        fleet.observe("r0", t, ready=False, outstanding=0, done_tokens=0)
        fleet.observe("r1", t, ready=True, outstanding=0, done_tokens=0)
        asyncio.run(failover.tick())
    assert rescued == ["r0", "r0"], "rescued from dead_after on, not before"


def test_a_batch_past_the_poison_limit_is_moved_with_its_strikes_not_error_rowed(monkeypatch):
    """The replica that gets it isolates its prompts (its strikes travel with them): the
    router never turns a whole moved batch into error rows."""
    published: list[tuple[str, bytes, dict]] = []

    async def publish(js, subject, payload, headers=None):
        published.append((subject, payload, headers))

    monkeypatch.setattr("prefixflow.services.router.failover.publish", publish)
    place = lambda prompts, tokens, key, output, lora: ([(Replica("r1"), 2), (Replica("r2"), prompts - 2)], [20, 30])  # noqa: E731
    failover = Failover(Fleet(), place)
    failover.js = object()
    batch = m.WorkBatch("b1", [m.Prompt("j", i, b"\x00\x00\x00\x01" * 8, max_tokens=4) for i in range(5)], [7],
                        strikes=[0, 1, 2, 0, 1])
    msg = FakeMsg(m.encode(batch), delivered=7)
    assert asyncio.run(failover.move(msg))
    assert msg.calls == ["ack"]
    parts = [(subject, m.work_batch_decoder.decode(data), headers) for subject, data, headers in published]
    assert [s for s, _, _ in parts] == ["pfx.work.r1", "pfx.work.r2"]
    assert [[p.id for p in w.prompts] for _, w, _ in parts] == [[0, 1], [2, 3, 4]]
    assert [w.strikes for _, w, _ in parts] == [[0, 1], [2, 0, 1]]
    assert [sum(p.cost for p in w.prompts) for _, w, _ in parts] == [20, 30]  # what each replica was charged
    assert all(h == {PRIOR_DELIVERIES: "6"} for _, _, h in parts)
