"""`prefixflow plan --calibrate` through a real job on the shared echo cluster (`--nats`):
the calibration job runs, the profile is fitted to its rows' timelines and the full input
is predicted on that cluster's replicas; the job's sealed spec carries its output budget
(the ETA's plan: every row's `max_tokens`) and its last status reports it. The ±15 %
check against real vLLM is a benchmark (docs/plan.md), not this test."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import nats
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]


async def spec_and_status(url: str, job: str) -> tuple[m.JobSpec, m.JobStatus]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        spec = m.job_spec_decoder.decode((await (await js.key_value(subjects.JOBS_KV)).get(job)).value)
        status_kv = await js.key_value(subjects.JOB_STATUS_KV)
        status = m.job_status_decoder.decode((await status_kv.get(job)).value)
        return spec, status
    finally:
        await nc.close()


def test_plan_calibrates_on_a_real_job_and_predicts_the_input(clusters, tiny_model, tmp_path):
    cluster = clusters.get(replicas=1)
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=120, prefix_len=64, suffix_len=16,
                            num_prefixes=6, output_len=8, seed=5)
    work = tmp_path / "calibrate"
    r = subprocess.run(
        [sys.executable, "-m", "prefixflow.cli.main", "plan", str(data), "--calibrate", "--nats", cluster.url,
         "--model", str(tiny_model), "--max-tokens", "8", "--calibrate-rows", "40", "--workdir", str(work),
         "--fleet", "4xL4", "--json"],
        capture_output=True, text=True, cwd=REPO, timeout=200, env={**os.environ, "PFX_MODEL": str(tiny_model)},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    cal = report["calibration"]
    assert cal["rows"] == 40 and cal["replicas"] == 1 and cal["output_lens"] == [2, 8]
    assert cal["measured_wall_seconds"] > 0 and cal["predicted_wall_seconds"] > 0
    assert (work / "profile.json").exists() and json.loads((work / "profile.json").read_text())["name"] == "calibrated-here"
    here, l4 = report["fleets"]
    assert (here["fleet"], here["gpus"], here["profile"]) == ("1xhere", 1, "calibrated-here")
    assert here["sample_rows"] == 120  # every row: the input is under --sample-rows
    assert l4["fleet"] == "4xL4"
    for f in (here, l4):
        assert {x["method"] for x in f["methods"]} == {"prefix-aware", "sorted", "naive"}
        assert all(f["limit"]["wall_seconds"] <= x["wall_seconds"] for x in f["methods"])
    # The calibration job was sealed with its rows' output budget (20 rows of 8, 20 of 2).
    budgets = [s["max_tokens"] for s in pq.read_table(work / "calibration.parquet").column("sampling").to_pylist()]
    assert sorted(set(budgets)) == [2, 8]
    spec, status = asyncio.run(spec_and_status(cluster.url, cal["job"]))
    assert spec.total == 40 and spec.planned_output_tokens == sum(budgets)
    assert status.done and status.planned_output_tokens == sum(budgets) and status.eta_seconds() == 0.0
