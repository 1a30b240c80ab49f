"""No row holds a job (issue 39, item 4), through `prefixflow submit` and `prefixflow
status` on the shared slow-echo cluster: rows over documented limits are error rows
naming the limit; a row that never finishes (the echo engine's stall knob) is named by
`status` while the job waits on it, then becomes an error row `--row-timeout` seconds
after an engine took it, and the job is done; the engine is left idle (its request was
aborted), every id once."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from prefixflow.cli.main import parse_args
from prefixflow.client.submit import Submitter
from prefixflow.services.engine_worker.engines.echo import STALL
from prefixflow.shared.wire import limits
from tests.conftest import REPO, SLOW_ECHO, VENV_BIN, wait_idle

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

N, STALLED, TOO_MANY_STOPS, TOO_DEEP = 30, 13, 7, 20
ROW_TIMEOUT = 10
"""Seconds: long enough to ask `status` while the job waits on the stalled row."""


def rows() -> list[dict]:
    out = []
    for i in range(N):
        row = {"id": i, "prompt": f"a row of the job, number {i}", "tag": f"t{i}"}
        if i == STALLED:
            row["sampling"] = {"stop": [STALL]}
        elif i == TOO_MANY_STOPS:
            row["sampling"] = {"stop": [f"s{k}" for k in range(limits.MAX_STOP + 1)]}
        elif i == TOO_DEEP:
            schema: dict = {"type": "string"}
            for _ in range(40):
                schema = {"type": "object", "properties": {"a": schema}}
            row["json_schema"] = json.dumps(schema)
        out.append(row)
    return out


def rows_written(url: str, job: str) -> int:
    """Rows written of a sealed job (0 until `submit` has sealed it: before, its total is
    unknown and `status` cannot tell its tail)."""
    async def get():
        async with Submitter(url) as client:
            st = await client.status(job)
            return st.rows if st is not None and st.total is not None else 0
    return asyncio.run(get())


def test_rows_over_limits_and_a_stalled_row_end_as_error_rows(clusters, tmp_path, capsys):
    cluster = clusters.get(engine_args=SLOW_ECHO)
    url, job, out = cluster.url, "row-limits", tmp_path / "out"
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    t0 = time.monotonic()
    submit = subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
         "--no-progress", "--no-report", "--max-tokens", "4", "--row-timeout", str(ROW_TIMEOUT)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        # 1. Every row but the stalled one comes out at once (the job sealed); `status` names the one left.
        deadline = time.monotonic() + 60
        while rows_written(url, job) < N - 1:
            assert time.monotonic() < deadline and submit.poll() is None, "the job's other rows did not come out"
            time.sleep(0.1)
        # NOTE: `prefixflow status`'s own function, in this process: a new interpreter takes
        # seconds to start on a loaded machine, and the row's deadline does not wait.
        capsys.readouterr()
        args = parse_args(["status", job, "--nats", url])
        args.fn(args)
        said = capsys.readouterr().out
        assert f"{job}: waiting on 1 rows: 1 in engines (ids {STALLED}), the oldest admitted" in said, said
        assert "on replica r0" in said, said
        # 2. The stalled row becomes an error row after its deadline; the job is done.
        stdout, stderr = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            submit.kill()
    took = time.monotonic() - t0
    assert submit.returncode == 0, stdout + stderr
    assert ROW_TIMEOUT <= took < ROW_TIMEOUT + 40, took
    table = pq.read_table(out)
    got = {r["id"]: r for r in table.to_pylist()}
    assert len(got) == table.num_rows == N  # every id once
    assert got[STALLED]["error"] == limits.timeout_error(ROW_TIMEOUT)
    assert f"--row-timeout {ROW_TIMEOUT}" in got[STALLED]["error"]
    assert f"stop: {limits.MAX_STOP + 1} strings, over the limit of {limits.MAX_STOP}" in got[TOO_MANY_STOPS]["error"]
    assert f"over the limit of {limits.MAX_SCHEMA_DEPTH}" in got[TOO_DEEP]["error"]
    assert all(r["error"] is None and r["output"] for i, r in got.items() if i not in (STALLED, TOO_MANY_STOPS, TOO_DEEP))
    assert all(r["tag"] == f"t{i}" for i, r in got.items())  # input columns kept, error rows too
    summary = json.loads((out / "_summary.json").read_text())
    assert (summary["rows"], summary["errors"], summary["timed_out_rows"], summary["late_results"]) == (N, 3, 1, 0)
    # 3. The stalled request was aborted: the engine holds nothing.
    assert asyncio.run(wait_idle(url, ["r0"], 10))
