"""Tenants first on NATS (issue 40, must-show 2's first test): tenant A submits 100 jobs,
then tenant B one small job, on a cluster with two bucketer nodes (echo engine, one
replica at ~800 prompts/s, through the Python API's `Client(tenant=...)`). B's job
completes while at least 90 of A's are unfinished: each bucketer gives B a consumer
beside A's 64 (`consumers.admit`) and B's lane half the release (`Lanes`: a tenant's jobs
together weigh as one). With fairness per job, B's job got 1/101 of the engine behind
A's 64 consumers and finished with A's last jobs. Every row of every job comes out once."""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import prefixflow
from prefixflow.launch.local_cluster import LocalCluster
from prefixflow.launch.processes import another_bucketer, processes

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

A_JOBS, A_ROWS, B_ROWS = 100, 100, 40


def prompts(n: int, tag: str) -> pa.Table:
    return pa.table({"prompt": [f"{tag}: question {i % 5}, say {i}" for i in range(n)]})


def test_one_tenants_hundred_jobs_do_not_hold_anothers_small_one(tiny_model, sink_out_root, tmp_path):
    procs = processes(1, engine="echo", extra_engine_args=["--echo-delay", "0.01", "--window", "8"])
    procs.insert(3, another_bucketer(procs, "node1", "bucketer1"))  # a second bucketer node
    cluster = LocalCluster(procs, workdir=tmp_path / "cluster", env={"PFX_MODEL": str(tiny_model)})
    cluster.start()
    try:
        asyncio.run(cluster.wait_ready(["r0"], 120))
        out = sink_out_root  # a tenant's jobs write under <root>/<tenant>/
        with prefixflow.Client(cluster.url, tenant="alice") as alice, prefixflow.Client(cluster.url, tenant="bob") as bob:
            a_jobs = [alice.submit(prompts(A_ROWS, f"a{i}"), out=out / "alice" / "tf" / f"a{i}", job=f"a{i}", max_tokens=2)
                      for i in range(A_JOBS)]
            deadline = time.monotonic() + 120
            while sum(j.status().rows for j in a_jobs[:10]) == 0:  # A's jobs are running
                assert time.monotonic() < deadline and not any(j.done() for j in a_jobs), [j.wait(0) for j in a_jobs if j.done()][:1]
                time.sleep(0.1)
            t0, t0_wall = time.monotonic(), time.time()
            b_job = bob.submit(prompts(B_ROWS, "b"), out=out / "bob" / "tf" / "b", job="b", max_tokens=2)
            b = b_job.wait(180)
            b_seconds = time.monotonic() - t0
            unfinished = sum(not j.done() or j.status().rows < A_ROWS for j in a_jobs)
            a_rows = sum(j.status().rows for j in a_jobs)
            fin = pq.read_table(out / "bob" / "tf" / "b", columns=["finished_at"]).column("finished_at").to_pylist()
            print(f"\nB's rows inferred {min(fin) - t0_wall:.1f}..{max(fin) - t0_wall:.1f} s after its submit")
            print(f"B's {B_ROWS}-row job: {b_seconds:.1f} s beside A's {A_JOBS} jobs; then A had {unfinished} "
                  f"unfinished, {a_rows} of {A_JOBS * A_ROWS} rows written")
            assert b.rows == B_ROWS and b.job == "bob.b"
            assert unfinished >= 90, f"B's job waited for A's: {unfinished} of A's jobs unfinished, {a_rows} rows"
            for j in a_jobs:
                assert j.wait(240).rows == A_ROWS
        assert sorted(pq.read_table(out / "bob" / "tf" / "b").column("id").to_pylist()) == list(range(B_ROWS))
        for i in (0, A_JOBS // 2, A_JOBS - 1):
            assert sorted(pq.read_table(out / "alice" / "tf" / f"a{i}").column("id").to_pylist()) == list(range(A_ROWS))
    finally:
        cluster.stop()
