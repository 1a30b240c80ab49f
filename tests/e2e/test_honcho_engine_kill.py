"""Under `honcho start` on the Procfile (the session cluster), SIGKILL only the vLLM
engine core of an engine-worker mid-job (as the OOM killer would). honcho stops every
process as soon as one exits, so the worker must survive its engine's death (it rebuilds
the engine in-process): honcho keeps running, every process of the Procfile is still the
same live process, the job completes with every id exactly once and no error rows, and
the replica reports ready again."""

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
from prefixflow.services.engine_worker.guard import descendants, proc_stat
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N = 3000
NAMES = ("nats", "ingestor", "bucketer", "router", "engine-worker --replica r0", "engine-worker --replica r1", "sink")


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def procfile_processes(honcho: int) -> dict[str, int]:
    """name -> pid of each Procfile process under honcho (the engine-worker itself, not
    its guard or vLLM children)."""
    tree = descendants(honcho)
    found: dict[str, int] = {}
    for pid in sorted(tree):
        cmd = cmdline(pid)
        for name in NAMES:
            serve = "nats-server" if name == "nats" else f"serve {name}"
            if serve in cmd and name not in found:
                parent = proc_stat(pid)[0] if proc_stat(pid) else 0
                if serve not in cmdline(parent):  # a guard shares its worker's command line
                    found[name] = pid
    return found


def engine_cores(worker: int) -> list[int]:
    return [pid for pid in descendants(worker) if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes()]


async def ready_since(url: str, replica: str, since: float, timeout: float) -> float:
    """Wait for `replica` to report not ready, then ready (its engine rebuilt); returns when."""
    nc = await connect(url, "tests")
    seen_down = asyncio.Event()
    back = asyncio.Event()

    async def on_status(msg) -> None:
        st = m.engine_status_decoder.decode(msg.data)
        if st.replica != replica:
            return
        if not st.ready:
            seen_down.set()
        elif seen_down.is_set():
            back.set()

    await nc.subscribe(subjects.status(replica), cb=on_status)
    try:
        await asyncio.wait_for(back.wait(), timeout)
    finally:
        await close(nc)
    return time.monotonic() - since


def test_engine_core_killed_under_honcho_keeps_the_cluster_up(vllm_cluster, tiny_model, tmp_path):
    honcho = vllm_cluster.proc
    assert honcho is not None and honcho.poll() is None
    before = procfile_processes(honcho.pid)
    assert set(before) == set(NAMES), before
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=32, num_prefixes=12, output_len=16, seed=21)
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]
    out = str(tmp_path / "out")

    async def go() -> tuple[m.JobStatus, int, float]:
        # The rebuild is watched from before the kill (a not-ready report must not be missed).
        async with Submitter(vllm_cluster.url) as client:
            sampling = m.SamplingSpec(max_tokens=16, min_tokens=16, ignore_eos=True)
            await client.create(m.JobSpec(job="honcho-core-kill", out_dir=out, sampling=sampling, total=N))
            await client.publish_rows("honcho-core-kill", rows)
            while ((await client.status("honcho-core-kill")) or m.JobStatus("")).rows < N // 10:
                await asyncio.sleep(0.05)
            cores = engine_cores(before["engine-worker --replica r0"])
            assert len(cores) == 1, cores
            killed_at = time.monotonic()
            rebuilt = asyncio.create_task(ready_since(vllm_cluster.url, "r0", killed_at, 300))
            await asyncio.sleep(0)
            os.kill(cores[0], signal.SIGKILL)
            at_kill = ((await client.status("honcho-core-kill")) or m.JobStatus("")).rows
            status = await client.wait("honcho-core-kill", N, progress=False, timeout=600)
            return status, at_kill, await rebuilt

    status, at_kill, rebuilt_after = asyncio.run(go())
    print(f"\nengine core of r0 killed at {at_kill}/{N} rows; r0 ready again {rebuilt_after:.1f} s later")
    assert at_kill < N, "the kill landed mid-job"
    assert honcho.poll() is None, f"honcho stopped:\n{vllm_cluster.tail()}"
    after = procfile_processes(honcho.pid)
    assert after == before, f"every Procfile process still the same live process: {before} -> {after}"
    assert status.done and status.rows == N and status.errors == 0
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N, "every id exactly once"
    assert table.column("error").null_count == N, "no error rows"
