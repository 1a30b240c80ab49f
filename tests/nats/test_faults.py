"""Crash anywhere, lose nothing: SIGKILL each process mid-job (and restart it), fail an
engine over without restart, resume a stopped job, quarantine a poison message.

The cluster is the real one (nats-server with file storage and every service as an OS
process); engines are `echo` slowed to ~400 prompts/s each so a kill lands mid-job.
Each test asserts every input id comes out exactly once and, where the fault is not a
poison message, without error rows. Time-to-recover (fault to the first result of a
prompt published after the fault) is printed (`pytest -s`).
"""

from __future__ import annotations

import asyncio
import collections
import time

import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.launch.local_cluster import LocalCluster, processes
from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.bus.connection import close, connect
from tests.conftest import wait_replicas_ready

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

ECHO = ["--echo-delay", "0.02", "--window", "8"]
N = 1200


@pytest.fixture(scope="module")
def rows(tiny_model):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=16, num_prefixes=12, seed=9)
    return [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]


def cluster_for(tmp_path, tiny_model, extra_engine=(), env=None) -> LocalCluster:
    procs = processes(2, engine="echo", extra_engine_args=[*ECHO, *extra_engine])
    return LocalCluster(
        procs, workdir=tmp_path / "cluster", env={"PFX_MODEL": str(tiny_model), "PFX_DEAD_AFTER": "2", **(env or {})}
    )


class Watch:
    """Results on the wire, with arrival times (core subscription)."""

    def __init__(self) -> None:
        self.at: dict = {}
        self.engine_rows = collections.Counter()

    async def start(self, url: str, job: str) -> None:
        self.nc = await connect(url, "watch")

        async def on_results(msg) -> None:
            now = time.monotonic()
            for r in m.result_batch_decoder.decode(msg.data).results:
                self.at.setdefault(r.id, now)
                if r.replica:
                    self.engine_rows[r.replica] += 1

        await self.nc.subscribe(subjects.results(subjects.ANY_ORIGIN, job), cb=on_results)

    async def stop(self) -> None:
        await close(self.nc)


async def run_with_fault(cluster: LocalCluster, job: str, rows: list[dict], out_dir: str, fault) -> tuple[m.JobStatus, float]:
    """Publish half, inject `fault` (an async callable), publish the rest, seal, wait.
    Returns the final status and the time-to-recover."""
    watch = Watch()
    await watch.start(cluster.url, job)
    half = len(rows) // 2
    async with Submitter(cluster.url) as client:
        spec = m.JobSpec(job=job, out_dir=out_dir, sampling=m.SamplingSpec(max_tokens=4))
        await client.create(spec)
        await client.publish_rows(job, rows[:half])
        while len(watch.at) < 50:  # the job is under way
            await asyncio.sleep(0.05)
        t_fault = time.monotonic()
        await fault()
    # A fresh client: the old connection may have been cut by a nats-server restart.
    async with Submitter(cluster.url) as client:
        await client.publish_rows(job, rows[half:])
        await client.create(m.JobSpec(job=job, out_dir=out_dir, sampling=m.SamplingSpec(max_tokens=4), total=len(rows)))
        status = await client.wait(job, len(rows), progress=False, timeout=180)
    after = [watch.at[r["id"]] for r in rows[half:] if r["id"] in watch.at]
    await watch.stop()
    return status, (min(after) - t_fault if after else float("nan"))


def assert_exactly_once(out_dir, rows) -> None:
    table = pq.read_table(out_dir)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(r["id"] for r in rows), "every id exactly once"
    assert table.column("error").null_count == table.num_rows, "no error rows"


SHARED = {"replicas": 2, "engine_args": tuple(ECHO), "env": {"PFX_DEAD_AFTER": "2"}}
"""The cluster the kill tests share (`clusters.get(**SHARED)`): each leaves every process
running (the one it killed restarted, or started again at its end), and the shared
cluster's check before the next test restarts the whole cluster if one did not."""


@pytest.mark.parametrize("victim", ["ingestor", "bucketer", "router", "engine0", "sink", "nats"])
def test_sigkill_and_restart_mid_job(tmp_path, clusters, rows, victim):
    cluster = clusters.get(**SHARED)
    asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))
    by_name = {p.name: p for p in cluster.procs}

    async def fault() -> None:
        cluster.running[victim].kill()
        cluster.running[victim].wait()
        await asyncio.sleep(1.0)
        cluster.start_one(by_name[victim])

    out = tmp_path / "out"
    status, ttr = asyncio.run(run_with_fault(cluster, f"kill-{victim}", rows, str(out), fault))
    print(f"\n{victim}: time to recover {ttr:.2f} s")
    assert status.done and status.rows == len(rows) and status.errors == 0
    assert_exactly_once(out, rows)


def test_engine_failover_without_restart(tmp_path, clusters, rows):
    cluster = clusters.get(**SHARED)
    asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))
    engine0 = next(p for p in cluster.procs if p.name == "engine0")

    async def fault() -> None:
        cluster.running["engine0"].kill()  # and it stays dead

    out = tmp_path / "out"
    try:
        status, ttr = asyncio.run(run_with_fault(cluster, "failover", rows, str(out), fault))
        print(f"\nfailover: time to recover {ttr:.2f} s")
        assert status.done and status.rows == len(rows) and status.errors == 0
        assert_exactly_once(out, rows)
        assert cluster.running["engine0"].poll() is not None, "r0 stayed dead"
    finally:
        if cluster.running["engine0"].poll() is not None:
            cluster.start_one(engine0)  # the shared cluster is left whole


def test_resume_recomputes_only_unfinished_rows(tmp_path, tiny_model, rows):
    out = tmp_path / "out"
    # Slower engines (~130 prompts/s each: 8-prompt work messages, window 8, 60 ms a
    # prompt): the outage reliably lands mid-job.
    first = cluster_for(tmp_path / "one", tiny_model, extra_engine=["--echo-delay", "0.06"], env={"PFX_MAX_BATCH": "8"})
    first.start()
    try:
        asyncio.run(wait_replicas_ready(first.url, ["r0", "r1"], 60, first.check_alive))

        async def partial() -> None:
            async with Submitter(first.url) as client:
                spec = m.JobSpec(job="resume", out_dir=str(out), sampling=m.SamplingSpec(max_tokens=4), total=len(rows))
                await client.create(spec)
                await client.publish_rows("resume", rows)
                while (await client.status("resume")) is None or (await client.status("resume")).rows < N // 4:
                    await asyncio.sleep(0.1)

        asyncio.run(partial())
    finally:
        first.kill()  # the whole cluster goes down mid-job (an outage: SIGKILL)
    done_before = pq.read_table(out).num_rows
    assert 0 < done_before < N

    # A new cluster (new store: nothing left in flight) and the same job id resubmitted.
    second = cluster_for(tmp_path / "two", tiny_model)
    second.start()
    try:
        asyncio.run(wait_replicas_ready(second.url, ["r0", "r1"], 60, second.check_alive))
        watch = Watch()

        async def resume() -> m.JobStatus:
            from prefixflow.client.submit import submit

            await watch.start(second.url, "resume")
            data = tmp_path / "rows.parquet"
            import pyarrow as pa

            pq.write_table(pa.Table.from_pylist(rows), data)
            status = await submit(
                data, nats_url=second.url, job="resume", out_dir=out, sampling=m.SamplingSpec(max_tokens=4), progress=False, timeout=180
            )
            await watch.stop()
            return status

        status = asyncio.run(resume())
        assert status.done and status.rows == N
        generated = sum(watch.engine_rows.values())
        print(f"\nresume: {done_before} rows done before the stop, {generated} generated after")
        assert generated == N - done_before, "only unfinished rows are generated again"
        assert_exactly_once(out, rows)
    finally:
        second.stop()


def test_poison_prompt_is_dead_lettered_and_becomes_an_error_row(tmp_path, tiny_model, rows):
    """A prompt that kills every engine it reaches: the work in flight with it is retried
    in isolation (bisected, then one prompt at a time), so after a bounded number of
    engine deaths only that prompt is quarantined (dead-letter stream + error row), every
    other prompt of its batches is generated, and the job completes."""
    from prefixflow.shared.prefix.tokenize import load_tokenizer

    tok = load_tokenizer(str(tiny_model))
    crash = tok.encode(rows[0]["prompt"]).ids[-1]  # a token only rows[0] ends with...
    poison_ids = [r["id"] for r in rows[:200] if crash in tok.encode(r["prompt"]).ids]
    cluster = cluster_for(tmp_path, tiny_model, extra_engine=["--echo-crash-token", str(crash)])
    cluster.start()
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))

        async def go() -> tuple[m.JobStatus, list]:
            async with Submitter(cluster.url) as client:
                out = str(tmp_path / "out")
                subset = rows[:200]
                await client.create(m.JobSpec(job="poison", out_dir=out, total=len(subset)))
                await client.publish_rows("poison", subset)
                deadline = time.monotonic() + 200
                while time.monotonic() < deadline:
                    for p in cluster.procs:  # the supervisor: restart dead engines
                        if p.name.startswith("engine") and cluster.running[p.name].poll() is not None:
                            cluster.start_one(p)
                    st = await client.status("poison")
                    if st is not None and st.done:
                        break
                    await asyncio.sleep(0.5)
                dead = []
                sub = await client.js.subscribe("pfx.dead.>", ordered_consumer=True)
                try:
                    while True:
                        msg = await sub.next_msg(timeout=2)
                        dead.append((msg.subject, msg.headers or {}))
                except Exception:  # noqa: BLE001 - no more dead letters
                    pass
                return await client.status("poison"), dead

        status, dead = asyncio.run(go())
        assert status is not None and status.done and status.rows == 200
        rows_out = {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}
        assert len(rows_out) == 200
        errors = {i for i, r in rows_out.items() if r["error"]}
        assert set(poison_ids) <= errors, "the poison prompt became an error row"
        assert all("poison" in rows_out[i]["error"] for i in errors)
        assert any(s.startswith("pfx.dead.pfx.work.") and "poison" in h.get("Pfx-Error", "") for s, h in dead), dead
        assert errors == set(poison_ids), "only the prompts that kill the engine by themselves are error rows"
    finally:
        cluster.stop()
