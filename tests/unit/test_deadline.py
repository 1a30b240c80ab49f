"""`time_limit`: Python code past its limit is stopped in its own thread, code within it
is untouched (no exception leaks out later), and the watchdog serves many threads."""

from __future__ import annotations

import threading
import time

import pytest

from prefixflow.shared.process.deadline import TimeLimit, time_limit

pytestmark = pytest.mark.unit


def spin(seconds: float) -> int:
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        n += 1
    return n


def test_a_loop_past_its_limit_is_stopped_and_quick_code_is_untouched():
    start = time.monotonic()
    with pytest.raises(TimeLimit, match="0.2 s"):
        with time_limit(0.2):
            spin(60)
    assert time.monotonic() - start < 5
    for _ in range(2000):  # many short calls: never a stray exception afterwards
        with time_limit(0.5):
            sum(range(100))
    spin(0.7)  # past every limit armed above: nothing fires
    with time_limit(0):
        spin(0.01)


def test_an_exception_that_wraps_the_time_limit_is_still_a_time_limit():
    def wrapped():
        try:
            spin(60)
        except TimeLimit as exc:
            raise ValueError("template error") from exc

    with pytest.raises(TimeLimit):
        with time_limit(0.2):
            wrapped()


def test_threads_have_their_own_limits():
    results: dict[str, str] = {}

    def run(name: str, seconds: float, work: float) -> None:
        try:
            with time_limit(seconds):
                spin(work)
            results[name] = "done"
        except TimeLimit:
            results[name] = "stopped"

    threads = [threading.Thread(target=run, args=("slow", 0.3, 30)), threading.Thread(target=run, args=("quick", 5, 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert results == {"slow": "stopped", "quick": "done"}


def test_the_limit_counts_cpu_time_not_wall_time():
    """A block that waits (a descheduled thread, a stopped process, the GIL held
    elsewhere: the wall clock runs, the thread's CPU clock does not) is never stopped;
    one that computes is stopped after its limit of CPU time."""
    with time_limit(0.2):
        time.sleep(0.6)  # 3x the limit in wall time, ~0 in CPU time
        spin(0.05)
    start = time.thread_time()
    with pytest.raises(TimeLimit):
        with time_limit(0.3):
            while True:
                time.sleep(0.01)  # half waiting, half computing: the CPU clock runs slower
                spin(0.01)
    assert 0.3 <= time.thread_time() - start < 2
