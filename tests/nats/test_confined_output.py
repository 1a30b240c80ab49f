"""Confined output: the sink (the real process, on a real nats-server) writes only under
`--out-root`. A job whose out_dir escapes it (`..`, an absolute path elsewhere, a symlink
inside the root that points out, a relative `..`) is marked failed with a clear error in
its status, its results are dropped (acked, never redelivered), and nothing is written
anywhere: not at the target, not under the root."""

from __future__ import annotations

import asyncio
import os
import time

import msgspec
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.nats.test_sink import SinkProcess

pytestmark = [pytest.mark.nats, pytest.mark.timeout(120)]

ROWS = 3


def results(job: str) -> bytes:
    rows = [m.Result(i, msgspec.msgpack.encode({"prompt": f"p{i}"}), output=f"o{i}", replica="r0") for i in range(ROWS)]
    return m.encode(m.ResultBatch(job, rows))


def tree(path) -> list[str]:
    """Every file and directory under `path` (symlinks not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        out += [os.path.relpath(os.path.join(dirpath, n), path) for n in dirnames + filenames]
    return sorted(out)


def test_out_dir_outside_the_root_is_refused_and_nothing_is_written(tmp_path, nats_server):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"  # a symlink in the root points here
    outside.mkdir()
    (root / "link").symlink_to(outside, target_is_directory=True)
    escaping = {
        "dotdot": f"{root}/../escape-dotdot",
        "dotdot-back-in-name": f"{tmp_path}/../{tmp_path.name}/escape-elsewhere",  # the issue's /tmp/../tmp/elsewhere
        "absolute": str(tmp_path / "escape-absolute"),
        "symlink": str(root / "link" / "job"),
        "relative": "../escape-relative",
    }
    sink = SinkProcess(nats_server.url, tmp_path / "sink.log", PFX_OUT_ROOT=str(root))

    async def main() -> dict[str, m.JobStatus]:
        await sink.ready()
        statuses = {}
        async with Submitter(nats_server.url) as client:
            jobs = {**escaping, "inside": str(root / "ok" / "job")}
            for job, out_dir in jobs.items():
                await client.create(m.JobSpec(job=job, out_dir=out_dir, total=ROWS))
                await client.js.publish(subjects.results("r0", job), results(job))
            deadline = time.monotonic() + 60
            while len(statuses) < len(jobs):
                assert time.monotonic() < deadline, f"no final status for {sorted(set(jobs) - set(statuses))}"
                for job in jobs:
                    st = await client.status(job)
                    if st is not None and (st.failed or st.done):
                        statuses[job] = st
                await asyncio.sleep(0.2)
            # The refused jobs' results were dropped, not left to be redelivered.
            info = await client.js.consumer_info(subjects.RESULTS_STREAM.name, subjects.sink_consumer().durable)
            while info.num_ack_pending or info.num_pending:
                assert time.monotonic() < deadline, info
                await asyncio.sleep(0.2)
                info = await client.js.consumer_info(subjects.RESULTS_STREAM.name, subjects.sink_consumer().durable)
        return statuses

    try:
        statuses = asyncio.run(main())
    finally:
        sink.kill()
    for job in escaping:
        st = statuses[job]
        print(f"\n{job}: {st.error}")
        assert st.failed and not st.done and st.rows == 0, (job, st)
        assert "outside the sink's output root" in st.error and str(root) in st.error, st.error
    # Nothing written outside the root: no escape target exists, the symlink's target is empty.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nats", "outside", "root", "sink.log"]
    assert tree(outside) == []
    # Under the root: the symlink, and the one job that stayed inside.
    assert statuses["inside"].done and statuses["inside"].rows == ROWS
    assert tree(root) == ["link", "ok", "ok/job", "ok/job/_common_metadata", "ok/job/_job.json", "ok/job/_summary.json",
                          "ok/job/part-000000.parquet"]
    assert sorted(pq.read_table(root / "ok" / "job").column("id").to_pylist()) == list(range(ROWS))
