"""A time limit on Python code that runs in the calling thread: `time_limit(seconds)`.

Why not a process or a thread with a timeout: a chat template (Jinja, compiled to Python
code) runs in the ingestor's planning thread once per chat row; a process per render
costs far more than the render, and a thread that overruns cannot be stopped, only
abandoned while it burns a core. Here one watchdog thread (shared by every caller) raises
`TimeLimit` *inside* the overrunning thread (`PyThreadState_SetAsyncExc`, CPython's
asynchronous exception, delivered at the thread's next bytecode), so a template with
nested `range(100000)` loops stops at its limit and the thread goes on with the next row.

The limit counts the thread's own CPU time (its POSIX thread CPU clock), not wall time:
a healthy render on a loaded machine (the thread descheduled, the GIL held by another
thread, the process stopped) is never mistaken for a runaway template; a template that
loops burns CPU and is stopped after `seconds` of it.

Limits: code stuck inside one long C call (a huge regex, a C extension's loop) gets the
exception only when that call returns; callers bound such inputs otherwise (sizes and
depths: `prefixflow/shared/wire/limits.py`). Costs per call: a lock and, when the watchdog
is idle, one notify; the watchdog wakes about once per limit, not per call.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


class TimeLimit(Exception):  # noqa: N818 - named for what it is, like TimeoutError
    """The code ran past its time limit (`seconds`)."""

    def __init__(self, seconds: float = 0.0) -> None:
        super().__init__(f"ran past its time limit of {seconds:g} s")
        self.seconds = seconds


def _raise_in(thread_id: int, exc: type[BaseException] | None) -> None:
    """Raise `exc` in the thread asynchronously (None: clear one not yet delivered)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(exc) if exc else None)


def _cpu_clock(thread_id: int) -> int:
    return time.pthread_getcpuclockid(thread_id)


def _cpu_used(clock: int) -> float:
    try:
        return time.clock_gettime(clock)
    except OSError:  # the thread is gone
        return float("inf")


MIN_WAIT = 0.005
"""Seconds the watchdog sleeps at least between checks (a thread that waits with a little
CPU time left is checked this often, not continuously)."""


class _Watchdog:
    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.armed: dict[int, list] = {}
        """token -> [thread id, its CPU clock, CPU time at the end of its limit, fired]."""
        self.next = 0
        self.thread: threading.Thread | None = None

    def arm(self, seconds: float) -> int:
        tid = threading.get_ident()
        clock = _cpu_clock(tid)
        with self.cond:
            token = self.next = self.next + 1
            idle = not any(not e[3] for e in self.armed.values())
            self.armed[token] = [tid, clock, time.clock_gettime(clock) + seconds, False]
            if self.thread is None:
                self.thread = threading.Thread(target=self.run, name="time-limit watchdog", daemon=True)
                self.thread.start()
            elif idle:
                self.cond.notify()
        return token

    def disarm(self, token: int) -> bool:
        """Whether it fired (a pending exception not yet delivered is cleared)."""
        with self.cond:
            tid, _, _, fired = self.armed.pop(token, (0, 0, 0.0, False))
            if fired:
                _raise_in(tid, None)
        return fired

    def run(self) -> None:
        with self.cond:
            while True:
                left: list[float] = []
                for entry in self.armed.values():
                    if entry[3]:
                        continue
                    rest = entry[2] - _cpu_used(entry[1])
                    if rest <= 0:
                        entry[3] = True
                        _raise_in(entry[0], TimeLimit)
                    else:
                        left.append(rest)
                # A thread's CPU clock runs no faster than the wall clock: nothing is due
                # before the least CPU time left has passed.
                self.cond.wait(timeout=max(min(left), MIN_WAIT) if left else None)


_watchdog = _Watchdog()


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Run the block with a time limit: `TimeLimit(seconds)` is raised inside it once its
    thread has used `seconds` of CPU time in it (0 or less: no limit). Not nestable within one thread."""
    if seconds <= 0:
        yield
        return
    token = _watchdog.arm(seconds)
    try:
        yield
    except TimeLimit:
        _watchdog.disarm(token)
        raise TimeLimit(seconds) from None
    except BaseException:
        if _watchdog.disarm(token):
            raise TimeLimit(seconds) from None
        raise
    if _watchdog.disarm(token):
        raise TimeLimit(seconds)
