"""Find the culprit, spare the rest (issue #22), through `prefixflow run` as a user runs it:
one prompt kills the engine whenever it runs (the echo engine's crash token), in a bucket
of 32; besides, three unrelated engine deaths mid-job (each replica's engine dies once
after `CRASH_AFTER` prompts, and engine0's worker process is SIGKILLed). Exactly one error
row (the killer's), every other row generated, exit code 0.

Echo engines at 50 ms a prompt, 8 in flight, 64-prompt work messages: ~320 prompts/s on
two replicas, so the job lasts ~10 s and every fault lands mid-job.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prefixflow.services.engine_worker.isolate import STRIKES
from prefixflow.services.router.assignments import MIN_CUT_PROMPTS
from tests.conftest import REPO, VENV_BIN
from tests.nats.test_run_cli import job_rows, read_pids, wait_for

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

GROUPS, GROUP = 48, 64
N = GROUPS * GROUP
KILLER_TOKEN = 8000
"""In the killer's prompt only (the tiny model's vocabulary is 8192; other prompts use < 7000)."""
SLICE = MIN_CUT_PROMPTS
"""The bucketer releases each group in slices of this many prompts, which the router never
cuts (a larger bucket may be cut to a replica's room, the rest sent later in a bucket of
its own): the killer comes in a batch of this many."""
CRASH_AFTER = 300
"""Each engine (each worker process) also dies once after this many prompts: unrelated deaths."""
ENV = {
    "PFX_ECHO_DELAY": "0.05", "PFX_WINDOW": "8", "PFX_MAX_BATCH": str(GROUP), "PFX_MAX_BUCKET": str(SLICE),
    "PFX_ECHO_CRASH_TOKEN": str(KILLER_TOKEN), "PFX_ECHO_CRASH_AFTER": str(CRASH_AFTER),
}


def write_rows(path: Path) -> str:
    """GROUPS groups of GROUP prompts sharing a 128-token prefix (a bucket each); returns the
    killer's id (in the middle of one group)."""
    rng = random.Random(22)
    killer = f"g{GROUPS // 2}-{GROUP // 2}"
    with open(path, "w") as f:
        for g in range(GROUPS):
            prefix = [rng.randrange(10, 7000) for _ in range(128)]
            for i in range(GROUP):
                rid = f"g{g}-{i}"
                suffix = [rng.randrange(10, 7000) for _ in range(16)]
                if rid == killer:
                    suffix[7] = KILLER_TOKEN
                f.write(json.dumps({"id": rid, "prompt_token_ids": prefix + suffix}) + "\n")
    return killer


def test_only_the_prompt_that_kills_the_engine_alone_is_an_error_row(tmp_path, tiny_model):
    data = tmp_path / "prompts.jsonl"
    killer = write_rows(data)
    workdir, out, log = tmp_path / "cluster", tmp_path / "out", tmp_path / "run.log"
    argv = [
        str(VENV_BIN / "prefixflow"), "run", str(data), "--out", str(out), "--engine", "echo", "--replicas", "2",
        "--model", str(tiny_model), "--max-tokens", "4", "--workdir", str(workdir), "--job", "culprit",
        "--no-progress", "--timeout", "240",
    ]
    t0 = time.monotonic()
    with open(log, "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **ENV})
    try:
        pids = wait_for(lambda: read_pids(workdir), 60, "pids.json", proc, log)
        url = pids["url"]
        # The third unrelated death: engine0's worker process, mid-job.
        wait_for(lambda: job_rows(url, "culprit") >= N // 3, 120, "a third of the job", proc, log)
        pid = read_pids(workdir)["processes"]["engine0"]["pid"]
        os.kill(pid, 9)
        assert job_rows(url, "culprit") < N, "the kill landed mid-job"
        proc.wait(240)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    text = log.read_text()
    seconds = time.monotonic() - t0
    logs = "".join(p.read_text() for p in (workdir / "logs").glob("engine*.log"))
    deaths = logs.count("engine died: re-publishing its work")
    isolated = logs.count("re-published for isolation")
    print(f"\nculprit: {seconds:.1f} s through prefixflow run; {deaths} engine deaths in-process, "
          f"{isolated} with work re-published for isolation; plus 1 SIGKILL")
    assert proc.returncode == 0, text
    assert "engine0 down (exit -9)" in text, text
    assert deaths >= STRIKES + 2, "the killer's (alone, STRIKES times) and both unrelated in-process deaths"
    table = pq.read_table(out)
    rows = {r["id"]: r for r in table.select(["id", "error", "output", "bucket"]).to_pylist()}
    assert len(rows) == table.num_rows == N, "every id exactly once"
    errors = {i: r["error"] for i, r in rows.items() if r["error"] is not None}
    assert list(errors) == [killer], errors
    assert "poison" in errors[killer]
    assert all(r["output"] for i, r in rows.items() if i != killer), "every other row generated"
    bucket = rows[killer]["bucket"]
    assert sum(1 for r in rows.values() if r["bucket"] == bucket) >= SLICE, "the killer came in a bucket of 32"
