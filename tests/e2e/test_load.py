"""Under load, an engine crash costs a restart, never healthy rows: `prefixflow run` with
two real vLLM replicas kept busy by long outputs, one engine-worker SIGKILLed early.

While the dead replica's work waits for room on the live one (the router keeps it full),
nothing may count that wait as a failure: every row comes out, none as an error row
("poison message" was what healthy prompts became before)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pyarrow.parquet as pq
import pytest

from datagen.dataset import write_prefix_repetition
from tests.conftest import REPO, VENV_BIN

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

N = 160


def test_engine_killed_under_load_makes_no_error_rows(tmp_path, tiny_model):
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=64, num_prefixes=8, seed=3)
    out, workdir = tmp_path / "out", tmp_path / "cluster"
    argv = [
        str(VENV_BIN / "prefixflow"), "run", str(data), "--out", str(out), "--model", str(tiny_model), "--replicas", "2",
        "--max-tokens", "64", "--min-tokens", "64", "--ignore-eos", "--no-progress", "--job", "load", "--workdir", str(workdir),
    ]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Early in the job: both replicas full of long generations, most work still queued.
        deadline = time.monotonic() + 400
        while not any(out.glob("part-*.parquet")):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no results"
            time.sleep(0.2)
        victim = json.loads((workdir / "pids.json").read_text())["processes"]["engine0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    print(output[-3000:])
    assert proc.returncode == 0, output[-5000:]
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == list(range(N)), "every id exactly once"
    errors = [e for e in table.column("error").to_pylist() if e]
    assert errors == [], f"{len(errors)} healthy prompts became error rows: {errors[:3]}"
    assert "engine0" in output and "restart" in output.lower(), "the restart is shown"
