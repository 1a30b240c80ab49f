"""Jobs in any number, and their records expire (issue #23): a cluster that runs 2,000 jobs
completes every one (more than the sink keeps open at once), and with a short retention a
job's spec, status and dead letters are gone from the cluster after it, as its status says.
The echo engine: only the job bookkeeping matters here."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import nats.errors
import pyarrow.parquet as pq
import pytest
from nats.js.errors import KeyNotFoundError

from prefixflow.client.submit import Submitter
from prefixflow.launch.local_cluster import LocalCluster, processes
from prefixflow.services.sink.service import MAX_OPEN_JOBS
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN, wait_replicas_ready

pytestmark = [pytest.mark.nats, pytest.mark.timeout(600)]

JOBS = 2000


def echo_cluster(tmp_path, tiny_model, **env: str) -> LocalCluster:
    return LocalCluster(processes(2, engine="echo"), workdir=tmp_path / "cluster",
                        env={"PFX_MODEL": str(tiny_model), "PFX_OUT_ROOT": str(tmp_path), **env})


def test_two_thousand_jobs_all_complete(tmp_path, clusters):
    assert JOBS > 4 * MAX_OPEN_JOBS, "more jobs than the sink keeps open"
    cluster = clusters.get(replicas=2)

    async def go() -> list[m.JobStatus]:
        async with Submitter(cluster.url) as client:
            gate = asyncio.Semaphore(64)

            async def one(i: int) -> m.JobStatus:
                job, out = f"many-{i}", str(tmp_path / "out" / f"j{i}")
                rows = [{"id": k, "prompt": f"job {i} row {k}"} for k in range(1 + i % 3)]
                async with gate:
                    spec = m.JobSpec(job=job, out_dir=out, sampling=m.SamplingSpec(max_tokens=2))
                    await client.create(spec)
                    await client.publish_rows(job, rows)
                    await client.create(m.JobSpec(job=job, out_dir=out, sampling=spec.sampling, total=len(rows)))
                deadline = time.monotonic() + 400
                while time.monotonic() < deadline:
                    try:
                        st = await client.status(job)
                    except nats.errors.TimeoutError:  # 2,000 pollers on a loaded machine: poll again
                        continue
                    if st is not None and (st.done or st.failed):
                        return st
                    # 2,000 pollers: every 5 s is 400 status reads a second (at 1 s the
                    # reads cost the test more CPU than the jobs do)
                    await asyncio.sleep(5.0)
                raise TimeoutError(f"{job} not done: {await client.status(job)}")

            return await asyncio.gather(*(one(i) for i in range(JOBS)))

    t0 = time.monotonic()
    statuses = asyncio.run(go())
    took = time.monotonic() - t0
    failed = [s for s in statuses if not s.done or s.failed]
    assert not failed, failed[:3]
    assert sum(s.rows for s in statuses) == sum(1 + i % 3 for i in range(JOBS))
    assert all(s.errors == 0 for s in statuses)
    for i in (0, 1, JOBS // 2, JOBS - 1):  # each job's output is its own
        got = pq.read_table(tmp_path / "out" / f"j{i}")
        assert sorted(got.column("id").to_pylist()) == list(range(1 + i % 3))
        assert json.loads((tmp_path / "out" / f"j{i}" / "_summary.json").read_text())["rows"] == 1 + i % 3
    print(f"{JOBS} jobs in {took:.1f} s")


def test_job_records_expire_after_the_retention(tmp_path, tiny_model):
    keep = 6.0
    cluster = echo_cluster(tmp_path, tiny_model, PFX_JOB_RETENTION=str(keep))
    cluster.start()
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))
        data = tmp_path / "in.jsonl"
        data.write_text("".join(json.dumps({"id": i, "prompt": f"row {i}"}) + "\n" for i in range(20)))
        submit = subprocess.Popen(
            [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(tmp_path / "out"), "--job", "short-lived",
             "--nats", cluster.url, "--max-tokens", "2", "--no-progress", "--timeout", "120"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )

        async def records(done: bool = False) -> tuple[m.JobStatus | None, bool, float | None]:
            """The job's status, whether its spec is there, and the dead letters' max age;
            with `done`, read as soon as the status says done (the retention counts from
            then, and a loaded machine may take seconds to end `submit`)."""
            nc = await connect(cluster.url, "tests")
            js = nc.jetstream()
            status_kv, jobs_kv = await js.key_value(subjects.JOB_STATUS_KV), await js.key_value(subjects.JOBS_KV)
            deadline = time.monotonic() + 180
            while True:
                try:
                    st = m.job_status_decoder.decode((await status_kv.get("short-lived")).value)
                except KeyNotFoundError:
                    st = None
                if not done or (st is not None and st.done) or time.monotonic() > deadline or submit.poll():
                    break
                await asyncio.sleep(0.1)
            try:
                await jobs_kv.get("short-lived")
                spec = True
            except KeyNotFoundError:
                spec = False
            dead_age = (await js.stream_info(subjects.DEAD_STREAM.name)).config.max_age
            await close(nc)
            return st, spec, dead_age

        try:
            st, spec, dead_age = asyncio.run(records(done=True))
            out_s, err_s = submit.communicate(timeout=120)
        finally:
            if submit.poll() is None:
                submit.kill()
        assert submit.returncode == 0, out_s + err_s
        assert st is not None and st.done and spec
        assert st.expires_at == pytest.approx(st.updated_at + keep, abs=0.01), "the status says when it goes"
        assert dead_age == pytest.approx(keep)
        time.sleep(st.expires_at - time.time() + 3.0)
        st, spec, _ = asyncio.run(records())
        assert st is None and not spec, "spec and status expired"
        assert pq.read_table(tmp_path / "out").num_rows == 20, "the output files stay"
    finally:
        cluster.stop()
