"""Restart decisions of `prefixflow run`'s supervisor (`prefixflow/launch/supervisor.py`): backoff,
restart budget, dropping a replica, giving up."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.launch.supervisor import Backoff, Drop, GiveUp, RestartPolicy, Supervisor

pytestmark = pytest.mark.unit


def test_delays_double_from_one_second_and_the_sixth_exit_in_ten_minutes_gives_up():
    b = Backoff()
    b.on_start(0.0)
    delays = []
    now = 0.0
    for _ in range(5):
        now += 3.0  # crashes 3 s after each start: not stable
        d = b.on_exit(now)
        delays.append(d)
        b.on_start(now + d)
        now += d
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0]
    decision = b.on_exit(now + 3.0)
    assert isinstance(decision, GiveUp) and "5 restarts within 10 min" in decision.reason
    assert isinstance(b.on_exit(now + 10_000), GiveUp), "a spent budget stays spent"


def test_delay_is_capped():
    b = Backoff(RestartPolicy(budget=20))
    b.on_start(0.0)
    delays = [b.on_exit(float(i)) for i in range(1, 10)]
    assert delays[-1] == 30.0 and max(delays) == 30.0


def test_a_stable_run_starts_the_backoff_over():
    b = Backoff()
    b.on_start(0.0)
    assert b.on_exit(5.0) == 1.0
    b.on_start(6.0)
    assert b.on_exit(8.0) == 2.0
    b.on_start(10.0)
    assert b.on_exit(10.0 + 60.0) == 1.0, "up for 60 s: healthy again"


def test_old_restarts_leave_the_window():
    def history() -> Backoff:
        b = Backoff()
        for t in (100.0, 200.0, 300.0, 400.0, 500.0):  # 5 stable runs of 90 s
            b.on_start(t - 90)
            assert b.on_exit(t) == 1.0
        return b

    over = history()
    over.on_start(460.0)
    assert isinstance(over.on_exit(550.0), GiveUp), "6th exit within 10 minutes"
    later = history()
    later.on_start(610.0)
    assert later.on_exit(700.0) == 1.0, "the exit at 100 s has left the window"


@given(
    gaps=st.lists(st.floats(0.0, 400.0, allow_nan=False), min_size=1, max_size=40),
    uptimes=st.lists(st.floats(0.0, 200.0, allow_nan=False), min_size=40, max_size=40),
)
def test_budget_and_delay_bounds_hold_for_any_exit_pattern(gaps, uptimes):
    """Whatever the exits: every delay is within [first, max], no window of 10 minutes
    holds more than 5 granted restarts, and after the first GiveUp every answer is GiveUp."""
    p = RestartPolicy()
    b = Backoff(p)
    now = 0.0
    b.on_start(now)
    granted: list[float] = []
    gave_up = False
    prev_delay = 0.0
    for gap, up in zip(gaps, uptimes):
        now += up  # it ran this long, then exited
        d = b.on_exit(now)
        if isinstance(d, GiveUp):
            gave_up = True
            continue
        assert not gave_up, "no restart after giving up"
        assert p.first_delay <= d <= p.max_delay
        if up < p.stable_after and granted:
            assert d >= min(prev_delay, p.max_delay), "exits in a row never shorten the backoff"
        prev_delay = d
        granted.append(now)
        now += d + gap
        b.on_start(now)
    for t in granted:
        assert sum(1 for u in granted if t <= u < t + p.window) <= p.budget


def test_services_give_up_replicas_are_dropped_until_none_is_left():
    names = ["nats", "ingestor", "engine0", "engine1"]
    s = Supervisor(names, {"engine0", "engine1"}, RestartPolicy(budget=1))
    for n in names:
        s.started(n, 0.0)
    assert s.exited("engine0", 1.0) == 1.0
    drop = s.exited("engine0", 5.0)
    assert isinstance(drop, Drop) and "carrying on with engine1" in drop.reason
    assert s.exited("engine1", 6.0) == 1.0
    last = s.exited("engine1", 9.0)
    assert isinstance(last, GiveUp) and "no engine replica can come back" in last.reason
    assert s.exited("nats", 10.0) == 1.0
    assert isinstance(s.exited("nats", 12.0), GiveUp)
    assert s.restarts == {"nats": 1, "ingestor": 0, "engine0": 1, "engine1": 1}


def test_a_single_replica_out_of_budget_gives_up():
    s = Supervisor(["engine0", "sink"], {"engine0"}, RestartPolicy(budget=0))
    s.started("engine0", 0.0)
    assert isinstance(s.exited("engine0", 1.0), GiveUp)


def test_unknown_replica_is_refused():
    with pytest.raises(ValueError):
        Supervisor(["nats"], {"engine0"})


def test_exits_killed_on_purpose_do_not_spend_the_budget():
    """The torture harness kills processes of its long-lived cluster on purpose (seed 7
    round 94: its sixth kill of the engine in ten minutes made the supervisor give up).
    A forgiven exit restarts at the first delay and leaves the budget alone; an exit of
    the process's own making still counts."""
    sup = Supervisor(["engine0", "sink"], {"engine0"})
    now = 0.0
    for _ in range(20):
        sup.started("engine0", now)
        now += 2.0
        sup.forgive("engine0")
        assert sup.exited("engine0", now) == 1.0
    assert sup.restarts["engine0"] == 20 and not sup.dropped
    for _ in range(5):  # its own crashes: the budget as before
        sup.started("engine0", now)
        now += 2.0
        assert isinstance(sup.exited("engine0", now), float)
    sup.started("engine0", now)
    assert isinstance(sup.exited("engine0", now + 2.0), GiveUp)
