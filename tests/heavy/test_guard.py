"""prefixflow.services.engine_worker.guard: a SIGKILLed worker leaves no child processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from prefixflow.services.engine_worker.guard import descendants, proc_stat

pytestmark = pytest.mark.heavy

WORKER = """
import subprocess, sys, time
from prefixflow.services.engine_worker.guard import start_guard
start_guard(interval=0.1)
# Like vLLM's engine core: a child that does not watch its parent.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int, started: int) -> bool:
    st = proc_stat(pid)
    return st is not None and st[1] == started


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_children_of_a_dead_worker_are_killed(sig):
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        time.sleep(0.5)  # the guard has recorded the child
        tree = descendants(worker.pid)
        assert child in tree and len(tree) == 2  # the child and the guard
        started = tree[child]
        worker.send_signal(sig)
        worker.wait(10)
        deadline = time.monotonic() + 10
        while alive(child, started):
            assert time.monotonic() < deadline, "child orphaned by its dead worker"
            time.sleep(0.05)
        guard = next(pid for pid in tree if pid != child)
        while alive(guard, tree[guard]):  # the guard exits once it has cleaned up
            assert time.monotonic() < deadline, "guard did not exit"
            time.sleep(0.05)
    finally:
        worker.kill()
        for pid in descendants(worker.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def test_guard_ignores_sigterm_while_the_worker_lives():
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(worker.stdout.readline())
        time.sleep(0.3)
        tree = descendants(worker.pid)
        guard = next(pid for pid in tree if pid != child)
        os.kill(guard, signal.SIGTERM)  # a supervisor signalling the whole process group
        time.sleep(0.5)
        assert proc_stat(guard) is not None and proc_stat(child) is not None
    finally:
        worker.kill()
        worker.wait()
        time.sleep(0.5)


def test_a_worker_dying_during_a_scan_keeps_the_last_view(monkeypatch):
    """The worker dies while the guard lists its descendants: its children are already
    re-parented, so that scan finds none; the guard kills the ones of the scan before
    (a found flake: it used to forget them and kill nothing)."""
    from prefixflow.services.engine_worker import guard

    state = {"parent": 4242, "scans": 0}
    killed = []

    def scan(root):
        state["scans"] += 1
        if state["scans"] == 1:
            return {777: 5}
        state["parent"] = 1  # dies mid-scan: the child already belongs to init
        return {}

    monkeypatch.setattr(guard, "descendants", scan)
    monkeypatch.setattr(guard.os, "getppid", lambda: state["parent"])
    monkeypatch.setattr(guard, "proc_stat", lambda pid: (1, 5) if pid == 777 else None)
    monkeypatch.setattr(guard.os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(guard.time, "sleep", lambda s: None)
    guard._watch(4242, 0.1)
    assert killed == [(777, signal.SIGKILL)]
