"""Child-process guard: no vLLM engine core outlives its engine-worker.

vLLM's `AsyncLLM` runs the engine core (and its workers) in child processes that do not
watch their front-end: when the engine-worker is SIGKILLed or OOM-killed, they live on
as orphans holding the model and the KV cache (GPU memory on a GPU node), and each
restart adds another set. The guard is a tiny process forked at start-up, before any
thread or model exists. Every `interval` it records the worker's descendants; once the
worker is gone it SIGKILLs the ones it recorded (still alive with the same start time)
and exits. It ignores SIGTERM/SIGINT so that a supervisor stopping the process group
lets the worker shut its engine down gracefully first.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from prefixflow.shared.outcomes import Exit

PROC = Path("/proc")


def proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a process, None if it is gone."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None:
                children.setdefault(st[0], []).append((int(entry.name), st[1]))
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for pid, started in children.get(todo.pop(), []):
            if pid not in found:
                found[pid] = started
                todo.append(pid)
    return found


def _watch(worker: int, interval: float) -> None:
    seen: dict[int, int] = {}
    me = os.getpid()
    while os.getppid() == worker:
        now = {pid: started for pid, started in descendants(worker).items() if pid != me}
        if os.getppid() != worker:
            break  # it died during the scan: its children were already handed to init, keep the last view
        seen = now
        time.sleep(interval)
    for pid, started in seen.items():
        st = proc_stat(pid)
        if st is not None and st[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def start_guard(interval: float = 1.0) -> int | None:
    """Fork the guard (Linux only); returns its pid. Call before starting any thread."""
    if not PROC.joinpath("self", "stat").exists():
        return None
    worker = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        _watch(worker, interval)
    finally:
        os._exit(Exit.OK)
