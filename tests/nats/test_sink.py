"""The sink as the OS process it runs as, against a real nats-server: a poison results
message's rows survive a sink crash between dead-lettering and the part write; and,
through `prefixflow run` (every service a process, `echo` engine), input columns named
like generated ones come back intact under `input_<name>`."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.client import columns
from prefixflow.client.submit import Submitter
from prefixflow.shared.bus.blobs import put_blob
from prefixflow.shared.bus.poison import PRIOR_DELIVERIES
from prefixflow.shared.prefix.tokenize import load_tokenizer
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import VENV_BIN, run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]


class SinkProcess:
    """`prefixflow serve sink`, logging JSON to a file."""

    def __init__(self, url: str, log: Path, **env: str) -> None:
        self.log = log
        env = {**os.environ, "PFX_NATS_URL": url, "PFX_LOG_FORMAT": "json", **env}
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([str(VENV_BIN / "prefixflow"), "serve", "sink"], env=env, stdout=f, stderr=subprocess.STDOUT)

    async def ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while '"sink ready"' not in self.log.read_text(errors="replace"):
            assert self.proc.poll() is None, self.log.read_text(errors="replace")
            assert time.monotonic() < deadline, "sink did not start"
            await asyncio.sleep(0.1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_poison_results_rows_survive_a_sink_crash_before_their_part_is_written(tmp_path, nats_server):
    """A poison results message is dead-lettered at once, but it must stay unsettled until
    its error rows are on disk: a SIGKILL in between then redelivers it (the old sink had
    terminated it already, so its rows were lost and the job never completed)."""
    job, out = "poison-sink", tmp_path / "out"
    # The rows' input columns are kept in a blob (as the client keeps them); results refer to it.
    poison = [m.Result(i, output=f"o{i}", replica="r1", src=0, row=i) for i in range(5)]
    normal = [m.Result(i, output=f"o{i}", replica="r0", src=0, row=i) for i in range(5, 8)]
    kept = columns.ipc_bytes(pa.table({"prompt": [f"p{i}" for i in range(8)]}))
    log = tmp_path / "sink.log"
    # The first sink never writes a part on its own: the crash lands between take and flush.
    first = SinkProcess(nats_server.url, log, PFX_FLUSH_SECONDS="600", PFX_FLUSH_ROWS="100000")
    second = None

    async def go() -> tuple[m.JobStatus, object, int]:
        nonlocal second
        await first.ready()
        async with Submitter(nats_server.url) as client:
            js = client.js
            await client.create(m.JobSpec(job=job, out_dir=str(out), total=len(poison) + len(normal)))
            await put_blob(js, client.nc, job, m.input_blob(0), kept)
            # Failed (say) 10 times before: poison on its first delivery here.
            await js.publish(subjects.results("r1", job), m.encode(m.ResultBatch(job, poison)), headers={PRIOR_DELIVERIES: "10"})
            await js.publish(subjects.results("r0", job), m.encode(m.ResultBatch(job, normal)))
            deadline = time.monotonic() + 30
            while (await js.stream_info(subjects.DEAD_STREAM.name)).state.messages < 1:
                assert time.monotonic() < deadline, "poison message not dead-lettered"
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # the old sink terminated the message right after
            first.kill()
            assert not list(out.glob("part-*.parquet")), "the crash came before any part"
            info = await js.consumer_info(subjects.RESULTS_STREAM.name, subjects.sink_consumer().durable)
            assert info.num_ack_pending == 2, "both messages stay unsettled (the poison one was terminated)"

            second = SinkProcess(nats_server.url, log)  # the supervisor's restart
            await second.ready()
            status = await client.wait(job, len(poison) + len(normal), progress=False, timeout=60)
            await asyncio.sleep(0.5)  # the flush settles its messages right before the status put
            info = await js.consumer_info(subjects.RESULTS_STREAM.name, subjects.sink_consumer().durable)
            dead = (await js.stream_info(subjects.DEAD_STREAM.name)).state.messages
            return status, info, dead

    try:
        status, info, dead = asyncio.run(go())
    finally:
        first.kill()
        if second is not None:
            second.kill()
    assert status.done and status.rows == 8 and status.errors == 5
    assert (info.num_ack_pending, info.num_pending) == (0, 0), "every message settled"
    assert dead >= 1  # once per poison delivery: twice here (before and after the crash)
    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(rows) == list(range(8)), "every row exactly once"
    for i in range(5):
        assert "poison" in rows[i]["error"] and rows[i]["replica"] == "r1" and rows[i]["output"] is None
    for i in range(5, 8):
        assert rows[i]["error"] is None and rows[i]["output"] == f"o{i}" and rows[i]["prompt"] == f"p{i}"
    assert json.loads((out / "_summary.json").read_text())["errors"] == 5


def test_results_whose_body_names_another_job_than_their_subject_are_dead_lettered(tmp_path, nats_server):
    """The subject is what grants and tenants are about: a result batch for job b sent on
    job a's subject writes nothing anywhere (dead-lettered with the reason); both jobs
    then complete with their own rows only."""
    out_a, out_b = tmp_path / "a", tmp_path / "b"
    sink = SinkProcess(nats_server.url, tmp_path / "sink.log")

    async def go() -> tuple[m.JobStatus, m.JobStatus, list]:
        await sink.ready()
        async with Submitter(nats_server.url) as client:
            js = client.js
            await client.create(m.JobSpec(job="job-a", out_dir=str(out_a), total=2))
            await client.create(m.JobSpec(job="job-b", out_dir=str(out_b), total=2))
            forged = [m.Result(i, output="forged", replica="r9") for i in range(2)]
            await js.publish(subjects.results("r9", "job-a"), m.encode(m.ResultBatch("job-b", forged)))
            deadline = time.monotonic() + 30
            while (await js.stream_info(subjects.DEAD_STREAM.name)).state.messages < 1:
                assert time.monotonic() < deadline, "the forged batch was not dead-lettered"
                await asyncio.sleep(0.1)
            dead = await js.get_last_msg(subjects.DEAD_STREAM.name, subjects.dead(subjects.results("r9", "job-a")))
            for job in ("job-a", "job-b"):
                rows = [m.Result(i, output=f"{job}-{i}", replica="r0") for i in range(2)]
                await js.publish(subjects.results("r0", job), m.encode(m.ResultBatch(job, rows)))
            a = await client.wait("job-a", 2, progress=False, timeout=60)
            b = await client.wait("job-b", 2, progress=False, timeout=60)
            return a, b, [dead.headers]

    try:
        a, b, headers = asyncio.run(go())
    finally:
        sink.kill()
    assert a.done and b.done and a.rows == b.rows == 2 and a.errors == b.errors == 0
    for job, out in (("job-a", out_a), ("job-b", out_b)):
        assert sorted(r["output"] for r in pq.read_table(out).to_pylist()) == [f"{job}-0", f"{job}-1"]
    assert "results for job 'job-b' on 'pfx.results.r9.job-a'" in json.dumps(headers)


def test_run_keeps_input_columns_named_like_generated_ones(tmp_path, tiny_model):
    """`prefixflow run` on a dataset with reference `output`, `error` and `replica` columns
    (and an `input_output` one): every input value comes back intact under its new name;
    the generated columns are the engine's."""
    n = 20
    inputs = [
        {
            "prompt": f" the quick brown fox number {i}",
            "output": f"reference answer {i}",
            "error": f"input error {i}" if i % 2 else None,
            "replica": f"annotator-{i % 3}",
            "prompt_tokens": 1000 + i,
            "input_output": f"already prefixed {i}",
            "tag": i % 4,
        }
        for i in range(n)
    ]
    data = tmp_path / "refs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in inputs))
    out = tmp_path / "out"
    res = run_cli("run", str(data), "--out", str(out), "--model", str(tiny_model), "--engine", "echo", "--replicas", "1",
                  "--max-tokens", "4", "--no-progress", "--job", "input-columns", "--timeout", "150", timeout=200)
    assert res.returncode == 0, res.stdout + res.stderr

    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(rows) == list(range(n))  # ids from row numbers
    tok = load_tokenizer(str(tiny_model))
    for i, given in enumerate(inputs):
        row = rows[i]
        # every input value, intact
        assert row["prompt"] == given["prompt"] and row["tag"] == given["tag"]
        assert row["input_output"] == given["output"]
        assert row["input_error"] == given["error"]
        assert row["input_replica"] == given["replica"]
        assert row["input_prompt_tokens"] == given["prompt_tokens"]
        assert row["input_input_output"] == given["input_output"]
        # the generated columns: the echo engine's (its instant batch path writes
        # "<n> tokens", its per-prompt path the prompt's last n token ids)
        ids = tok.encode(given["prompt"]).ids
        assert row["output"] in ("4 tokens", " ".join(map(str, ids[-4:]))), row
        assert (row["error"], row["replica"], row["finish_reason"]) == (None, "r0", "length")
        assert (row["prompt_tokens"], row["output_tokens"]) == (len(ids), 4)
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == n and summary["errors"] == 0 and set(summary["replicas"]) == {"r0"}
