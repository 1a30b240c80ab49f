"""Re-runs through the commands users type (issue #23), on echo engines:

- `prefixflow run` twice with the same command: the second prints the summary and exits 0
  at once, starting no cluster;
- another `--job` into a directory bound to a job: a clear error (exit 2), the first job's
  output byte-identical; `--overwrite` replaces it;
- another input or another sampling into a finished job's directory (issue 39): exit 2
  naming the difference, the first output byte-identical; `--overwrite` replaces it;
  the same for `submit`, whose same command twice (no `--job`) exits 0 at once;
- an empty input: exit 0, an empty output and `_summary.json`;
- `prefixflow submit` resuming a job interrupted half way (its input copied to another
  path) against one running cluster publishes only the missing ids; a finished job is not
  run again; another job into its directory is refused.

The manifest (`_job.json`), empty jobs and done queries are the sink's: the tests that
need them say so in their docstring.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.client import columns
from prefixflow.client.submit import Submitter
from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.shared.wire import messages as m
from tests.conftest import run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

N = 400


def run_job(data: Path, out: Path, workdir: Path, model: Path, *extra: str, timeout: float = 240):
    return run_cli("run", str(data), "--out", str(out), "--engine", "echo", "--replicas", "1", "--no-progress",
                   "--max-tokens", "4", "--model", str(model), "--workdir", str(workdir), *extra, timeout=timeout)


def snapshot(out: Path) -> dict[str, bytes]:
    """Every file of the output (the report aside: it is rewritten by design)."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file() and "_report" not in p.parts}


def ids_once(out: Path, n: int) -> None:
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == n, f"{len(ids)} rows, {len(set(ids))} ids, want {n}"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_model) -> Path:
    data = tmp_path_factory.mktemp("reruns") / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=64, suffix_len=8,
                            num_prefixes=4, output_len=4, seed=3)
    return data


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, dataset, tiny_model) -> Path:
    """`run` of job `first` into OUT, once for the module."""
    base = tmp_path_factory.mktemp("first")
    out = base / "out"
    res = run_job(dataset, out, base / "w1", tiny_model, "--job", "first")
    assert res.returncode == 0, res.stdout + res.stderr
    # The summary once, as a table (JSON only with --json).
    assert res.stdout.count("wall seconds:") == 1 and '"wall_seconds"' not in res.stdout, res.stdout
    ids_once(out, N)
    return out


def test_the_same_run_twice_prints_the_summary_and_starts_nothing(first_run, dataset, tiny_model, tmp_path):
    """Needs the sink's manifest (`_job.json`)."""
    before = snapshot(first_run)
    res = run_job(dataset, first_run, tmp_path / "w2", tiny_model, timeout=60)  # no --job: OUT's job
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"job first is already done: {N} rows" in res.stdout, res.stdout
    assert "wall seconds:" in res.stdout, "the summary is printed"
    assert "starting local cluster" not in res.stdout
    assert not (tmp_path / "w2" / "pids.json").exists(), "no cluster started"
    assert snapshot(first_run) == before


def test_json_prints_the_summary_as_json_only(first_run, dataset, tiny_model, tmp_path):
    res = run_job(dataset, first_run, tmp_path / "w2j", tiny_model, "--json", timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "wall seconds:" not in res.stdout, "no table beside the JSON"
    printed = json.loads(res.stdout[res.stdout.index("{"):])
    assert printed == json.loads((first_run / "_summary.json").read_text())


def test_another_job_into_a_bound_directory_is_refused(first_run, dataset, tiny_model, tmp_path):
    """Needs the sink's manifest (`_job.json`)."""
    before = snapshot(first_run)
    res = run_job(dataset, first_run, tmp_path / "w3", tiny_model, "--job", "second", timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "holds the output of job first" in res.stderr and "--overwrite" in res.stderr, res.stderr
    assert not (tmp_path / "w3" / "pids.json").exists(), "refused before starting a cluster"
    assert snapshot(first_run) == before, "the first job's output is untouched"


@pytest.fixture(scope="module")
def other_input(tmp_path_factory) -> Path:
    """Another input, with fewer rows than `dataset` (the case that was "already done")."""
    data = tmp_path_factory.mktemp("other") / "other.parquet"
    pq.write_table(pa.table({"id": list(range(OTHER_N)), "prompt": [f"another prompt {i}" for i in range(OTHER_N)]}), data)
    return data


OTHER_N = 50


def refused(res, out: Path, before: dict[str, bytes], *named: str) -> None:
    """Exit code 2 naming the difference, OUT byte-identical."""
    assert res.returncode == 2, res.stdout + res.stderr
    assert "which was asked something else" in res.stderr and "--overwrite" in res.stderr, res.stderr
    for text in named:
        assert text in res.stderr, res.stderr
    assert snapshot(out) == before, "the first job's output is untouched"


def test_another_input_or_sampling_into_a_finished_jobs_directory_is_refused(first_run, dataset, other_input,
                                                                             tiny_model, tmp_path):
    """Issue 39: OUT's job was asked another input (fewer rows: it was "already done") or
    another sampling; with or without --job. Refused before a cluster starts."""
    before = snapshot(first_run)
    assert "fingerprint" in json.loads((first_run / "_job.json").read_text()), "the sink records what was asked"
    res = run_job(other_input, first_run, tmp_path / "w5", tiny_model, timeout=60)
    refused(res, first_run, before, "job first", "input: another input")
    res = run_job(other_input, first_run, tmp_path / "w6", tiny_model, "--job", "first", timeout=60)
    refused(res, first_run, before, "input: another input")
    res = run_job(dataset, first_run, tmp_path / "w7", tiny_model, "--temperature", "0.5", timeout=60)
    refused(res, first_run, before, "spec: sampling.temperature default -> 0.5")
    assert not any((tmp_path / w / "pids.json").exists() for w in ("w5", "w6", "w7")), "no cluster started"


def test_overwrite_replaces_the_other_jobs_output(first_run, other_input, tiny_model, tmp_path):
    """Needs the sink: `JobSpec.overwrite` deletes the other job's output and rebinds OUT:
    another input, no --job (a new job). (Runs last in this module: it replaces
    `first_run`'s output.)"""
    res = run_job(other_input, first_run, tmp_path / "w4", tiny_model, "--overwrite")
    assert res.returncode == 0, res.stdout + res.stderr
    job = json.loads((first_run / "_job.json").read_text())["job"]
    assert job.startswith("other-"), job
    summary = json.loads((first_run / "_summary.json").read_text())
    assert summary["job"] == job and summary["rows"] == OTHER_N
    ids_once(first_run, OTHER_N)
    assert set(pq.read_table(first_run).column("prompt").to_pylist()) == {f"another prompt {i}" for i in range(OTHER_N)}


def test_an_empty_input_is_an_empty_output(tmp_path, tiny_model):
    """Needs the sink: a sealed job of total 0 completes (empty output, `_summary.json`)."""
    data = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.int64()), "prompt": pa.array([], pa.string())}), data)
    out = tmp_path / "out"
    res = run_job(data, out, tmp_path / "w", tiny_model, "--job", "empty", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert pq.read_table(out).num_rows == 0
    assert json.loads((out / "_summary.json").read_text())["rows"] == 0


async def _publish_half(url: str, data: Path, out: Path, job: str) -> int:
    """A client that died half way: the job created, half its rows published, never sealed."""
    async with Submitter(url) as client:
        await client.claim_dir(str(out.resolve()), job)
        await client.create(m.JobSpec(job=job, out_dir=str(out.resolve()), sampling=m.SamplingSpec(max_tokens=4),
                                      created_at=time.time()))
        sent = 0
        for chunk in columns.chunks(data):
            rows = chunk.rows[: len(chunk.rows) // 2]
            await client.put_columns(job, chunk)
            await client.publish_rows(job, rows)
            sent += len(rows)
        return sent


async def _rows_written(url: str, job: str, want: int, timeout: float) -> int:
    async with Submitter(url) as client:
        deadline = time.monotonic() + timeout
        while True:
            st = await client.status(job)
            if (st is not None and st.rows >= want) or time.monotonic() > deadline:
                return st.rows if st else 0
            await asyncio.sleep(0.3)


@pytest.fixture
def echo_cluster(clusters):
    return clusters.get()


def test_submit_resumes_a_job_interrupted_half_way_sending_only_the_missing_ids(echo_cluster, dataset, tmp_path):
    """`prefixflow submit` of a job half done, its input at another path: only the
    missing ids are published (needs the sink's answer to done queries; without it every
    row is sent and the sink drops the duplicates). Then the same submit again exits 0 at
    once, and another job into the directory is refused (exit 2)."""
    url, out, job = echo_cluster.url, tmp_path / "out", "resumed"
    half = asyncio.run(_publish_half(url, dataset, out, job))
    assert asyncio.run(_rows_written(url, job, half, 60)) == half
    moved = tmp_path / "elsewhere" / "copy.parquet"
    moved.parent.mkdir()
    shutil.copy(dataset, moved)
    res = run_cli("submit", str(moved), "--out", str(out), "--nats", url, "--job", job, "--no-progress",
                  "--max-tokens", "4", "--timeout", "120", timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"resuming job {job}: {half} rows already done, {N - half} sent" in res.stdout, res.stdout
    ids_once(out, N)

    again = run_cli("submit", str(moved), "--out", str(out), "--nats", url, "--job", job, "--no-progress",
                    "--max-tokens", "4", timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"job {job} is already done: {N} rows" in again.stdout, again.stdout

    other = run_cli("submit", str(moved), "--out", str(out), "--nats", url, "--job", "intruder", "--no-progress", timeout=60)
    assert other.returncode == 2, other.stdout + other.stderr
    assert re.search(r"holds the output of job resumed.*--overwrite", other.stderr), other.stderr
    ids_once(out, N)


def submit_cli(url: str, data: Path, out: Path, *extra: str, timeout: float = 180):
    return run_cli("submit", str(data), "--out", str(out), "--nats", url, "--no-progress", "--max-tokens", "4",
                   "--timeout", "120", *extra, timeout=timeout)


def test_submit_of_another_input_or_sampling_into_a_finished_jobs_directory(echo_cluster, dataset, other_input, tmp_path):
    """Issue 39 through `submit` (no --job: the job bound to OUT if asked the same): the
    same command twice exits 0 at once; another input (with or without --job) or another
    sampling exits 2 naming it, OUT byte-identical; --overwrite replaces it."""
    url, out = echo_cluster.url, tmp_path / "out"
    first = submit_cli(url, dataset, out)
    assert first.returncode == 0, first.stdout + first.stderr
    ids_once(out, N)
    owner = json.loads((out / "_job.json").read_text())["job"]
    before = snapshot(out)

    again = submit_cli(url, dataset, out, timeout=60)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"job {owner} is already done: {N} rows" in again.stdout, again.stdout
    assert snapshot(out) == before

    refused(submit_cli(url, other_input, out, timeout=60), out, before, f"job {owner}", "input: another input")
    refused(submit_cli(url, dataset, out, "--max-tokens", "8", timeout=60), out, before,
            "spec: sampling.max_tokens 4 -> 8")
    named = submit_cli(url, other_input, out, "--job", owner, timeout=60)
    assert named.returncode == 2 and f"job {owner} was submitted with another input or spec" in named.stderr, named.stderr
    assert snapshot(out) == before

    replaced = submit_cli(url, other_input, out, "--overwrite")
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    job = json.loads((out / "_job.json").read_text())["job"]
    assert job != owner and f"held job {owner}'s output: job {job} replaces it" in replaced.stdout, replaced.stdout
    assert json.loads((out / "_summary.json").read_text())["rows"] == OTHER_N
    ids_once(out, OTHER_N)
