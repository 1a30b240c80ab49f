"""Identical requests generated once (issue 43, item 1) on the shared slow-echo cluster.

A file with 40 % exact duplicates, half of them deterministic (temperature 0, per-row
sampling) and half sampled (the job's temperature), each duplicate beside or a little
after its original, through `prefixflow submit`: every id once with its own input
columns; each deterministic duplicate's output equal to its original's and marked a copy;
merged sampled rows each with a completion of their own (the echo engine's n completions
are distinct); the summary counts what the output column says. The same file with
`--no-dedupe`: nothing deduplicated or merged. Then the engine-worker is SIGKILLed mid-job
with duplicates in flight and restarted: every id still comes out once (the followers'
work messages are redelivered with their leaders')."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import time
from collections import defaultdict

import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.shared.wire import messages as m
from tests.conftest import REPO, SLOW_ECHO, VENV_BIN

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda omicron sigma tau upsilon omega".split()


def dup_rows(n: int, seed: int = 4) -> tuple[list[dict], dict[int, int]]:
    """`n` rows, 40 % of them an exact duplicate (prompt and sampling) of an earlier row,
    most right after it, some further on; and id -> its original's id."""
    rng = random.Random(seed)
    rows: list[dict] = []
    original: dict[int, int] = {}
    for i in range(n):
        if i % 5 in (1, 3):
            src = rows[i - 1] if rng.random() < 0.7 else rows[rng.randrange(max(0, i - 40), i)]
            first = original.get(src["id"], src["id"])
            row = {k: v for k, v in src.items() if k not in ("id", "tag")}
            original[i] = first
        else:
            words = " ".join(rng.choice(WORDS) for _ in range(12))
            row = {"prompt": f"label this record: {words}"}
            if rng.random() < 0.5:
                row["sampling"] = {"temperature": 0}
        rows.append({"id": i, **row, "tag": f"t{i}"})
    return rows, original


def submit(url: str, data, out, job: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
         "--no-progress", "--no-report", "--max-tokens", "4", "--json", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def deterministic(row: dict) -> bool:
    return (row.get("sampling") or {}).get("temperature") == 0


def check_deduped(out, rows: list[dict], original: dict[int, int]) -> None:
    """Every id once with its own input columns; each deterministic duplicate a copy of its
    original's output (and only those copies); merged rows sampled, each with its own
    completion; the summary's counts are the output column's."""
    got = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(got) == list(range(len(rows))), "every id once"
    assert all(r["error"] is None and r["output"] for r in got.values())
    assert all(r["tag"] == f"t{i}" for i, r in got.items()), "each id's own input columns"
    by_id = {r["id"]: r for r in rows}
    copies = [i for i, r in got.items() if r["dedupe"] == "copy"]
    merged = [i for i, r in got.items() if r["dedupe"] == "merged"]
    det_dups = [i for i in original if deterministic(by_id[i])]
    for i in det_dups:
        assert got[i]["output"] == got[original[i]]["output"], "a deterministic duplicate has its original's output"
    # Every deterministic duplicate is a copy (its original stays in the worker's recent
    # completions: far fewer than their bound), and only those.
    assert sorted(copies) == sorted(det_dups)
    assert all(not deterministic(by_id[i]) for i in merged) and merged, "sampled duplicates beside their original merge"
    # A merged row has its own completion: not its leader's (the echo's n completions differ).
    groups = defaultdict(list)
    for i, r in got.items():
        groups[(by_id[i]["prompt"], deterministic(by_id[i]))].append(r)
    for members in groups.values():
        leaders = {r["output"] for r in members if r["dedupe"] is None}
        assert all(r["output"] not in leaders for r in members if r["dedupe"] == "merged")
    summary = json.loads((out / "_summary.json").read_text())
    assert (summary["rows"], summary["errors"]) == (len(rows), 0)
    assert (summary["deduplicated_rows"], summary["merged_rows"]) == (len(copies), len(merged))



def test_identical_rows_are_generated_once(clusters, tmp_path):
    cluster = clusters.get(engine_args=SLOW_ECHO)
    rows, original = dup_rows(400)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    on, off = tmp_path / "on", tmp_path / "off"
    procs = [submit(cluster.url, data, on, "dedupe-on"), submit(cluster.url, data, off, "dedupe-off", "--no-dedupe")]
    for p in procs:
        stdout, stderr = p.communicate(timeout=150)
        assert p.returncode == 0, stdout + stderr

    check_deduped(on, rows, original)
    plain = pq.read_table(off)
    assert sorted(plain.column("id").to_pylist()) == list(range(len(rows)))
    assert plain.column("dedupe").null_count == plain.num_rows
    summary = json.loads((off / "_summary.json").read_text())
    assert (summary["rows"], summary["deduplicated_rows"], summary["merged_rows"]) == (len(rows), 0, 0)


def test_followers_survive_their_engine_worker_killed_mid_job(clusters, tmp_path):
    cluster = clusters.get(engine_args=SLOW_ECHO)
    worker = next(p for p in cluster.procs if p.name == "engine0")
    rows, original = dup_rows(1200, seed=5)
    job, out = "dedupe-kill", str(tmp_path / "out")

    async def go() -> m.JobStatus:
        async with Submitter(cluster.url) as client:
            await client.create(m.JobSpec(job=job, out_dir=out, sampling=m.SamplingSpec(max_tokens=4)))
            await client.publish_rows(job, rows)
            await client.create(m.JobSpec(job=job, out_dir=out, sampling=m.SamplingSpec(max_tokens=4), total=len(rows)))
            deadline = time.monotonic() + 60
            while (st := await client.status(job)) is None or st.rows < 100:  # under way, duplicates in flight
                assert time.monotonic() < deadline, "the job did not start"
                await asyncio.sleep(0.05)
            cluster.running["engine0"].kill()
            cluster.running["engine0"].wait()
            cluster.start_one(worker)
            return await client.wait(job, len(rows), progress=False, timeout=150)

    status = asyncio.run(go())
    assert status.done and status.rows == len(rows) and status.errors == 0
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(len(rows))), "every id exactly once"
    assert table.column("error").null_count == table.num_rows
    got = {r["id"]: r for r in table.select(["id", "output"]).to_pylist()}
    by_id = {r["id"]: r for r in rows}
    assert all(got[i]["output"] == got[o]["output"] for i, o in original.items() if deterministic(by_id[i]))

