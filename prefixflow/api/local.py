"""`prefixflow.run`: a job on a local cluster of its own, from Python (`prefixflow run`).

It calls what the command calls (`prefixflow.launch.run.run_job`: the input read and
fingerprinted first, `OUT`'s manifest consulted, the cluster started, the job submitted
while the engines load, supervised, stopped) and returns a `Result` where the command
prints a summary; the errors it exits with are the typed exceptions here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path
from typing import Any

from prefixflow.api.jobs import Result, given_name, output_location, prepare, result_of
from prefixflow.api.options import job_options, refused
from prefixflow.api.portal import in_running_loop


def run(source: Any, *, out: str | Path, **job: Any) -> Result:
    """Start a local cluster (nats-server and the five services), run `source` through it
    into `out`, stop it; the job's `Result` (`to_arrow()`, `dataset()`, `summary`).

    `source`: as `Client.submit` takes it (a path, glob or URI; a `pyarrow.Table`, a
    pandas or Polars DataFrame, an iterable of `pyarrow.RecordBatch`). `**job`:
    `prefixflow run`'s options as keywords: the job's (`max_tokens`, `temperature`,
    `job`, `overwrite`, `row_timeout`, ...) and the cluster's (`engine="vllm"|"echo"`,
    `replicas`, `model`, `policy`, `workdir`, ...). `out` holding this job's finished
    output: its `Result` (`already_done`), nothing started. Raises `InputError`,
    `OptionError`, `OutputConflict` before anything starts; `JobFailed`, `JobCancelled`,
    `JobPaused`, `ClusterError`, `TimeoutError` (`timeout=`) after the cluster stopped.
    Inside a running event loop (a notebook) it runs on a worker thread; `run_async`
    awaits it."""
    if in_running_loop():
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="prefixflow-run") as pool:
            return pool.submit(_run, source, out, job).result()
    return _run(source, out, job)


async def run_async(source: Any, *, out: str | Path, **job: Any) -> Result:
    """`run`, awaited (on a worker thread)."""
    return await asyncio.to_thread(_run, source, out, job)


def _run(source: Any, out: str | Path, job: dict[str, Any]) -> Result:
    from prefixflow.cli.options import default_job_id
    from prefixflow.launch.run import run_job

    opts = job_options("run", given_name(source), str(out), job)
    src = prepare(source, opts.storage_options)
    done = refused(lambda: run_job(opts.args, sampling=opts.sampling, chat=opts.chat, new_job=default_job_id(src.given),
                                   source=src))
    if done.already_done:
        summary = done.summary or {}
        return Result(done.job, output_location(out), int(summary.get("rows") or 0), int(summary.get("errors") or 0),
                      done.summary, already_done=True)
    result = result_of(done.status, out)
    result.summary = done.summary
    if not opts.args.no_report:
        from prefixflow.report.auto import auto_report

        auto_report(out, result.rows, done.model)
    return result
