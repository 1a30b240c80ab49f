"""A bucketer node gone for good: its prompts are taken over by the live node.

The real cluster (nats-server and every service as OS processes, `echo` engines slowed
so the job lasts a few seconds) with two bucketer nodes. Mid-job, node0's bucketer is
SIGKILLed while it holds prompts, and never restarted. The ingestor, after
`PFX_BUCKETER_GONE_AFTER` (3 s) without a heartbeat, moves what node0's bucket stream
holds to node1 (`prefixflow/services/ingestor/mover.py`): the job completes with every row exactly
once, no error rows, and nothing is left on node0's subject.
"""

from __future__ import annotations

import asyncio
import collections
import time

import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.launch.local_cluster import LocalCluster, processes
from prefixflow.launch.processes import another_bucketer
from prefixflow.services.ingestor.takeover import MOVE_ID_PREFIX
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import wait_replicas_ready

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]

N = 1200
ECHO = ["--echo-delay", "0.05", "--window", "8"]  # ~160 prompts/s per replica


def cluster_for(tmp_path, tiny_model) -> LocalCluster:
    base = processes(2, engine="echo", extra_engine_args=ECHO)
    procs = [p for p in base if p.name != "bucketer"] + [another_bucketer(base, n) for n in ("node0", "node1")]
    env = {"PFX_MODEL": str(tiny_model), "PFX_BUCKETER_GONE_AFTER": "3"}
    return LocalCluster(procs, workdir=tmp_path / "cluster", env=env)


class Observer:
    """Bucket messages and results on the wire (core subscriptions)."""

    def __init__(self) -> None:
        self.sent_to: dict = collections.defaultdict(list)  # prompt id -> nodes, in order
        self.moved_msgs = 0
        self.moved_ids: set = set()
        self.results = 0
        self.hb: set[str] = set()

    async def start(self, url: str, job: str) -> None:
        self.nc = await connect(url, "tests-observer")

        async def on_bucket(msg) -> None:
            node = subjects.bucket_parts(msg.subject)[0]
            moved = (msg.headers or {}).get("Nats-Msg-Id", "").startswith(MOVE_ID_PREFIX + ":")
            self.moved_msgs += moved
            for p in m.prompt_batch_decoder.decode(msg.data).prompts:
                self.sent_to[p.id].append(node)
                if moved:
                    self.moved_ids.add(p.id)

        async def on_results(msg) -> None:
            self.results += len(m.result_batch_decoder.decode(msg.data).results)

        async def on_hb(msg) -> None:
            self.hb.add(m.heartbeat_decoder.decode(msg.data).node)

        await self.nc.subscribe(subjects.node_bucket("*"), cb=on_bucket)
        await self.nc.subscribe(subjects.results(subjects.ANY_ORIGIN, job), cb=on_results)
        await self.nc.subscribe(subjects.ALL_BUCKETER_HEARTBEATS, cb=on_hb)

    async def stop(self) -> None:
        await close(self.nc)


async def held_by(url: str, node: str) -> int:
    """Messages queued for or leased by `node`'s bucketer."""
    nc = await connect(url, "tests-info")
    try:
        info = await nc.jetstream().stream_info(subjects.BUCKET_STREAM.name, subjects_filter=subjects.node_bucket(node))
        return sum((info.state.subjects or {}).values())
    finally:
        await close(nc)


def test_gone_bucketer_prompts_are_taken_over_exactly_once(tmp_path, tiny_model):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=16, num_prefixes=12, seed=11)
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]
    cluster = cluster_for(tmp_path, tiny_model)
    cluster.start()
    out = tmp_path / "out"
    job = "gone-node"
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))

        async def go() -> tuple[m.JobStatus, Observer, int, float]:
            obs = Observer()
            await obs.start(cluster.url, job)
            deadline = time.monotonic() + 30
            while obs.hb != {"node0", "node1"} and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            assert obs.hb == {"node0", "node1"}, obs.hb
            await asyncio.sleep(1.5)  # the ingestor hears both too
            half = N // 2
            async with Submitter(cluster.url) as client:
                spec = m.JobSpec(job=job, out_dir=str(out), sampling=m.SamplingSpec(max_tokens=4))
                await client.create(spec)
                await client.publish_rows(job, rows[:half])
                # Kill node0's bucketer once the job is under way and node0 holds prompts.
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    if obs.results >= 50 and await held_by(cluster.url, "node0") > 0:
                        break
                    await asyncio.sleep(0.05)
                held = await held_by(cluster.url, "node0")
                assert held > 0, "node0 held nothing to take over"
                cluster.running["bucketer-node0"].kill()  # SIGKILL, never restarted
                cluster.running["bucketer-node0"].wait()
                t_kill = time.monotonic()
                await client.publish_rows(job, rows[half:])
                await client.create(m.JobSpec(job=job, out_dir=str(out), sampling=m.SamplingSpec(max_tokens=4), total=N))
                status = await client.wait(job, N, progress=False, timeout=120)
            await asyncio.sleep(0.5)
            await obs.stop()
            return status, obs, held, time.monotonic() - t_kill

        status, obs, held, took = asyncio.run(go())
        print(f"\nnode0 held {held} messages at the kill; {obs.moved_msgs} messages "
              f"({len(obs.moved_ids)} prompts) moved; job done {took:.1f} s after the kill")
        assert status.done and status.rows == N and status.errors == 0, status
        # Every row exactly once, none an error.
        table = pq.read_table(out)
        ids = table.column("id").to_pylist()
        assert len(ids) == len(set(ids)) == N
        assert sorted(ids) == sorted(r["id"] for r in rows)
        assert table.column("error").null_count == table.num_rows, "no error rows"
        # The takeover did it: prompts first sent to node0 came out through node1.
        assert {nodes[0] for nodes in obs.sent_to.values()} == {"node0", "node1"}, "both nodes had prompts"
        assert obs.moved_msgs > 0 and obs.moved_ids
        assert all(obs.sent_to[i][0] == "node0" for i in obs.moved_ids), "only node0's prompts move"
        assert all(nodes[-1] == "node1" for nodes in obs.sent_to.values() if nodes[0] == "node0" and len(nodes) > 1)
        assert asyncio.run(held_by(cluster.url, "node0")) == 0, "nothing left stranded on node0"
        assert cluster.running["bucketer-node0"].poll() is not None, "node0 stayed dead"
    finally:
        cluster.stop()
