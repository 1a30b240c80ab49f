"""The engine-worker outlives its engine: when the engine dies (vLLM's engine core
crashed or was killed), the worker re-publishes its unfinished work, reports not ready,
rebuilds the engine in the same process and takes work again; it exits with code 3
only once its rebuild budget is spent.

The cluster tests use real processes and echo engines that die like a dead vLLM core
(`--echo-crash-after`, `--echo-crash-token`); the rest is pure logic. What the worker
re-publishes after a death (isolation of the prompts in flight) is `tests/unit/test_isolate.py`.
"""

from __future__ import annotations

import asyncio
import time

import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.launch.local_cluster import LocalCluster, processes, wait_replicas_ready
from prefixflow.client.submit import Submitter
from prefixflow.services.engine_worker.rebuild import GAVE_UP_EXIT_CODE
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

N = 1200
ECHO = ["--echo-delay", "0.02", "--window", "8"]
CRASH_AFTER = 100
"""r0's engine dies once, after this many prompts (well inside the first half of the job)."""


@pytest.fixture(scope="module")
def rows(tiny_model):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=16, num_prefixes=12, seed=5)
    return [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]


class Watch:
    """r0's status changes and every result's arrival time and replica (core NATS)."""

    def __init__(self) -> None:
        self.ready: list[tuple[float, bool]] = []  # (time, ready) each time r0's readiness changes
        self.epochs: list[str] = []  # r0's cache epochs, in the order reported
        self.at: dict = {}
        self.replica: dict = {}

    async def start(self, url: str, job: str) -> None:
        self.nc = await connect(url, "watch")

        async def on_status(msg) -> None:
            st = m.engine_status_decoder.decode(msg.data)
            if not self.ready or self.ready[-1][1] != st.ready:
                self.ready.append((time.monotonic(), st.ready))
            if not self.epochs or self.epochs[-1] != st.cache_epoch:
                self.epochs.append(st.cache_epoch)

        async def on_results(msg) -> None:
            now = time.monotonic()
            for r in m.result_batch_decoder.decode(msg.data).results:
                self.at.setdefault(r.id, now)
                self.replica.setdefault(r.id, r.replica)

        await self.nc.subscribe(subjects.status("r0"), cb=on_status)
        await self.nc.subscribe(subjects.results(subjects.ANY_ORIGIN, job), cb=on_results)

    def back_at(self) -> float | None:
        """When r0 reported ready again after having reported not ready."""
        states = [ready for _, ready in self.ready]
        if False in states and True in states[states.index(False) :]:
            i = states.index(False)
            return next(t for t, ready in self.ready[i:] if ready)
        return None

    async def stop(self) -> None:
        await close(self.nc)


@pytest.mark.nats
@pytest.mark.timeout(300)
def test_worker_rebuilds_its_dead_engine_in_place(tmp_path, tiny_model, rows):
    # 40 % of the rows repeat the row before them (identical requests, generated once:
    # their followers wait in the worker when its engine dies and must come out too).
    rows = [{**r, "prompt": rows[i - 1]["prompt"]} if i % 5 in (1, 3) else r for i, r in enumerate(rows)]
    procs = processes(2, engine="echo", extra_engine_args=ECHO)
    engine0 = next(p for p in procs if p.name == "engine0")
    engine0.args += ["--echo-crash-after", str(CRASH_AFTER)]
    cluster = LocalCluster(procs, workdir=tmp_path / "cluster", env={"PFX_MODEL": str(tiny_model), "PFX_DEAD_AFTER": "2"})
    cluster.start()
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 60, cluster.check_alive))
        pid = cluster.running["engine0"].pid
        out = str(tmp_path / "out")
        half = N // 2

        async def go() -> tuple[m.JobStatus, Watch]:
            watch = Watch()
            await watch.start(cluster.url, "recover")
            async with Submitter(cluster.url) as client:
                await client.create(m.JobSpec(job="recover", out_dir=out, sampling=m.SamplingSpec(max_tokens=4)))
                await client.publish_rows("recover", rows[:half])
                deadline = time.monotonic() + 60
                while watch.back_at() is None:  # r0's engine dies mid-job and is rebuilt
                    cluster.check_alive()
                    assert time.monotonic() < deadline, f"r0 never came back: {watch.ready}\n{cluster.log_tail('engine0')}"
                    await asyncio.sleep(0.05)
                await client.publish_rows("recover", rows[half:])  # new work, after the rebuild
                await client.create(m.JobSpec(job="recover", out_dir=out, sampling=m.SamplingSpec(max_tokens=4), total=N))
                status = await client.wait("recover", N, progress=False, timeout=120)
            await watch.stop()
            return status, watch

        status, watch = asyncio.run(go())
        went_down = next(t for t, ready in watch.ready if not ready)
        back = watch.back_at()
        new_r0 = [watch.at[r["id"]] for r in rows[half:] if watch.replica.get(r["id"]) == "r0"]
        first_new = min(new_r0) - went_down if new_r0 else float("nan")
        print(f"\necho engine death: not ready for {back - went_down:.2f} s; first new result from r0 {first_new:.2f} s after")

        proc = cluster.running["engine0"]
        assert proc.pid == pid and proc.poll() is None, "the worker process survived its engine"
        assert [ready for _, ready in watch.ready][:3] == [True, False, True], watch.ready
        assert len(watch.epochs) >= 2 and all(watch.epochs) and len(set(watch.epochs)) == len(watch.epochs), "the rebuilt engine's cache is a new epoch (the router forgets r0's history)"
        assert new_r0, "r0 took new work after the rebuild"
        assert "engine rebuilt" in cluster.log_tail("engine0", 400)
        assert "engine died with followers waiting" in cluster.log_tail("engine0", 400), "duplicates were in flight"
        assert status.done and status.rows == N and status.errors == 0
        table = pq.read_table(out)
        assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows), "every id exactly once"
        assert table.column("error").null_count == table.num_rows, "no error rows"
    finally:
        cluster.stop()


@pytest.mark.nats
@pytest.mark.timeout(120)
def test_worker_exits_3_once_its_rebuild_budget_is_spent(tmp_path, tiny_model, rows):
    """A prompt that kills the engine, no rebuild allowed: its first death (ordinary work in
    flight: charged) ends the process with code 3 (for its supervisor), its work still in
    the stream (re-published as a suspect batch before the worker gave up). Deaths while
    suspects run alone are not charged: `test_faults.py`'s poison test."""
    from prefixflow.shared.prefix.tokenize import load_tokenizer

    crash = load_tokenizer(str(tiny_model)).encode(rows[0]["prompt"]).ids[-1]
    procs = processes(1, engine="echo", extra_engine_args=["--echo-crash-token", str(crash), "--max-rebuilds", "0", "--rebuild-backoff", "0.2"])
    cluster = LocalCluster(procs, workdir=tmp_path / "cluster", env={"PFX_MODEL": str(tiny_model)})
    cluster.start()
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0"], 60, cluster.check_alive))

        async def go() -> int:
            async with Submitter(cluster.url) as client:
                await client.create(m.JobSpec(job="doomed", out_dir=str(tmp_path / "out"), total=1))
                await client.publish_rows("doomed", rows[:1])
                proc = cluster.running["engine0"]
                deadline = time.monotonic() + 60
                while proc.poll() is None:
                    assert time.monotonic() < deadline, cluster.log_tail("engine0")
                    await asyncio.sleep(0.1)
                spec = subjects.engine_consumer("r0")
                info = await client.js.consumer_info(spec.stream, spec.durable)
                assert info.num_ack_pending + info.num_pending == 1, "the work is still there"
                return proc.returncode

        assert asyncio.run(go()) == GAVE_UP_EXIT_CODE
        assert "engine cannot be rebuilt" in cluster.log_tail("engine0", 200)
    finally:
        cluster.stop()
