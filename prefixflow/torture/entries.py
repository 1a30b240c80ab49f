"""The torture harness's entry points: how a round's dataset reaches the cluster, each as
a user would use it.

- `run`: `prefixflow run INPUT --out OUT --engine echo` as a subprocess (its own local
  cluster, supervised by `run`; faults reach the processes its `--workdir/pids.json` names).
- `submit`: `prefixflow submit INPUT --out OUT --nats URL` as a subprocess, to the
  harness's long-lived cluster.
- `raw`: create the job in the jobs bucket, publish one message per row on
  `pfx.ingest.<job>` (README, "Publishing prompts yourself"), seal it with its total,
  wait for the sink's done status; in process.
- `batch`: the OpenAI Batch API (`prefixflow serve api`, started by the harness against
  its cluster) driven with the `openai` client (`prefixflow/torture/batches.py`).

The first three return an `Outcome` (exit code, stderr, and the job's status after it);
`batch` a `BatchResult` (the final Batch object and its files).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path

from prefixflow.launch.local_cluster import prefixflow_argv
from prefixflow.torture.checkers import Outcome
from prefixflow.torture.datasets import Dataset

ENTRIES = ("run", "submit", "raw", "batch")
MAX_TOKENS = "4"
JOB_TIMEOUT = 180.0
"""Seconds a round's job may take (echo engines: a few; faults: some more)."""


def job_argv(entry: str, input_path: Path, out: Path, job: str | None, *, url: str = "", workdir: Path | None = None,
             overwrite: bool = False, timeout: float = JOB_TIMEOUT) -> list[str]:
    """The command line of a `run` or `submit` round (what the replay prints, too)."""
    argv = [entry, str(input_path), "--out", str(out), "--no-report", "--no-progress", "--max-tokens", MAX_TOKENS,
            "--timeout", str(int(timeout))]
    if job:
        argv += ["--job", job]
    if overwrite:
        argv.append("--overwrite")
    if entry == "run":
        argv += ["--engine", "echo", "--replicas", "1"]
        if workdir is not None:
            argv += ["--workdir", str(workdir)]
    else:
        argv += ["--nats", url]
    return argv


async def command(argv: list[str], log_path: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run `prefixflow ARGV`, its output in `log_path`; (exit code, its stderr). A command
    that outlives `timeout` is killed and reported as exit code -9 (a hang)."""
    with open(log_path, "ab") as out, open(log_path.with_suffix(".err"), "wb") as err:
        proc = await asyncio.create_subprocess_exec(*prefixflow_argv(), *argv, stdout=out, stderr=err,
                                                    env={**os.environ, **env})
        try:
            code = await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            code = -9
        except asyncio.CancelledError:
            proc.kill()
            await proc.wait()
            raise
    return code, log_path.with_suffix(".err").read_text(errors="replace")


def run_submitted(log_path: Path) -> bool:
    """Whether `prefixflow run` (its stdout in `log_path`) has submitted its job: from
    then on it restarts a process that dies (before, a death fails its start-up)."""
    try:
        return b"submitting job" in log_path.read_bytes()
    except OSError:
        return False


def pids_of_run(workdir: Path) -> dict[str, int]:
    """The pids `prefixflow run --workdir` lists now (empty before it has started)."""
    try:
        doc = json.loads((workdir / "pids.json").read_text())
    except (OSError, ValueError):
        return {}
    return {name: p["pid"] for name, p in doc.get("processes", {}).items() if p.get("state") == "running"}


async def status_of(url: str, job: str, timeout: float = 10.0):
    """The job's status on the cluster (None: none, or the cluster did not answer)."""
    from prefixflow.client.submit import Submitter

    try:
        async with asyncio.timeout(timeout):
            async with Submitter(url) as client:
                return await client.status(job)
    except (TimeoutError, OSError, Exception):  # noqa: BLE001 - a cluster that does not answer: no status
        return None


def outcome_of(code: int, stderr: str, status) -> Outcome:
    if status is None:
        return Outcome(code, stderr)
    return Outcome(code, stderr, done=status.done and not status.failed and not status.cancelled,
                   failed=status.failed or status.cancelled, paused=bool(status.paused), rows=status.rows)


def outcome_of_run(code: int, stderr: str, out: Path) -> Outcome:
    """`run` stops its cluster: its job's status is what it wrote (`_summary.json`)."""
    try:
        summary = json.loads((out / "_summary.json").read_text())
    except (OSError, ValueError):
        summary = None
    failed = "failed" in stderr or "giving up" in stderr
    if summary is None:
        return Outcome(code, stderr, failed=failed, paused="paused" in stderr)
    return Outcome(code, stderr, done=not failed, failed=failed, rows=int(summary.get("rows") or 0))


# -- raw publishing ---------------------------------------------------------------------------


def raw_messages(ds: Dataset, rng: random.Random) -> list[tuple[str, bytes]]:
    """(Pfx-Id header, body) of every message, in the order they go: the malformed ones
    first when the draw says so, else anywhere; the rows published twice again at the end."""
    good = [(json.dumps(r["id"]), json.dumps(r).encode()) for r in ds.rows]
    broken = [(json.dumps(i), body) for i, body in ds.malformed]
    if "malformed first" in ds.features:
        msgs = broken + good
    else:
        msgs = good[:]
        for b in broken:
            msgs.insert(rng.randrange(len(msgs) + 1), b)
    return msgs + [good[i] for i in ds.twice]


async def publish_raw(url: str, job: str, out: Path, ds: Dataset, rng: random.Random, timeout: float) -> Outcome:
    """Create, publish, seal, wait: as the README's example does (the client may retry a
    publish or a connection the cluster dropped while a fault hit it)."""
    import msgspec
    import nats

    from prefixflow.client.submit import JobFailed, JobPaused, Submitter
    from prefixflow.shared.wire import messages as m
    from prefixflow.shared.wire import subjects

    msgs = raw_messages(ds, rng)
    total = len(ds.ids())
    spec = m.JobSpec(job=job, out_dir=str(out), sampling=m.SamplingSpec(max_tokens=int(MAX_TOKENS)),
                     created_at=time.time())
    deadline = time.monotonic() + timeout
    sent = 0
    last_error = ""
    while time.monotonic() < deadline:
        try:
            async with asyncio.timeout(max(1.0, deadline - time.monotonic())):
                async with Submitter(url) as client:
                    await client.create(spec)
                    while sent < len(msgs):
                        rid, body = msgs[sent]
                        await client.js.publish(subjects.ingest(job), body, headers={"Pfx-Id": rid}, timeout=5)
                        sent += 1
                    await client.create(msgspec.structs.replace(spec, total=total))
                    st = await client.wait(job, total, progress=False, timeout=max(1.0, deadline - time.monotonic()))
                    return outcome_of(0, "", st)
        except (nats.errors.Error, OSError, asyncio.TimeoutError) as exc:
            last_error = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.5)  # the cluster is down for a moment (a fault): again
        except JobPaused as exc:  # what `submit` says with exit code 75
            return outcome_of(75, f"error: {exc}", await status_of(url, job))
        except JobFailed as exc:  # what `submit` says with exit code 1
            return outcome_of(1, str(exc), await status_of(url, job))
    return outcome_of(-9, f"raw job not done in {timeout:.0f} s ({sent} of {len(msgs)} published): {last_error}",
                      await status_of(url, job))

