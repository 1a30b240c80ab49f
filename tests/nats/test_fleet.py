"""A fleet loses a NATS server mid-job and nothing is lost.

Three nodes, each its own network namespace ("machine") with its own address, each running
a nats-server of one JetStream cluster (configured by `prefixflow cluster config`, with
authentication; streams and buckets get 3 replicas by themselves). Nodes 1 and 2 run a
bucketer and an engine-worker (echo engine, ~400 prompts/s each) connected to their own
node's server; node 3 runs the ingestor, router and sink. Everything is started from the
systemd units (`tests/fleet.py`).

No file is shared between the nodes (issue 41): the input is 4 Parquet shards in a real
S3 API server (moto's server mode, on the bridge's address), the output goes to the same
server (`--out s3://...`; the sink's output root is the bucket's prefix and its credentials
are in its node's sink.env), `prefixflow submit` runs from the "laptop" (this namespace,
with `clients/` and the S3 credentials), and each node runs on its own disk (`Fleet`'s
`private_disks`: the other nodes' directories, `clients/` and the test's files are empty
mounts there, the model is the node's own copy at the same path).

One job of 5000 prompts runs without a fault, then the same job again while node 2's
nats-server is SIGKILLed at ~30 % progress; its unit's `Restart=always` (RestartSec=1,
emulated by the harness for every unit) starts it again. Node 2's services fail over to the other servers; the job
completes with every id exactly once and no error rows, and the restarted server rejoins
the cluster (its routes back, a current replica of every stream).

Printed (`pytest -s`): seconds from the kill to the first result after it (any replica,
and node 2's replica), and the job's slowdown, fault wall ÷ no-fault wall, both measured
here in the same test.
"""

from __future__ import annotations

import asyncio
import collections
import json
import subprocess
import time
from pathlib import Path

import nats.errors
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.permissions import kv_stream
from tests.conftest import VENV_BIN
from tests.fleet import Fleet, wait_ready
from tests.nats.test_s3_outputs import assert_final, read_out
from prefixflow.bench.s3server import S3Server

pytestmark = [pytest.mark.nats, pytest.mark.timeout(420)]

N = 5000
ECHO = {"PFX_ENGINE": "echo", "PFX_ECHO_DELAY": "0.02", "PFX_WINDOW": "8"}
REPLICAS = ["nats-1-gpu0", "nats-2-gpu0"]
KILL_AT = 0.3


class Watch:
    """Results on the wire as they arrive (the admin user, core subscription on node 3)."""

    def __init__(self) -> None:
        self.first: dict = {}
        """id -> monotonic time its first result arrived."""
        self.replica_of: dict = {}

    async def start(self, fleet: Fleet, job: str) -> None:
        self.nc = await connect(fleet.url(2), "watch", options=fleet.options("admin"))

        async def on_results(msg) -> None:
            now = time.monotonic()
            for r in m.result_batch_decoder.decode(msg.data).results:
                if r.id not in self.first:
                    self.first[r.id] = now
                    self.replica_of[r.id] = r.replica

        await self.nc.subscribe(subjects.results(subjects.ANY_ORIGIN, job), cb=on_results)

    def after(self, t: float, replica: str | None = None) -> list[float]:
        """Arrival times of new ids after `t` (of one replica), sorted."""
        return sorted(a for i, a in self.first.items() if a > t and (replica is None or self.replica_of[i] == replica))

    async def stop(self) -> None:
        await close(self.nc)


STALL = 1.0
"""A gap between new results longer than this (seconds) is a stall."""


def outage(arrivals: list[float], t_kill: float) -> dict:
    """From the kill on: the stalls (gaps between new results over STALL seconds,
    counting from the kill), and when results flowed again after the last one."""
    times = [t_kill, *arrivals]
    gaps = [(b - a, b) for a, b in zip(times, times[1:]) if b - a > STALL]
    return {
        "first": arrivals[0] - t_kill,
        "stalls": [round(g, 1) for g, _ in gaps],
        "resumed": (gaps[-1][1] - t_kill) if gaps else arrivals[0] - t_kill,
    }


def timeline(watch: Watch, t0: float, step: float = 1.0) -> str:
    """New ids per `step` seconds from the kill on, per replica: `r1/r2 r1/r2 ...`."""
    counts: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for rid, t in watch.first.items():
        if t > t0:
            counts[int((t - t0) // step)][watch.replica_of[rid]] += 1
    return " ".join(f"{counts[k][REPLICAS[0]]}/{counts[k][REPLICAS[1]]}" for k in range(max(counts) + 1))


async def pipeline_state(fleet: Fleet) -> dict:
    """Where a stuck job's prompts are (for the failure message): each stream's message
    count and each consumer's pending, ack-pending, redelivered and delivered/acked
    sequence numbers."""
    nc = await connect(fleet.url(2), "diagnose", options=fleet.options("admin"))
    try:
        js = nc.jetstream()
        state: dict = {}
        for spec in subjects.STREAMS:
            try:
                state[spec.name] = {"messages": (await js.stream_info(spec.name)).state.messages}
                for c in await js.consumers_info(spec.name):
                    state[spec.name][c.name] = (c.num_pending, c.num_ack_pending, c.num_redelivered,
                                                c.delivered.stream_seq, c.ack_floor.stream_seq)
            except Exception as exc:  # noqa: BLE001 - a diagnostic: say what failed
                state[spec.name] = repr(exc)
        return state
    finally:
        await close(nc)


def settled(state: dict) -> bool:
    """No consumer has a message pending or unacknowledged."""
    return all(isinstance(v, dict) and all(c[0] == 0 and c[1] == 0 for k, c in v.items() if k != "messages")
               for v in state.values())


async def drained(fleet: Fleet, timeout: float = 15) -> dict:
    """The pipeline state once every consumer has settled (after a finished job, the last
    acks may still be on their way), or the last one seen at `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        state = await pipeline_state(fleet)
        if settled(state) or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.5)


async def run_job(fleet: Fleet, s3: S3Server, data: str, job: str, fault: bool) -> dict:
    """`prefixflow submit` as the submitter, from the laptop, of `data` (an S3 URI) to
    `s3://.../out/<job>/`; with `fault`, SIGKILL node 2's nats-server once KILL_AT of the
    results are in (its unit restarts it 1 s later)."""
    watch = Watch()
    await watch.start(fleet, job)
    argv = [str(VENV_BIN / "prefixflow"), "submit", data, "--out", s3.uri(f"out/{job}/"), "--job", job,
            "--max-tokens", "4", "--no-progress", "--no-report", "--timeout", "300"]
    proc = subprocess.Popen(argv, env={**fleet.cli_env(2), **s3.env}, cwd=fleet.workdir / "laptop",
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    t_kill = None
    while proc.poll() is None:
        if fault and t_kill is None and len(watch.first) >= KILL_AT * N:
            t_kill = time.monotonic()
            fleet.kill("nats-2")  # its unit's Restart=always starts it again 1 s later
        await asyncio.sleep(0.01)
    output = proc.stdout.read()  # type: ignore[union-attr]
    await watch.stop()
    assert proc.returncode == 0, f"{output}\npipeline: {await pipeline_state(fleet)}"
    summary = json.loads(s3.filesystem().open_input_stream(f"{s3.bucket}/out/{job}/_summary.json").read())
    result = {"wall": summary["wall_seconds"], "out": f"out/{job}"}
    if fault:
        before = sum(1 for t in watch.first.values() if t <= t_kill)
        assert t_kill is not None and before < N, "the kill landed mid-job"
        node2 = watch.after(t_kill, REPLICAS[1])
        assert node2, "node 2's engine delivered results after its server died"
        result.update(
            rows_before_kill=before,
            any=outage(watch.after(t_kill), t_kill),
            node2=outage(node2, t_kill),
            timeline=timeline(watch, t_kill),
        )
    return result


def assert_exactly_once(s3: S3Server, prefix: str, want: pa.Table) -> None:
    """Only committed objects under the prefix (no multipart upload open), a plain dataset
    read of it sees every id once, input columns as they went in, no error rows."""
    assert_final(s3, prefix)
    table = read_out(s3, prefix)
    assert table.column("id").to_pylist() == list(range(N)), "every id exactly once"
    assert table.column("error").null_count == N, "no error rows"
    for name in want.column_names:
        assert table.column(name).equals(want.column(name)), name


def assert_private(fleet: Fleet, data: Path) -> None:
    """Each node sees its own directories only: not another node's config or store, not
    the people's configs, not the test's input file."""
    for i in range(fleet.n):
        def sees(path: Path) -> bool:
            return subprocess.run(fleet.prefix(i) + ["test", "-e", str(path)], timeout=30).returncode == 0

        other = (i + 1) % fleet.n
        assert sees(fleet.etc(i) / "env") and sees(fleet.model / "config.json"), f"node {i + 1} sees its own"
        for path in (fleet.etc(other) / "env", fleet.home(other) / "nats", fleet.etc_root / "clients" / "env", data):
            assert not sees(path), f"node {i + 1} sees {path}"


async def rejoined(fleet: Fleet, timeout: float = 60) -> dict:
    """Node 2's server is back in the cluster: connected to it alone, it knows all 3
    servers, and it holds a current replica of every stream and bucket."""
    url = fleet.url(1).split(",")[0]
    nc = await connect(url, "rejoin-check", options=fleet.options("admin"))
    try:
        assert nc.connected_url.netloc == url.split("://")[1]
        js = nc.jetstream()
        names = [s.name for s in subjects.STREAMS] + [kv_stream(subjects.JOBS_KV), kv_stream(subjects.JOB_STATUS_KV)]
        deadline = time.monotonic() + timeout
        while True:
            state = {}
            for name in names:
                try:
                    info = await js.stream_info(name)
                except nats.errors.Error as exc:  # no answer while the restarted server catches up: not yet
                    state[name] = (0, repr(exc))
                    continue
                peers = {info.cluster.leader: True, **{r.name: r.current for r in info.cluster.replicas or []}}
                state[name] = (info.config.num_replicas, peers.get("nats-2", False))
            if all(n == 3 and current is True for n, current in state.values()) and len(nc._server_info.get("connect_urls", [])) == 3:
                return state
            assert time.monotonic() < deadline, f"nats-2 did not rejoin: {state}"
            await asyncio.sleep(0.5)
    finally:
        await close(nc)


def connections(fleet: Fleet, name: str) -> list[tuple[str, str]]:
    """(event, server) of a service's NATS connection log lines, in order."""
    out = []
    for line in fleet.procs[name].log.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") in ("nats connected", "nats reconnected", "nats disconnected"):
                out.append((rec["event"], rec.get("server")))
    return out


def test_fleet_survives_losing_a_nats_server_mid_job(tmp_path, tiny_model):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=16, num_prefixes=24, seed=12)
    want = pa.Table.from_pylist([{"id": r["id"], "prompt": r["prompt"], "tag": f"row-{r['id']}"} for r in table.to_pylist()])
    (tmp_path / "data").mkdir()
    data = tmp_path / "data" / "prompts.parquet"  # the laptop's file, uploaded as 4 shards
    pq.write_table(want, data)

    fleet = Fleet(tmp_path / "fleet", 3, model=tiny_model, hide=(tmp_path / "data",), out_root="s3://pfx-data/out")
    fleet.private_disks = fleet.lan is not None  # root: each node on its own disk too
    (fleet.workdir / "laptop").mkdir()
    s3 = None
    try:
        fleet.start()  # the bridge first: the S3 server listens on its address, for every node
        s3 = S3Server(tmp_path / "moto.log", bucket="pfx-data", host=fleet.lan.bridge_addr if fleet.lan else "127.0.0.1").start()
        fs = s3.filesystem()
        step = -(-N // 4)
        for k in range(4):
            pq.write_table(want.slice(k * step, step), f"{s3.bucket}/in/part-{k}.parquet", filesystem=fs)
        # The operator gives the sink's node its object-store credentials (sink.env).
        with (fleet.etc(2) / "sink.env").open("a") as f:
            f.writelines(f"{k}={v}\n" for k, v in s3.env.items())
        if fleet.private_disks:
            assert_private(fleet, data)
        for i in (0, 1):
            fleet.service("prefixflow-bucketer.service", i)
            fleet.service("prefixflow-engine@.service", i, instance="0", env=ECHO)
        for unit in ("ingestor", "router", "sink"):
            fleet.service(f"prefixflow-{unit}.service", 2)
        startup = asyncio.run(wait_ready(fleet.url(2), fleet.options("admin"), REPLICAS, 90, fleet.check_alive))
        print(f"\nfleet ready in {startup:.1f} s ({'network namespaces' if fleet.lan else 'loopback'})")

        base = asyncio.run(run_job(fleet, s3, s3.uri("in/"), "no-fault", fault=False))
        assert_exactly_once(s3, base["out"], want)
        state = asyncio.run(drained(fleet))
        assert settled(state) and state["PFX_WORK"]["messages"] == 0, f"work left behind after the job: {state}"
        hurt = asyncio.run(run_job(fleet, s3, s3.uri("in/"), "nats-killed", fault=True))
        assert_exactly_once(s3, hurt["out"], want)
        assert not any(fleet.out_root.iterdir()), "nothing written to a local disk"
        state = asyncio.run(rejoined(fleet))

        # Each node's services were on their own node's server; node 2's moved away when it died.
        own = {i: fleet.url(i).split(",")[0].split("://")[1] for i in range(3)}
        for i in (0, 1):
            for unit in ("bucketer", "engine0"):
                events = connections(fleet, f"{unit}@nats-{i + 1}")
                assert events[0] == ("nats connected", own[i]), events
        moved = [s for e, s in connections(fleet, "engine0@nats-2") if e == "nats reconnected"]
        assert moved and moved[0] != own[1], moved

        restarts = fleet.restarts()
        assert restarts == {"nats-2": 1}, f"only the killed server restarted; services failed over in process: {restarts}"
        ratio = hurt["wall"] / base["wall"]
        anyr, node2 = hurt["any"], hurt["node2"]
        print(
            f"job of {N} prompts: no fault {base['wall']:.2f} s; nats-2 SIGKILLed after {hurt['rows_before_kill']} rows "
            f"(restarted by Restart=always 1 s later): {hurt['wall']:.2f} s -> slowdown x{ratio:.2f} "
            f"(+{hurt['wall'] - base['wall']:.1f} s)\n"
            f"kill -> first new result {anyr['first']:.2f} s; stalls over {STALL:g} s: {anyr['stalls']}; "
            f"results flowing again {anyr['resumed']:.2f} s after the kill\n"
            f"node 2's replica (reconnected to {moved[0]}): first result {node2['first']:.2f} s, "
            f"flowing again {node2['resumed']:.2f} s after the kill\n"
            f"new results per second from the kill ({REPLICAS[0]}/{REPLICAS[1]}): {hurt['timeline']}\n"
            f"nats-2 rejoined: {', '.join(sorted(state))} R3 with nats-2 current"
        )
    finally:
        fleet.stop()
        if s3 is not None:
            s3.stop()
