"""Eager release when a job is larger than the bucketer's buffer.

A lane waits for its job's input to land before it releases early, so that prefix groups
leave whole rather than as fragments of a burst still arriving. A job larger than the
buffer never lands whole: once its lane is full no more of its input can come in until
some leaves, so waiting (up to --eager-delay) only leaves the replicas idle. Here the
buffer holds 64 prompts, the job has 640 and --eager-delay is 60 s: every release must
be an eager one (the replicas had room), none forced by the buffer's bound, and the job
completes with every id once.
"""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import submit
from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.launch.local_cluster import LocalCluster, free_port, processes
from prefixflow.shared.wire import messages as m
from tests.conftest import wait_replicas_ready
from tests.nats.test_observability import scrape, total

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

N = 640
BUFFER = 64


def test_a_job_larger_than_the_buffer_is_released_eagerly(tmp_path, tiny_model):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=32,
                              num_prefixes=16, seed=5)
    data = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]), data)
    procs = processes(2, engine="echo", extra_engine_args=["--echo-delay", "0.01", "--window", "8"])
    port = free_port()
    next(p for p in procs if p.name == "bucketer").env["PFX_METRICS_PORT"] = str(port)
    cluster = LocalCluster(procs, workdir=tmp_path / "cluster",
                           env={"PFX_MODEL": str(tiny_model), "PFX_BUFFER_PROMPTS": str(BUFFER), "PFX_EAGER_DELAY": "60"})
    cluster.start()
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))
        status = asyncio.run(submit(data, nats_url=cluster.url, job="big", out_dir=tmp_path / "out",
                                    sampling=m.SamplingSpec(max_tokens=4), progress=False, timeout=50))
        page = scrape(port)
    finally:
        cluster.stop()
    assert status.done and status.rows == N and status.errors == 0, status
    assert sorted(pq.read_table(tmp_path / "out", columns=["id"]).column("id").to_pylist()) == list(range(N))
    released = {dict(k)["reason"]: v for k, v in page["pfx_bucketer_released_prompts_total"].items()}
    assert released.get("eager", 0) >= N and set(released) == {"eager"}, released
