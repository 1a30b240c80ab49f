"""A real vLLM engine core SIGKILLed mid-job (as the OOM killer would): its engine-worker
stays up, hands its unfinished work back, rebuilds the engine in the same process,
reports ready again and takes new work; every prompt comes out exactly once, no errors."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.client.submit import Submitter
from prefixflow.services.engine_worker.guard import descendants
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import special_vllm_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N = 300


def engine_cores(worker: int) -> list[int]:
    """Pids of the worker's vLLM engine-core processes (process title `VLLM::EngineCore`)."""
    found = []
    for pid in descendants(worker):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"EngineCore" in title:
            found.append(pid)
    return found


def test_engine_core_killed_mid_job_is_rebuilt_in_place(tmp_path, tiny_model, clusters):
    # The second half brings prefixes neither replica has seen: no cache affinity keeps
    # it on the replica that stayed up, so the rebuilt r0 must be given some of it.
    rows = []
    for seed in (13, 14):
        table = prefix_repetition(
            tokenizer_dir=tiny_model, num_prompts=N // 2, prefix_len=128, suffix_len=64, num_prefixes=6, output_len=16, seed=seed
        )
        rows += [{"id": len(rows) + i, "prompt": r["prompt"]} for i, r in enumerate(table.to_pylist())]
    # The engine-kill tests' shared cluster (the worker survives, so it is left running).
    cluster = special_vllm_cluster(clusters, tiny_model)
    worker = cluster.running["engine0"].pid
    cores = engine_cores(worker)
    assert len(cores) == 1, f"one vLLM engine core under the worker: {cores}"
    out = str(tmp_path / "out")
    half = N // 2

    async def go() -> dict:
        nc = await connect(cluster.url, "watch")
        ready: list[tuple[float, bool]] = []
        r0_results: list[tuple[float, object]] = []

        async def on_status(msg) -> None:
            st = m.engine_status_decoder.decode(msg.data)
            if not ready or ready[-1][1] != st.ready:
                ready.append((time.monotonic(), st.ready))

        async def on_results(msg) -> None:
            now = time.monotonic()
            r0_results.extend((now, r.id) for r in m.result_batch_decoder.decode(msg.data).results if r.replica == "r0")

        await nc.subscribe(subjects.status("r0"), cb=on_status)
        await nc.subscribe(subjects.results(subjects.ANY_ORIGIN, "core-kill"), cb=on_results)
        # Long enough outputs that r0 is still generating when the first check lands
        # (16-token outputs let the whole first half finish within a second).
        sampling = m.SamplingSpec(max_tokens=64, min_tokens=64, ignore_eos=True)
        async with Submitter(cluster.url) as client:
            await client.create(m.JobSpec(job="core-kill", out_dir=out, sampling=sampling))
            await client.publish_rows("core-kill", rows[:half])
            # Mid-job: r0 has prompts in its engine.
            deadline = time.monotonic() + 300
            while True:
                assert time.monotonic() < deadline, "r0 never got busy"
                st = m.engine_status_decoder.decode((await nc.request(subjects.engine_status_request("r0"), b"", timeout=10)).data)
                if st.inflight > 0:
                    break
                await asyncio.sleep(0.05)
            killed_at = time.monotonic()
            os.kill(cores[0], signal.SIGKILL)
            while not (ready and not ready[-1][1] and ready[-1][0] > killed_at):  # not ready...
                cluster.check_alive()
                assert time.monotonic() - killed_at < 30, f"r0 never reported not ready: {ready}"
                await asyncio.sleep(0.05)
            while not ready[-1][1]:  # ...then ready again
                cluster.check_alive()
                assert time.monotonic() - killed_at < 300, f"r0 never came back:\n{cluster.log_tail('engine0')}"
                await asyncio.sleep(0.1)
            back_at = ready[-1][0]
            await client.publish_rows("core-kill", rows[half:])  # new work, after the rebuild
            await client.create(m.JobSpec(job="core-kill", out_dir=out, sampling=sampling, total=N))
            status = await client.wait("core-kill", N, progress=False, timeout=600)
        await close(nc)
        second = {r["id"] for r in rows[half:]}
        new_r0 = [t for t, i in r0_results if i in second and t > back_at]
        return {
            "status": status,
            "not_ready_after": next(t for t, r in ready if t > killed_at and not r) - killed_at,
            "ready_after": back_at - killed_at,
            "first_new_result_after": (min(new_r0) - killed_at) if new_r0 else None,
        }

    res = asyncio.run(go())
    first = res["first_new_result_after"]
    print(
        f"\nengine core SIGKILL: r0 not ready {res['not_ready_after']:.2f} s after, ready again {res['ready_after']:.1f} s after, "
        f"first new r0 result {first:.1f} s after" if first is not None else "\nr0 produced no new result"
    )
    proc = cluster.running["engine0"]
    assert proc.pid == worker and proc.poll() is None, "the worker process survived its engine core"
    new_cores = engine_cores(worker)
    assert len(new_cores) == 1 and new_cores != cores, f"a new engine core: {cores} -> {new_cores}"
    assert first is not None, "r0 took new work after the rebuild"
    status = res["status"]
    assert status.done and status.rows == N and status.errors == 0
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == sorted(r["id"] for r in rows), "every id exactly once"
    assert table.column("error").null_count == table.num_rows, "no error rows"
