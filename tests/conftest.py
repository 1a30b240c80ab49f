"""Shared fixtures: the tiny model, a real nats-server, and real clusters.

- `tiny_model`: the locally built random-weight model (built once per session).
- `nats_server`: a fresh `nats-server --jetstream` on a free port with a temporary store.
- `vllm_cluster`: the Procfile under `honcho start`, exactly as a user runs it, with two
  real vLLM replicas; session-scoped because an engine takes ~30-45 s to start.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from prefixflow.launch.local_cluster import free_port, wait_replicas_ready  # noqa: F401 - re-exported for tests
from prefixflow.datagen.make_model import make_model
from prefixflow.shared.bus import control
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.process.logs import setup_logging
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

pytest_plugins = ["tests.tiers", "tests.cpu_account", "pytester"]

setup_logging("tests", fmt="console", level="warning")

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent

# Every vLLM engine the suite starts (honcho's, `run`'s, the shared clusters') reserves
# this much KV cache: 1 GiB holds 512k tokens of the local model (2 KiB a token), far
# more than any test uses, where the product's default of 2 GiB would put ~3.4 GB per
# engine and several clusters at once past this machine's memory.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


E2E_ORDER = (
    # The honcho cluster's tests, then the one that kills an engine core under it.
    ("tests/e2e/test_batch_api_vllm.py::test_openai_client_runs_batches_on_vllm", "tests/e2e/test_e2e.py::test_prefix",
     "tests/e2e/test_e2e.py::test_bad_input", "tests/e2e/test_embeddings.py::test_generate_cluster", "tests/e2e/test_jobs.py::",
     "tests/e2e/test_input_types_vllm.py::"),
    ("tests/e2e/test_honcho_engine_kill.py::",),
    # The pairs on a shared cluster of special engines (`Clusters`), a pair at a time.
    ("tests/e2e/test_batch_api_vllm.py::test_an_embeddings_batch", "tests/e2e/test_embeddings.py::test_embed_job"),
    (),  # every other e2e test: starts its own processes (`run`, chaos, start-up)
    # On one cluster (`special_vllm_cluster`): the LoRA tests, the KV-events tests, then the
    # engine-kill tests, last: nothing after them depends on a recovery.
    ("tests/e2e/test_lora.py::",),
    ("tests/e2e/test_kv_events.py::",),
    ("tests/e2e/test_e2e.py::test_vllm_replica_killed_at_a_third_fails_over", "tests/e2e/test_engine_core_kill.py::"),
)
"""The e2e tests in groups by the cluster they share, each group's cluster started once
and stopped when the next group starts (`release_shared_vllm`). The e2e tier comes first:
under xdist it is one work unit, the longest, and must start at once."""


def e2e_rank(nodeid: str) -> int:
    if not nodeid.startswith("tests/e2e/"):
        return len(E2E_ORDER)
    own = next(i for i, group in enumerate(E2E_ORDER) if not group)
    return next((i for i, group in enumerate(E2E_ORDER) if group and nodeid.startswith(group)), own)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: e2e_rank(item.nodeid))  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def sink_out_root(tmp_path_factory) -> Path:
    """The sink writes only under its output root (`PFX_OUT_ROOT`, default its working
    directory: the repository here). Tests write their jobs under pytest's temporary
    directory, so that is the root of every sink they start (inherited through the
    environment)."""
    root = tmp_path_factory.getbasetemp()
    os.environ.setdefault("PFX_OUT_ROOT", str(root))
    return root


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 API server (moto's server mode) on a loopback port, with a bucket and one
    access key (`tests/s3server.py`); authentication on."""
    from prefixflow.bench.s3server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.getbasetemp() / "prefixflow-tiny-llama")


class NatsServer:
    def __init__(self, store: Path) -> None:
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.store = store
        self.proc: subprocess.Popen | None = None

    def start(self) -> NatsServer:
        argv = [str(VENV_BIN / "nats-server"), "--jetstream", "--store_dir", str(self.store), "--addr", "127.0.0.1", "--port", str(self.port)]
        self.proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 20
        for line in self.proc.stderr:  # type: ignore[union-attr]
            if "Server is ready" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("nats-server did not start")
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


class HonchoCluster:
    """`honcho start` on the repository's Procfile with a private port and store."""

    def __init__(self, workdir: Path, model: Path, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.log = workdir / "honcho.log"
        self.env = {
            **os.environ,
            "PATH": f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PFX_NATS_URL": self.url,
            "PFX_NATS_STORE": str(workdir / "nats"),
            "PFX_MODEL": str(model),
            "PFX_LOG_FORMAT": "json",
            "PFX_PORT": str(free_port()),  # the batch API's (the Procfile's `api` line)
            **(env or {}),
        }
        self.proc: subprocess.Popen | None = None

    def start(self) -> HonchoCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "honcho"), "-f", str(REPO / "Procfile"), "-d", str(REPO), "start"],
                env=self.env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"honcho exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # honcho forwards it to every process
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


# The session cluster's KV cache is constrained (128 blocks of 128 tokens per replica) so
# test datasets do not fit and eviction is real; the bucketer's buffer is small so that a
# prefix's prompts leave in several fragments, as in a stream far larger than the buffer
# (where routing decides the hit rate).
CLUSTER_KV_BLOCKS = 128
CLUSTER_BUFFER_PROMPTS = 64


IDLE_WAIT = 60.0
"""Seconds a shared cluster has to drain what an earlier test left running."""


def fit_for_a_test(cluster, replicas: list[str], policy: str) -> bool:
    """The check a shared cluster passes before each test that takes it: every process
    alive, every replica ready and idle, the router back on `policy` (empty: the
    default). False: start it again."""
    from prefixflow.shared.process.config import RouterConfig

    try:
        cluster.check_alive()
        if not asyncio.run(wait_idle(cluster.url, replicas, IDLE_WAIT)):
            return False
        asyncio.run(set_policy(cluster.url, policy or RouterConfig().policy))
        return True
    except Exception:  # noqa: BLE001 - any failure of the check means: start it again
        return False


class SharedHoncho:
    """The Procfile under `honcho start` with two real vLLM replicas, shared by the tests
    that only submit jobs to it (`vllm_cluster`): started when first asked for, checked
    before each test (honcho alive, replicas ready and idle, the router on its default
    policy) and started again if a test left it broken; stopped once the e2e tests that
    use it are done (`release_shared_vllm`)."""

    def __init__(self, base: Path, model: Path) -> None:
        self.base, self.model = base, model
        self.cluster: HonchoCluster | None = None
        self.starts = 0

    def get(self) -> HonchoCluster:
        if self.cluster is not None and not fit_for_a_test(self.cluster, ["r0", "r1"], ""):
            print(f"\nthe shared honcho cluster failed its check: starting it again ({self.cluster.log})")
            self.stop()
        if self.cluster is None:
            self.starts += 1
            env = {"PFX_KV_CACHE_BLOCKS": str(CLUSTER_KV_BLOCKS), "PFX_BUFFER_PROMPTS": str(CLUSTER_BUFFER_PROMPTS)}
            cluster = HonchoCluster(self.base / f"honcho-{self.starts}", self.model, env).start()
            self.cluster = cluster
            startup = asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 300, cluster.check_alive))
            print(f"\ncluster ready in {startup:.1f} s (honcho log: {cluster.log})")
        return self.cluster

    def stop(self) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None


@pytest.fixture(scope="session")
def shared_honcho(tmp_path_factory, tiny_model):
    shared = SharedHoncho(tmp_path_factory.mktemp("honcho-cluster"), tiny_model)
    SHARED_VLLM.append(shared)
    yield shared
    shared.stop()


@pytest.fixture
def vllm_cluster(shared_honcho) -> HonchoCluster:
    return shared_honcho.get()


async def wait_for_router(nc, attempts: int = 100) -> None:
    """Return once the router answers route requests (a zero-prompt probe), or after
    `attempts` tries (the caller's next request then says what is wrong)."""
    for _ in range(attempts):
        try:
            await nc.request(subjects.ROUTE, m.encode(m.RouteRequest("probe", 0, 0)), timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - not up yet
            await asyncio.sleep(0.2)


@contextlib.contextmanager
def router_process(url: str, log_path: Path, **env: str):
    """The router as its own process (`python -m prefixflow.cli.main serve router`) on `url`, its JSON
    log in `log_path`; `env`: more `PFX_*` settings. Terminated on exit."""
    full = {**os.environ, "PFX_NATS_URL": url, "PFX_LOG_FORMAT": "json", **env}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "prefixflow.cli.main", "serve", "router"], env=full, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(10)


async def set_policy(url: str, policy: str) -> None:
    nc = await connect(url, "tests")
    try:
        assert await control.set_policy(nc, policy, timeout=5) == m.ControlReply(True, policy)
    finally:
        await close(nc)


async def reset_prefix_caches(url: str, replicas: list[str], busy_for: float = 30.0) -> None:
    """Empty the replicas' prefix caches; vLLM refuses ("busy") while blocks are still
    held (the last requests of a job finishing): asked again for up to `busy_for` s."""
    nc = await connect(url, "tests")
    try:
        for r in replicas:
            deadline = time.monotonic() + busy_for
            while True:
                reply = await control.reset_prefix_cache(nc, r)
                if reply.ok or reply.detail != "busy" or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            assert reply.ok, (r, reply.detail)
    finally:
        await close(nc)


def start_api(env: dict[str, str], log: Path, timeout: float = 60) -> subprocess.Popen:
    """`prefixflow serve api` with `env` over this process's environment, its output in
    `log`; returns once it logs that it is ready (a client connecting before that is
    refused: the cluster it serves may well be up long before it)."""
    proc = subprocess.Popen([str(VENV_BIN / "prefixflow"), "serve", "api"], cwd=REPO, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + timeout
    while "api ready" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the batch API did not start:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)
    return proc


def run_cli(*args: str, timeout: float = 600, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run the `prefixflow` console script as a user would."""
    return subprocess.run(
        [str(VENV_BIN / "prefixflow"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


async def cluster_ready(cluster, replicas: list[str], timeout: float) -> None:
    """Every replica ready, and every process's ready line logged: a replica can be ready
    before the sink has subscribed to its done queries (a test's first done query then
    finds no responder: seen on CI with the e2e tier loading the other core)."""
    t0 = time.monotonic()
    await cluster.wait_ready(replicas, timeout)
    await cluster.wait_started(list(cluster.running), max(1.0, timeout - (time.monotonic() - t0)))


@contextlib.contextmanager
def echo_cluster_at(workdir: Path, model: Path, replicas: int = 1, engine_args: tuple[str, ...] = (),
                    env: dict[str, str] | None = None):
    """A local cluster of echo engines (`prefixflow.launch.local_cluster`) in `workdir`, ready, of
    its own (for tests that break or reconfigure it; others take `echo_clusters`)."""
    from prefixflow.launch.local_cluster import LocalCluster, processes

    cluster = LocalCluster(processes(replicas, engine="echo", extra_engine_args=list(engine_args)), workdir=workdir,
                           env={"PFX_MODEL": str(model), **(env or {})})
    cluster.start()
    try:
        asyncio.run(cluster_ready(cluster, [f"r{i}" for i in range(replicas)], 90))
        yield cluster
    finally:
        cluster.stop()


async def wait_idle(url: str, replicas: list[str], timeout: float) -> bool:
    """Whether every replica reports ready and holding no prompt in two status rounds in
    a row within `timeout` seconds (what a test left running has drained)."""
    nc = await connect(url, "tests-idle")
    quiet: dict[str, int] = {}

    async def on_status(msg) -> None:
        st = m.engine_status_decoder.decode(msg.data)
        if st.replica in replicas:
            quiet[st.replica] = quiet.get(st.replica, 0) + 1 if st.ready and not st.inflight and not st.jobs else 0

    await nc.subscribe(subjects.ALL_STATUS, cb=on_status)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(quiet.get(r, 0) >= 2 for r in replicas):
                return True
            await asyncio.sleep(0.1)
        return False
    finally:
        await close(nc)


class Clusters:
    """Local clusters shared by the whole session, one per (engine, replicas, engine
    arguments, environment): jobs are isolated by job id and output directory, so tests
    that only submit jobs share one instead of each starting its own.

    Before each test that takes one (`get`), the cluster is checked: every process alive,
    every replica ready and idle (what an earlier test left running has drained), the
    router back on the cluster's own policy. One that fails the check is stopped and
    started again, so a test that broke it does not fail the tests after it. A test may
    kill and restart a shared cluster's processes (`cluster.start_one`) as long as it
    leaves them running; the check catches one that did not."""

    KEEP = {"echo": 1, "vllm": 1}
    """Clusters of each engine kept running at once (least recently used stopped first):
    an echo cluster is ~8 processes of a few hundred MB, a vLLM one holds two engines."""
    READY = {"echo": 90.0, "vllm": 400.0}

    def __init__(self, base: Path, model: Path) -> None:
        self.base, self.model = base, model
        self.clusters: dict[tuple, object] = {}
        self.starts: dict[str, int] = {"echo": 0, "vllm": 0}

    def get(self, replicas: int = 1, engine_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
            engine: str = "echo"):
        from prefixflow.launch.local_cluster import LocalCluster, processes

        env = dict(env or {})
        key = (engine, replicas, tuple(engine_args), tuple(sorted(env.items())))
        names = [f"r{i}" for i in range(replicas)]
        cluster = self.clusters.get(key)
        if cluster is not None and not fit_for_a_test(cluster, names, env.get("PFX_POLICY", "")):
            print(f"\nshared cluster {key} failed its check: starting it again")
            self.clusters.pop(key).stop()
            cluster = None
        if cluster is None:
            while sum(k[0] == engine for k in self.clusters) >= self.KEEP[engine]:
                self.clusters.pop(next(k for k in self.clusters if k[0] == engine)).stop()
            self.starts[engine] += 1
            cluster = LocalCluster(processes(replicas, engine=engine, extra_engine_args=list(engine_args)),
                                   workdir=self.base / f"{engine}-{sum(self.starts.values())}",
                                   env={"PFX_MODEL": str(self.model), **env})
            self.clusters[key] = cluster
            cluster.start()
            asyncio.run(cluster_ready(cluster, names, self.READY[engine]))
        self.clusters[key] = self.clusters.pop(key)  # most recently used last
        return cluster

    def release(self, engine: str) -> None:
        """Stop the clusters of this engine kind (started again when asked for)."""
        for key in [k for k in self.clusters if k[0] == engine]:
            self.clusters.pop(key).stop()

    def stop(self) -> None:
        for cluster in self.clusters.values():
            cluster.stop()
        self.clusters.clear()


@pytest.fixture(scope="session")
def clusters(tmp_path_factory, tiny_model):
    """The session's shared local clusters (`Clusters.get`)."""
    shared = Clusters(tmp_path_factory.mktemp("clusters"), tiny_model)
    SHARED_VLLM.append(shared)
    yield shared
    shared.stop()


SHARED_VLLM: list = []
"""The session's holders of shared clusters (`SharedHoncho`, `Clusters`) once created."""


@pytest.fixture(autouse=True)
def release_shared_vllm(request):
    """Before an e2e test, stop the shared vLLM clusters it does not use: the e2e tests
    run grouped by the cluster they share (`E2E_ORDER`), so a group's cluster is not
    needed again once the next group starts, and two idle pairs of engines beside a
    test's own would hold most of this machine's memory."""
    if request.node.get_closest_marker("e2e") is not None:
        for shared in SHARED_VLLM:
            if isinstance(shared, SharedHoncho) and "vllm_cluster" not in request.fixturenames:
                shared.stop()
            elif isinstance(shared, Clusters) and "clusters" not in request.fixturenames:
                shared.release("vllm")


LORA_ADAPTERS = ("alpha", "beta", "gamma")
"""The random LoRA adapters of the local model that the special vLLM cluster serves."""


def special_vllm_cluster(clusters: Clusters, tiny_model: Path):
    """The shared cluster of two special vLLM replicas: KV-cache events and a small cache
    (48 blocks of 128 tokens: the KV-events tests want blocks evicted), serving three LoRA
    adapters (`--lora-modules`, `--max-loras 2`). Its tests run in this order
    (`E2E_ORDER`): the LoRA tests, the KV-events tests, then the tests that kill an engine
    worker or an engine core and restart it (each leaves both replicas running; the check
    before each test catches one that did not); the LoRA and KV-events tests empty the
    prefix caches first. One cluster for the three groups: a vLLM pair is ~110 CPU-s and
    ~40-90 s of the suite to start."""
    from prefixflow.datagen.make_lora import make_adapters

    paths = make_adapters(LORA_ADAPTERS, model_dir=tiny_model)
    lora = ["--lora-modules", *(f"{name}={path}" for name, path in paths.items()), "--max-loras", "2"]
    return clusters.get(engine="vllm", replicas=2, engine_args=("--kv-cache-blocks", "48", "--", *lora),
                        env={"PFX_KV_EVENTS": "1", "PFX_BUFFER_PROMPTS": "96", "PFX_DEAD_AFTER": "3",
                             "PFX_LORA_ADAPTERS": ",".join(LORA_ADAPTERS)})


SLOW_ECHO = ("--echo-delay", "0.02", "--window", "8")
"""One replica of these runs ~400 prompts/s: a job of a few thousand rows lasts seconds."""
