"""A local cluster as OS processes: what the Procfile runs, and what `prefixflow run` starts
and supervises. The process set and the division of the machine among the engine
replicas are `prefixflow/launch/processes.py` (`processes`, `Process`, re-exported here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import structlog

from prefixflow.launch.processes import Process, keep_result_key, processes  # noqa: F401 - re-exported: the cluster's process set
from prefixflow.launch.supervisor import Drop, GiveUp, RestartPolicy, Supervisor
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()
T = TypeVar("T")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefixflow_argv() -> list[str]:
    exe = shutil.which("prefixflow", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "prefixflow.cli.main"]


async def wait_replicas_ready(
    url: str,
    replicas: list[str],
    timeout: float,
    alive=lambda: None,
    options=None,
    *,
    on_ready: Callable[[str], None] | None = None,
    first_within: bool = False,
) -> float:
    """Wait until every named replica has reported `ready` on its status subject;
    `alive()` runs each round (raise there if a process died); `options`: NATS
    credentials and TLS; `on_ready(name)` as each one first reports ready. `timeout`
    bounds the wait for all of them, or only for the first with `first_within` (the job
    runs on the first while the others start). Returns seconds waited."""
    t0 = time.monotonic()
    nc = await connect(url, "prefixflow-wait", options=options)
    ready: set[str] = set()

    async def on_status(msg) -> None:
        st = m.engine_status_decoder.decode(msg.data)
        if st.ready and st.replica in replicas and st.replica not in ready:
            ready.add(st.replica)
            if on_ready is not None:
                on_ready(st.replica)

    await nc.subscribe(subjects.ALL_STATUS, cb=on_status)
    try:
        while not set(replicas) <= ready:
            alive()
            if time.monotonic() - t0 > timeout and not (first_within and ready):
                raise TimeoutError(f"replicas not ready after {timeout} s: {sorted(set(replicas) - ready)}")
            await asyncio.sleep(0.25)
    finally:
        await close(nc)
    return time.monotonic() - t0


STARTUP_GRACE = 60.0
"""Seconds after its first start during which a process that exits with an error before
it ever logged its ready line fails the run instead of being restarted."""


class ProcessExited(RuntimeError):
    """A process exited where none may (start-up; `check_alive`)."""


class ClusterFailed(RuntimeError):
    """The cluster cannot go on: a process spent its restart budget, or no engine
    replica can come back."""


def ready_marker(p: Process) -> bytes:
    """The log line a process writes once it serves (how the supervisor knows it is back)."""
    if p.args[:2] == ["serve", "nats"]:
        return b"Server is ready"
    return f"{p.args[1]} ready".encode()


PARENT_DEATH_SIGNAL = signal.SIGKILL
"""What a child gets from the kernel when `prefixflow run` dies without stopping it
(SIGKILL, OOM). SIGKILL, not SIGTERM: a cluster whose `run` is gone must write nothing
more. Drained on SIGTERM, its sink would flush the rows it holds into the output while
the user's next `run` of the same command (a new cluster) has already listed what is
done: those rows would be written twice. Killed, it leaves what a crash leaves (rows not
acked: computed again by the next run; a temporary file or an open multipart upload: the
next sink's recovery removes it); a `run` that is asked to stop (SIGTERM, Ctrl-C) still
stops its cluster in order, every service draining."""

try:  # Linux only
    import ctypes

    _prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1

    def _die_with_parent() -> None:
        _prctl(PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _die_with_parent = None  # type: ignore[assignment]


def _has_exited(proc: subprocess.Popen) -> bool:
    """Whether `proc` has exited, without reaping it: while it is a zombie its pid (and
    process group id) cannot be reused, so its group can still be swept safely."""
    if proc.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return proc.poll() is not None
    except AttributeError:  # pragma: no cover - no waitid
        return proc.poll() is not None
    return info is not None and info.si_pid == proc.pid


def _reap(proc: subprocess.Popen) -> int:
    """SIGKILL whatever is left in the exited process's group (a SIGKILLed engine-worker's
    vLLM engine core), then reap it; returns its exit code."""
    if proc.returncode is None:  # not reaped yet: its pid is still ours
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.wait()


class LocalCluster:
    """Start the processes on a free port with a private JetStream store; stop them in
    order (services first, nats-server last) with SIGTERM, then SIGKILL stragglers.

    `supervise()` restarts a process that exits unexpectedly, with the same arguments and
    environment (nats-server on the same port and store), after a backoff and within a
    restart budget (`prefixflow.launch.supervisor`); `supervised(coro)` runs a coroutine (the job) while
    supervising. Each process runs in its own process group, so a Ctrl-C at the terminal
    reaches only `prefixflow run`, which stops them in order; `pids.json` in the workdir
    lists the current pids (for operators and tests), rewritten at every (re)start."""

    def __init__(
        self,
        procs: list[Process],
        *,
        workdir: str | Path | None = None,
        env: dict[str, str] | None = None,
        policy: RestartPolicy | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.procs = procs
        self.by_name = {p.name: p for p in procs}
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="prefixflow-cluster-"))
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            **(env or {}),
            "PFX_NATS_URL": self.url,
            "PFX_NATS_STORE": str(self.workdir / "nats"),
            "PFX_LOG_FORMAT": "json",
        }
        self.running: dict[str, subprocess.Popen] = {}
        self.supervisor = Supervisor([p.name for p in procs], {p.name for p in procs if p.is_engine}, policy)
        self.on_event = on_event or (lambda text: log.warning(text))
        self.due: dict[str, float] = {}
        """Processes waiting for their restart: name -> monotonic time it is due."""
        self.down_since: dict[str, float] = {}
        """name -> when it was seen down (cleared once it is back)."""
        self.coming_back: set[str] = set()
        """Restarted processes not yet ready again (their "back" line is due)."""
        self.scan_from: dict[str, int] = {}
        """name -> where in its log to look for its ready line (this incarnation)."""
        self.ready_now: set[str] = set()
        """Processes whose current incarnation has logged its ready line."""
        self.ever_ready: set[str] = set()
        """Processes that were ready at least once (an exit before that is a start-up error)."""
        self.first_start: dict[str, float] = {}
        self.dropped: set[str] = set()
        self.states: dict[str, str] = {}
        self.stopping = False
        self.started_at = 0.0
        """`time.monotonic()` at `start()`."""

    def uptime(self) -> float:
        """Seconds since `start()`."""
        return time.monotonic() - self.started_at

    # --- starting and stopping -------------------------------------------------------

    def start(self) -> None:
        self.started_at = time.monotonic()
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        keep_result_key(self.procs, self.workdir)  # a --workdir run again: its streams' grants still hold
        for p in self.procs:
            self.start_one(p)

    def log_path(self, name: str) -> Path:
        return self.workdir / "logs" / f"{name}.log"

    def start_one(self, p: Process) -> None:
        self.log_path(p.name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path(p.name), "ab") as logf:
            self.scan_from[p.name] = logf.tell()
            self.ready_now.discard(p.name)
            self.first_start.setdefault(p.name, time.monotonic())
            self.running[p.name] = subprocess.Popen(
                [*prefixflow_argv(), *p.args],
                env={**self.env, **p.env},
                stdout=logf,
                stderr=subprocess.STDOUT,
                process_group=0,
                # NOTE: preexec_fn is unsafe with threads when it takes locks or imports;
                # this one makes a single prctl call through a function resolved at import.
                preexec_fn=_die_with_parent,  # noqa: PLW1509
            )
        self.supervisor.started(p.name, time.monotonic())
        self.states[p.name] = "running"
        self.write_pids()

    def write_pids(self) -> None:
        """`pids.json`: the NATS URL and, per process, its pid, state and restarts."""
        doc = {
            "url": self.url,
            "workdir": str(self.workdir),
            "processes": {
                name: {
                    "pid": proc.pid,
                    "state": self.states.get(name, "running"),
                    "restarts": self.supervisor.restarts[name],
                }
                for name, proc in self.running.items()
            },
        }
        tmp = self.workdir / "pids.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.workdir / "pids.json")

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_path(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        """Raise if any process has exited (start-up, and clusters nobody supervises)."""
        for name, proc in self.running.items():
            if proc.poll() is not None:
                raise ProcessExited(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    async def wait_ready(self, replicas: list[str], timeout: float = 300.0) -> float:
        """Wait until every replica reports ready; returns the seconds it took."""
        return await wait_replicas_ready(self.url, replicas, timeout, self.check_alive)

    async def wait_started(self, names: list[str], timeout: float = 120.0) -> None:
        """Wait until each named process has logged its ready line (raise `ProcessExited`
        if any process exits meanwhile, `TimeoutError` after `timeout`)."""
        deadline = time.monotonic() + timeout
        waiting = [n for n in names if n not in self.ready_now]
        while waiting:
            self.check_alive()
            for name in [n for n in waiting if self._ready(n)]:
                self.ready_now.add(name)
                self.ever_ready.add(name)
                waiting.remove(name)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"not started after {timeout} s: {', '.join(waiting)}")
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        """SIGKILL every process at once (an outage, not a shutdown)."""
        for proc in self.running.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.running.values():
            proc.wait()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the services and wait (SIGKILL after `timeout`), then nats-server;
        whatever is left in each process's group (an engine's vLLM children) is killed."""
        self.stopping = True
        self.due.clear()
        services = [n for n in self.running if n != "nats"]
        for group in (services, ["nats"]):
            procs = [self.running[n] for n in group if n in self.running]
            for proc in procs:
                if not _has_exited(proc):
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                while not _has_exited(proc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                if not _has_exited(proc):
                    proc.kill()
                    while not _has_exited(proc):
                        time.sleep(0.01)
                _reap(proc)
        for name in self.running:
            self.states[name] = "stopped"
        try:
            self.write_pids()
        except OSError:
            pass

    # --- supervision -----------------------------------------------------------------

    def supervise(self) -> None:
        """One round: notice processes that exited, restart those whose backoff is over,
        report those back up. Raises `ClusterFailed` when a restart budget is spent and
        the run cannot go on, or when a process fails before it was ever ready (a bad
        flag or model: restarting it would only fail again)."""
        if self.stopping:
            return
        now = time.monotonic()
        # 1. Ready lines: restarted processes are back.
        for name, proc in self.running.items():
            if name not in self.ready_now and name not in self.due and name not in self.dropped and self._ready(name):
                self.ready_now.add(name)
                self.ever_ready.add(name)
                if name in self.coming_back:
                    self.coming_back.discard(name)
                    down = now - self.down_since.pop(name, now)
                    self.on_event(f"{name} back (pid {proc.pid}, {down:.1f} s after it went down)")
        # 2. Exits: sweep the process's group, then decide.
        for name, proc in list(self.running.items()):
            if name in self.due or name in self.dropped or not _has_exited(proc):
                continue
            code = _reap(proc)
            self.coming_back.discard(name)
            self.down_since.setdefault(name, now)
            if code > 0 and name not in self.ever_ready and now - self.first_start[name] < STARTUP_GRACE:
                self.states[name] = "failed"
                self.write_pids()
                raise ClusterFailed(f"{name} exited with {code} before it was ever ready:\n{self.log_tail(name)}")
            decision = self.supervisor.exited(name, now)
            if isinstance(decision, GiveUp):
                self.states[name] = "failed"
                self.write_pids()
                raise ClusterFailed(f"{name} down (exit {code}): {decision.reason}\n{self.log_tail(name)}")
            if isinstance(decision, Drop):
                self.dropped.add(name)
                self.states[name] = "dropped"
                self.on_event(f"{name} down (exit {code}): {decision.reason}")
            else:
                self.due[name] = now + decision
                self.states[name] = "restarting"
                self.on_event(f"{name} down (exit {code}), restarting in {decision:g} s")
            self.write_pids()
        # 3. Restarts that are due.
        for name, at in list(self.due.items()):
            if now >= at:
                del self.due[name]
                self.start_one(self.by_name[name])
                self.coming_back.add(name)
                log.info("restarted", process=name, pid=self.running[name].pid)

    def _ready(self, name: str) -> bool:
        """Whether the current incarnation of `name` has logged its ready line (reads
        only what is new since the last look)."""
        marker = ready_marker(self.by_name[name])
        try:
            with open(self.log_path(name), "rb") as f:
                f.seek(self.scan_from[name])
                chunk = f.read()
        except OSError:
            return False
        if marker in chunk:
            return True
        # A line may be half written: look at its start again next time.
        self.scan_from[name] += max(0, len(chunk) - len(marker))
        return False

    async def supervise_forever(self, interval: float = 0.25) -> None:
        while True:
            self.supervise()
            await asyncio.sleep(interval)

    async def supervised(self, coro: Awaitable[T]) -> T:
        """Run `coro` while supervising the processes; if the cluster gives up, cancel
        it and raise `ClusterFailed`."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.create_task(self.supervise_forever())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            watch.result()  # raises ClusterFailed
            raise AssertionError("unreachable")
        finally:
            for task in (work, watch):
                task.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)

    def restart_counts(self) -> dict[str, int]:
        return dict(self.supervisor.restarts)
