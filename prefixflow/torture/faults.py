"""The torture harness's faults: a plan drawn from the round's `random.Random` (pure), and
an injector that carries it out on real processes at the planned times.

Kinds:
- `sigkill`: SIGKILL one process of the cluster (nats-server, ingestor, bucketer,
  router, an engine-worker, the sink); the supervisor (`prefixflow run`'s, or the
  harness's own for a long-lived cluster) restarts it.
- `sigstop`: SIGSTOP one process for `hold` seconds, then SIGCONT (a long GC pause, a
  VM stall, a process swapped out).
- `disk_full`: the job's `--out` is on a small tmpfs from the start of the round until
  `at` seconds in, when it grows (space returns); or (`target` `until-paused`, a fifth of
  them) until the command ends: a job that fills it pauses, its command exits 75 naming
  the disk, the space returns and the harness runs the same command again, which must
  complete it (every id once). Needs root (`mount`); without it the kind is never drawn
  (the run says so once).
- `api_restart` (batch rounds only): the batch API stopped (`target`: `sigterm`, as
  systemd stops it, or `sigkill`, a crash), down for `hold` seconds, started again; it
  resumes its batches from their records (`prefixflow/torture/api.py`).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger()

KINDS = ("sigkill", "sigstop", "disk_full", "api_restart")
SMALL_FS = "12k"
"""A full disk's size: a few parts' worth, then ENOSPC."""
GROWN_FS = "256m"


UNTIL_PAUSED = "until-paused"
"""A `disk_full` whose space returns only once the command has ended (paused, exit 75)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    at: float
    """Seconds after the job starts (for `disk_full`: when the space returns)."""
    target: str = ""
    """The process (its name in the cluster: `nats`, `sink`, `engine0`, ...); for
    `api_restart` how it stops (`sigterm`, `sigkill`)."""
    hold: float = 0.0
    """`sigstop`: seconds stopped; `api_restart`: seconds down."""

    def __str__(self) -> str:
        if self.kind == "disk_full":
            return "disk_full until the job pauses" if self.target == UNTIL_PAUSED else f"disk_full until {self.at:.1f}s"
        if self.kind == "api_restart":
            return f"api_restart ({self.target}) at {self.at:.1f}s, down {self.hold:.1f}s"
        extra = f" for {self.hold:.1f}s" if self.kind == "sigstop" else ""
        return f"{self.kind} {self.target} at {self.at:.1f}s{extra}"


def plan(rng: random.Random, targets: list[str], *, disk: bool, api: bool = False, max_faults: int = 3,
         within: float = 4.0) -> list[Fault]:
    """The round's faults: none (a fifth of rounds: the contract holds without faults
    too), or 1..`max_faults` of sigkill/sigstop on `targets` within `within` seconds of
    the start, and (`disk`) sometimes a full disk, (`api`) often a restart of the API."""
    if rng.random() < 0.2:
        return []
    faults = []
    for _ in range(rng.randrange(1, max_faults + 1)):
        kind = rng.choice(("sigkill", "sigstop"))
        faults.append(Fault(kind, round(rng.uniform(0.0, within), 2), rng.choice(targets),
                            round(rng.uniform(0.2, 3.0), 2) if kind == "sigstop" else 0.0))
    if disk and rng.random() < 0.3:
        at = round(rng.uniform(1.0, 6.0), 2)  # no further draw: the plans of earlier seeds stay as they were
        faults.append(Fault("disk_full", at, UNTIL_PAUSED if at > 5.0 else ""))
    if api and rng.random() < 0.6:
        faults.append(Fault("api_restart", round(rng.uniform(0.0, within), 2), rng.choice(("sigterm", "sigkill")),
                            round(rng.uniform(0.0, 2.0), 2)))
    return sorted(faults, key=lambda f: f.at)


def can_mount() -> bool:
    return os.geteuid() == 0


def mount_small(path: Path) -> str | None:
    """A small tmpfs at `path` (created); None, or why it could not be mounted."""
    path.mkdir(parents=True, exist_ok=True)
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    return None if res.returncode == 0 else res.stderr.strip() or f"mount exited {res.returncode}"


def grow(path: Path) -> None:
    subprocess.run(["mount", "-o", f"remount,size={GROWN_FS}", str(path)], capture_output=True, check=False)


def unmount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Injector:
    """Carries out a plan: `run(faults, pids, mount)` from when it is called; `pids()`
    gives the current pid of each process (they change as the supervisor restarts them).
    Every stopped process is continued, also when the round is cut short."""

    def __init__(self, counts: Counter, restart_api: Callable[[int, float], Awaitable[str]] | None = None,
                 killed: Callable[[str], None] | None = None) -> None:
        self.counts = counts
        self.killed = killed
        """Told the name of each process killed (its supervisor forgives the exit)."""
        self.done: list[str] = []
        self.stopped: set[int] = set()
        self.restart_api = restart_api
        """`api_restart`: stop the API with a signal, wait, start it (what was done)."""
        self.restarting = False
        """An API restart is under way (cut short: the API may be down, by the harness's doing)."""

    async def run(self, faults: list[Fault], pids: Callable[[], dict[str, int]], mount: Path | None) -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        try:
            for fault in faults:
                await asyncio.sleep(max(0.0, t0 + fault.at - loop.time()))
                await self.one(fault, pids, mount)
        finally:
            self.resume_all()

    async def one(self, fault: Fault, pids: Callable[[], dict[str, int]], mount: Path | None) -> None:
        if fault.kind == "disk_full":
            if fault.target == UNTIL_PAUSED:  # the harness grows it once the command has ended
                self.done.append(f"{fault}: held")
                return
            if mount is not None:
                grow(mount)
                self.done.append(f"{fault}: space returned")
            return
        if fault.kind == "api_restart":
            if self.restart_api is None:
                self.done.append(f"{fault}: no API (skipped)")
                return
            self.restarting = True
            sig = signal.SIGKILL if fault.target == "sigkill" else signal.SIGTERM
            self.note(fault, await self.restart_api(sig, fault.hold))
            self.restarting = False
            return
        pid = pids().get(fault.target)
        if pid is None:
            self.done.append(f"{fault}: no such process now (skipped)")
            return
        try:
            if fault.kind == "sigkill":
                os.kill(pid, signal.SIGKILL)
                if self.killed is not None:  # NOTE: no await in between: the supervisor sees the exit after this
                    self.killed(fault.target)
            else:
                os.kill(pid, signal.SIGSTOP)
                self.stopped.add(pid)
                try:
                    await asyncio.sleep(fault.hold)
                finally:
                    os.kill(pid, signal.SIGCONT)
                    self.stopped.discard(pid)
        except ProcessLookupError:
            self.done.append(f"{fault}: pid {pid} gone (skipped)")
            return
        self.note(fault, f"pid {pid}")

    def note(self, fault: Fault, detail: str) -> None:
        self.counts[fault.kind] += 1
        self.done.append(f"{fault} ({detail})")
        log.info("fault", fault=str(fault), detail=detail)

    def resume_all(self) -> None:
        for pid in list(self.stopped):
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.stopped.discard(pid)
