"""A full disk pauses a job, it never poisons its results (issue 39, must-show 3).

On the shared echo cluster, job A's `--out` is on a 4 MiB tmpfs the test mounts under
the sink's output root, and its rows carry an 8 KiB column that fills it after a few
parts. `prefixflow submit` of A exits 75 (EX_TEMPFAIL) within 30 s naming the file system,
and `prefixflow status` says `paused` with the reason and the directory. Meanwhile job B,
writing elsewhere, completes. Once the tmpfs is grown to 64 MiB, the same submit of A
completes: every id once, no error row, nothing dead-lettered, nothing left parked, no
process restarted."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import time
import uuid
from pathlib import Path

import nats
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN, run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]

ROWS = 800
"""Rows of job A: 800 x 8 KiB of incompressible text is ~6.4 MiB, over the 4 MiB tmpfs."""
B_ROWS = 200


@pytest.fixture
def small_fs(tmp_path):
    """A 4 MiB tmpfs at `tmp_path/small` (under the sink's output root), unmounted after."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def write_input(path: Path, rows: int, blob_bytes: int) -> None:
    blobs = [base64.b64encode(os.urandom(blob_bytes)).decode() for _ in range(rows)] if blob_bytes else [""] * rows
    pq.write_table(pa.table({"id": list(range(rows)), "prompt": [f"row {i} says hello" for i in range(rows)],
                             "blob": blobs}), path)


def submit(url: str, data: Path, out: Path, job: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
         "--no-progress", "--no-report", "--max-tokens", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


async def stream_counts(url: str, job: str) -> tuple[int, int, m.JobStatus]:
    """(dead letters of the job's results, its parked results, its status)."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        dead = await js.stream_info(subjects.DEAD_STREAM.name, subjects_filter=subjects.dead(subjects.results(subjects.ANY_ORIGIN, job)))
        parked = await js.stream_info(subjects.PARKED_STREAM.name, subjects_filter=subjects.parked(job))
        kv = await js.key_value(subjects.JOB_STATUS_KV)
        st = m.job_status_decoder.decode((await kv.get(job)).value)
        return sum((dead.state.subjects or {}).values()), sum((parked.state.subjects or {}).values()), st
    finally:
        await nc.close()


def status(url: str, job: str) -> dict:
    res = run_cli("status", job, "--nats", url, "--json", timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    [view] = json.loads(res.stdout)
    return view


def test_a_full_disk_pauses_the_job_and_the_same_command_completes_it(clusters, tmp_path, small_fs):
    cluster = clusters.get(replicas=1)
    pids = {name: proc.pid for name, proc in cluster.running.items()}
    restarts = dict(cluster.supervisor.restarts)
    tag = uuid.uuid4().hex[:8]
    job_a, job_b = f"disk-a-{tag}", f"disk-b-{tag}"
    data_a, data_b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    write_input(data_a, ROWS, 6 * 1024)  # 8 KiB of base64 a row
    write_input(data_b, B_ROWS, 0)
    out_a, out_b = small_fs / "job", tmp_path / "elsewhere"

    # 1. A fills the disk: submit exits 75 within 30 s naming it; the job is paused.
    t0 = time.monotonic()
    proc = submit(cluster.url, data_a, out_a, job_a)
    try:
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    took = time.monotonic() - t0
    print(f"\nsubmit of A exited {proc.returncode} after {took:.1f} s: {stderr.strip().splitlines()[:1]}")
    assert proc.returncode == 75, stdout + stderr
    assert took < 30, f"submit took {took:.1f} s to say the job is paused"
    assert f"job {job_a} paused: no space left on the device at {out_a}" in stderr, stderr
    assert f"file system {small_fs}:" in stderr, "the reason names the file system"
    view = status(cluster.url, job_a)
    assert view["state"] == "paused" and view["path"] == str(out_a), view
    assert "no space left on the device" in view["error"] and view["rows"] < ROWS, view

    # 2. Meanwhile B, writing elsewhere on the same cluster, completes.
    t1 = time.monotonic()
    res = submit(cluster.url, data_b, out_b, job_b)
    stdout, stderr = res.communicate(timeout=90)
    print(f"B done in {time.monotonic() - t1:.1f} s while A is paused")
    assert res.returncode == 0, stdout + stderr
    assert sorted(pq.read_table(out_b, columns=["id"]).column("id").to_pylist()) == list(range(B_ROWS))
    dead, parked, st = asyncio.run(stream_counts(cluster.url, job_a))
    assert st.paused and not st.done and dead == 0 and parked > 0, ("A stays paused while its disk is full", st)

    # 3. Space returns: the same command completes A, every id once, nothing quarantined.
    assert subprocess.run(["mount", "-o", "remount,size=64m", str(small_fs)]).returncode == 0
    t2 = time.monotonic()
    res = submit(cluster.url, data_a, out_a, job_a)
    stdout, stderr = res.communicate(timeout=120)
    print(f"A completed {time.monotonic() - t2:.1f} s after the remount: {stdout.strip().splitlines()[:1]}")
    assert res.returncode == 0, stdout + stderr
    table = pq.read_table(out_a, columns=["id", "error", "blob"])
    assert sorted(table.column("id").to_pylist()) == list(range(ROWS)), "every id once"
    assert table.column("error").null_count == ROWS, "no error row (no result was quarantined)"
    assert len(table.column("blob")[0].as_py()) == 8192
    summary = json.loads((out_a / "_summary.json").read_text())
    assert summary["rows"] == ROWS and summary["errors"] == 0, summary
    dead, parked, st = asyncio.run(stream_counts(cluster.url, job_a))
    assert st.done and st.paused is None and st.rows == ROWS, st
    assert dead == 0, f"{dead} results of A dead-lettered"
    assert parked == 0, f"{parked} results of A still parked"

    # Nothing died, nothing restarted.
    assert {name: p.pid for name, p in cluster.running.items()} == pids
    assert dict(cluster.supervisor.restarts) == restarts
