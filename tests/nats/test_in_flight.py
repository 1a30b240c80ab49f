"""A job's publisher runs no further ahead of its written output than its window
(`--max-in-flight`, `prefixflow/client/window.py`), through `prefixflow submit` on an echo cluster;
rows the sink receives again are counted in the job's status (`duplicates`), so a
resend is accounted for too."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import msgspec
import pyarrow.parquet as pq
import pytest

from prefixflow.client import columns
from prefixflow.client.submit import Submitter
from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.shared.bus.connection import connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

N = 20_000
WINDOW = 1024


@pytest.fixture
def cluster(clusters):
    return clusters.get()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_model) -> Path:
    data = tmp_path_factory.mktemp("in-flight-data") / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=32, suffix_len=8,
                            num_prefixes=40, output_len=4, seed=2)
    return data


async def submit_watched(url: str, data: Path, out: Path, job: str, *extra: str) -> tuple[int, int]:
    """Run `prefixflow submit` and watch its ingest subject: each time a message of rows is
    published, how many rows were then sent and not yet written or dropped by the sink (as
    the job's status, polled every 20 ms, says). Returns (exit code, the most in flight)."""
    nc = await connect(url, "tests")
    js = nc.jetstream()
    status_kv = await js.key_value(subjects.JOB_STATUS_KV)
    accounted, published, most = 0, 0, 0

    async def on_ingest(msg) -> None:
        nonlocal published, most
        published += len(msgspec.msgpack.decode(msg.data))
        most = max(most, published - accounted)

    async def poll() -> None:
        nonlocal accounted
        while True:
            try:
                st = m.job_status_decoder.decode((await status_kv.get(job)).value)
                accounted = st.rows + st.duplicates
            except Exception:  # noqa: BLE001 - no status yet
                pass
            await asyncio.sleep(0.02)

    sub = await nc.subscribe(subjects.ingest(job), cb=on_ingest)
    poller = asyncio.create_task(poll())
    proc = await asyncio.create_subprocess_exec(
        str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
        "--no-progress", "--max-tokens", "4", "--timeout", "200", *extra, cwd=REPO, env=os.environ,
    )
    code = await asyncio.wait_for(proc.wait(), 240)
    poller.cancel()
    await sub.unsubscribe()
    await nc.close()
    assert published >= N, published
    return code, most


def test_submit_runs_no_further_ahead_of_the_sink_than_its_window(cluster, dataset, tmp_path):
    """With `--max-in-flight 1024`, rows sent and not yet written stay within a few
    windows (the status the test reads lags the one the client read by up to its poll);
    the default window lets the same job run thousands of rows ahead (the echo engine is
    slower than publishing), so the bound is the window's doing."""
    out = tmp_path / "out"
    code, most = asyncio.run(submit_watched(cluster.url, dataset, out, "windowed", "--max-in-flight", str(WINDOW)))
    assert code == 0
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N
    free_out = tmp_path / "free"
    code, free_most = asyncio.run(submit_watched(cluster.url, dataset, free_out, "unbounded"))
    assert code == 0
    print(f"\nmost rows in flight: window {WINDOW}: {most}; default window: {free_most}", file=sys.stderr)
    assert most <= 3 * WINDOW, most
    assert free_most > 3 * WINDOW, free_most


def test_rows_sent_again_are_counted_as_duplicates(cluster, dataset, tmp_path):
    """Half the rows published, written; then every row published again in other
    messages (as a client whose done queries go unanswered does): the status counts the
    half sent twice as duplicates, and the output holds every id once."""
    out, job = tmp_path / "out", "resent"

    async def go() -> m.JobStatus:
        async with Submitter(cluster.url) as client:
            await client.claim_dir(str(out.resolve()), job)
            spec = m.JobSpec(job=job, out_dir=str(out.resolve()), sampling=m.SamplingSpec(max_tokens=4), created_at=time.time())
            await client.create(spec)
            chunks = list(columns.chunks(dataset))
            half = [r for c in chunks for r in c.rows[: len(c.rows) // 2]]
            for c in chunks:
                await client.put_columns(job, c)
            await client.publish_rows(job, half)
            while ((await client.status(job)) or m.JobStatus(job)).rows < len(half):
                await asyncio.sleep(0.2)
            every = [r for c in chunks for r in c.rows]
            await client.publish_rows(job, every, batch=50)  # other message ids than the first time
            await client.create(msgspec.structs.replace(spec, total=N))
            st = await client.wait(job, N, progress=False, timeout=120)
            return st, len(half)

    st, half = asyncio.run(go())
    assert st.done and st.rows == N
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N
    # The done status may be written before the last duplicates arrive: at least most of them.
    assert 0 < st.duplicates <= half
