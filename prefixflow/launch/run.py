"""`prefixflow run`: a local cluster (nats-server and the five services) that runs one job
and stops. The command's arguments are defined in `prefixflow/cli/main.py`; this is what it does."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import pyarrow.fs as pafs

from prefixflow.client.sources import InputError, Source, access_hint, resolve
from prefixflow.shared import outputs
from prefixflow.shared.outcomes import ClusterError, Exit, interrupted, usage_error
from prefixflow.shared.outputs import is_output_uri
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import fingerprint
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.fingerprint import Fingerprint

T = TypeVar("T")


class Interrupted(KeyboardInterrupt):
    """SIGTERM (or SIGINT) reached `prefixflow run`: stop the cluster and exit."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:
    raise Interrupted(signum)


STARTUP_TIMEOUT = 300.0
"""Seconds `prefixflow run` waits for the first replica to be ready."""


async def alongside(main: Awaitable[T], side: Awaitable[None]) -> T:
    """`main`'s result, with `side` running next to it: an error of `side` cancels `main`
    and is raised; `side` is cancelled when `main` ends."""
    main_task, side_task = asyncio.ensure_future(main), asyncio.ensure_future(side)
    try:
        await asyncio.wait({main_task, side_task}, return_when=asyncio.FIRST_COMPLETED)
        if side_task.done() and not side_task.cancelled() and side_task.exception() is not None:
            raise side_task.exception()
        return await main_task
    finally:
        for task in (main_task, side_task):
            task.cancel()
        await asyncio.gather(main_task, side_task, return_exceptions=True)


class Plan(NamedTuple):
    """What `run` does with OUT, decided from its manifest before anything starts."""

    job: str
    resume: bool
    """OUT holds this job's unfinished output: only the rows not written are sent."""
    done: dict[str, Any] | None = None
    """OUT holds this job's finished output (its summary): nothing to run."""


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def output_json(out: str | Path, name: str) -> dict[str, Any] | None:
    """A small JSON file of the job output OUT (a local directory or an s3://, gs://
    prefix, read with this machine's credentials: `run`'s sink is on this machine)."""
    if is_output_uri(str(out)):
        fs, base = outputs.filesystem(str(out))
        bucket = base.split("/", 1)[0]
        if fs.get_file_info(bucket).type == pafs.FileType.NotFound:  # NOTE: else a missing bucket reads as "no file"
            raise FileNotFoundError(f"bucket {bucket!r} does not exist (or these credentials cannot see it)")
        return outputs.read_json(fs, f"{base}/{name}")
    return read_json(Path(out).resolve() / name)


def shown_out(out: str | Path) -> str:
    """OUT as messages name it: a URI's canonical spelling, a directory's absolute path."""
    return outputs.canonical(str(out)) if is_output_uri(str(out)) else str(Path(out).resolve())


def model_of(model: str) -> str:
    """The model as the job's spec names it: a local directory by its absolute path (the
    default model, made on first use, included), else as given (a hub id)."""
    path = Path(model)
    return str(path.resolve()) if path.exists() or model == cfgmod.DEFAULT_MODEL else model


def plan(out: str | Path, input_path: str | Path | Source | None, job: str | None, new_job: str, *,
         overwrite: bool = False, asked: Fingerprint | None = None) -> Plan:
    """The job `run` runs into `out` (a local directory or an s3://, gs:// prefix): the one its manifest
    (`_job.json`, written by the sink) names, if it was asked the same input and spec
    (`asked`), resumed, or reported if `_summary.json` shows it has every row (against
    INPUT's row count when the file says it cheaply: Parquet; else the summary is
    trusted). `--job` naming another job, or a job asked something else: `OutputConflict`
    (exit code 2), unless `overwrite` (then `job` or `new_job` replaces it). A manifest without a
    fingerprint (written before them): the same job, as before. No manifest: `job` or
    `new_job`."""
    from prefixflow.client.submit import JobMismatch, OutputConflict, count_rows, mismatch_text

    manifest = output_json(out, "_job.json") or {}
    out = shown_out(out)
    owner = manifest.get("job")
    if not isinstance(owner, str) or not owner:
        return Plan(job or new_job, False)
    if job is not None and job != owner:
        if overwrite:
            return Plan(job, False)
        raise OutputConflict(f"{out} holds the output of job {owner}: pass --job {owner} (or no --job) to resume "
                             f"that job, --overwrite to replace its output with job {job}'s, or another --out")
    recorded = fingerprint.decode(manifest.get("fingerprint"))
    if recorded is None:
        print(f"note: {out}/_job.json records no fingerprint of what job {owner} was asked (written before "
              "prefixflow recorded one): INPUT is taken as its input", flush=True)
    elif (diff := fingerprint.difference(recorded, asked)) is not None:
        if overwrite:
            return Plan(job or new_job, False)  # the sink replaces the output (another job, or another fingerprint)
        raise JobMismatch(mismatch_text(str(out), owner, diff))
    summary = output_json(out, "_summary.json")
    if summary is not None and summary.get("job") == owner:
        expected = None
        if isinstance(input_path, Source) or (input_path is not None and Path(input_path).exists()):
            expected = count_rows(input_path)
        if expected is None or int(summary.get("rows") or 0) >= expected:
            return Plan(owner, False, summary)
    return Plan(owner, True)


class RunResult(NamedTuple):
    """What `run_job` did: the job, its final status (None: OUT held it done already), its summary."""

    job: str
    status: m.JobStatus | None
    summary: dict[str, Any] | None
    model: str
    already_done: bool = False


class RunFailed(ClusterError):
    """The local cluster failed to start or gave up (a process out of restarts)."""


def run_job(args: argparse.Namespace, *, sampling: m.SamplingSpec, chat: dict[str, Any], new_job: str,
            storage_options: dict[str, Any] | None = None, source: Source | None = None) -> RunResult:
    """What `prefixflow run` does, raising instead of exiting: start the local cluster,
    submit the input (`source`, else `args.input` resolved with `storage_options`) while
    the engines load, supervise, stop. OUT holding this job's finished output: its summary,
    nothing started. Raises `InputError` (the input cannot be read), `OutputConflict` (OUT
    bound to another job, input or spec) or a `CommandError` of exit code 2 (a bad job id,
    replicas that do not fit the devices) before anything starts; one of `submit`'s
    `ENDINGS`, `RunFailed`, `TimeoutError` (`--timeout`, or no replica ready in
    time) and `Interrupted` (SIGTERM/SIGINT; handled only on the main thread), each after
    the cluster stopped."""
    from prefixflow.client.fingerprint import of_job
    from prefixflow.client.submit import count_rows
    from prefixflow.shared.wire.subjects import job_id_error

    if args.job is not None and (why := job_id_error(args.job)) is not None:
        raise usage_error(why)
    model = model_of(args.model)
    # The input is read before a cluster starts: a bad one fails at once, nothing written
    # (missing, no data files, no access, not its format).
    source = source if source is not None else resolve(args.input, storage_options)
    asked = of_job(source, m.JobSpec(job=new_job, out_dir="", sampling=sampling, model=model, **chat))
    count_rows(source)
    try:
        todo = plan(args.out, source, args.job, new_job, overwrite=args.overwrite, asked=asked)
    except (OSError, outputs.OutputLocationError) as exc:  # an s3:// OUT: no such bucket, no access, a bad URI
        raise usage_error(f"--out {args.out}: cannot read it: {exc}{access_hint(exc)}") from None
    if todo.done is not None:
        print(f"job {todo.job} is already done: {todo.done.get('rows')} rows ({todo.done.get('errors')} errors) "
              f"in {args.out}; nothing to run (another --out runs it again)", flush=True)
        return RunResult(todo.job, None, todo.done, model, already_done=True)
    if todo.resume:
        print(f"{args.out} holds job {todo.job}'s unfinished output: resuming it", flush=True)
    from tqdm import tqdm

    from prefixflow.launch.local_cluster import ClusterFailed, LocalCluster, ProcessExited, wait_replicas_ready
    from prefixflow.launch.processes import describe_placement, machine_devices, processes
    from prefixflow.datagen.make_model import make_model
    from prefixflow.client.submit import AlreadyDone, JobFailed, submit

    if args.model == cfgmod.DEFAULT_MODEL:
        make_model(args.model)
    extra = ["--kv-cache-blocks", str(args.kv_cache_blocks)] if args.kv_cache_blocks else []
    engine_argv = getattr(args, "engine_argv", None)
    if engine_argv:  # vLLM engine arguments for every replica, checked by vLLM's parser now
        import shlex

        from prefixflow.services.engine_worker.engine_args import explicit

        explicit(engine_argv)
        extra += [f"--engine-args={shlex.join(engine_argv)}"]  # `=`: a value may start with `--`
    devices = machine_devices()
    try:
        procs = processes(args.replicas, engine=args.engine, extra_engine_args=extra,
                          tensor_parallel_size=args.tensor_parallel_size, devices=devices, stagger=args.stagger)
    except ValueError as exc:  # replicas, devices and tensor-parallel size that do not fit together
        raise usage_error(str(exc)) from None

    def event(text: str) -> None:
        tqdm.write(text, file=sys.stdout)
        sys.stdout.flush()

    # The run's own sink writes this job only: its output root is the job's --out.
    env = {"PFX_MODEL": model, "PFX_POLICY": args.policy, "PFX_OUT_ROOT": shown_out(args.out),
           "PFX_TASK": args.task}
    cluster = LocalCluster(procs, workdir=args.workdir, env=env, on_event=event)
    job = todo.job
    replicas = [f"r{i}" for i in range(args.replicas)]

    async def replicas_ready(submitted: float) -> None:
        # The timeout bounds the wait for the first replica: the job runs on it while the
        # others start (a replica that never comes is the supervisor's business).
        def on_ready(name: str) -> None:
            event(f"{name} ready in {cluster.uptime():.1f} s: it takes work now")

        await wait_replicas_ready(cluster.url, replicas, STARTUP_TIMEOUT, on_ready=on_ready, first_within=True)
        event(f"{len(replicas)} replicas ready in {cluster.uptime():.1f} s (the job was submitted at {submitted:.1f} s)")

    async def run_job():
        # Engines start while the job is ingested and bucketed: the job is submitted as
        # soon as the services that take it are up, and each replica gets work as it
        # becomes ready.
        await cluster.wait_started([p.name for p in procs if not p.is_engine])
        submitted = cluster.uptime()
        print(f"services ready in {submitted:.1f} s: submitting job {job} while {len(replicas)} engines start", flush=True)
        # From here on a process that exits is restarted (backoff, budget) while the job goes on.
        return await cluster.supervised(
            alongside(
                submit(
                    source,
                    nats_url=cluster.url,
                    job=job,
                    out_dir=args.out,
                    sampling=sampling,
                    model=model,
                    progress=not args.no_progress,
                    timeout=args.timeout,
                    overwrite=args.overwrite,
                    resume=todo.resume,
                    max_in_flight=args.max_in_flight,
                    expires_in=args.expires_in,
                    priority=args.priority,
                    row_timeout=args.row_timeout,
                    dedupe=not getattr(args, "no_dedupe", False),
                    **chat,
                ),
                replicas_ready(submitted),
            )
        )

    print(f"starting local cluster on {cluster.url} (workdir: {cluster.workdir}, logs: {cluster.workdir / 'logs'}) ...", flush=True)
    if args.tensor_parallel_size > 1:
        if devices.gpus:
            print(f"each replica runs vLLM tensor-parallel over its own {args.tensor_parallel_size} GPUs "
                  "(the engine-worker's default: the GPUs it sees)", flush=True)
        else:
            print("note: --tensor-parallel-size applies to GPUs only; ignored on CPU", flush=True)
    for p in procs:
        if p.is_engine:
            print(f"{p.name}: {describe_placement(p.env)}", flush=True)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)} if main_thread else {}
    try:
        try:
            cluster.start()
            status = asyncio.run(run_job())
        except AlreadyDone as done:  # a --workdir whose cluster finished the job
            status = done.status
        except InputError as exc:  # a file of the input found bad while reading it (exit code 1, not 2)
            raise JobFailed(job, f"its input: {exc}") from None
        except ClusterFailed as exc:
            raise RunFailed(f"giving up: {exc}") from None
        except ProcessExited as exc:  # a process died during start-up (check_alive)
            raise RunFailed(f"cluster failed to start: {exc}") from None
    except BaseException:  # NOTE: any ending but success (re-raised): say why the cluster goes away
        print("stopping the local cluster ...", file=sys.stderr, flush=True)
        raise
    finally:
        # Stopping is not interrupted by a second Ctrl-C (it has its own time limits).
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
        restarts = {name: n for name, n in cluster.restart_counts().items() if n}
        print("restarts: " + (", ".join(f"{name} {n}" for name, n in restarts.items()) if restarts else "none"),
              flush=True)
    # The summary on disk has the per-replica totals (the status keeps only the overall ones).
    try:
        summary = output_json(args.out, "_summary.json") or status.summary
    except OSError:  # an s3:// OUT gone unreadable since: the status has the overall totals
        summary = status.summary
    return RunResult(job, status, summary, model)


def run_local(args: argparse.Namespace, *, sampling: m.SamplingSpec, chat: dict[str, Any],
              print_summary: Callable[[dict[str, Any]], None], new_job: str,
              storage_options: dict[str, Any] | None = None) -> None:
    """`prefixflow run` (`run_job`), its outcome printed: the summary and the report, or the
    error and its exit code as docs/outcomes.md says."""
    from prefixflow.client.submit import ENDINGS, ending

    error: str | None = None
    code: int = Exit.OK
    try:
        result = run_job(args, sampling=sampling, chat=chat, new_job=new_job, storage_options=storage_options)
    except InputError as exc:  # before a cluster started: exit code 2
        raise usage_error(str(exc)) from None
    except ENDINGS as exc:  # failed, cancelled, expired; paused; OUT or the id bound to another job
        end = ending(exc, cluster_stays=False)
        error, code = end.message, end.code
    except RunFailed as exc:
        error, code = str(exc), Exit.FAILED
    except TimeoutError as exc:  # --timeout, or replicas not ready in time
        error, code = str(exc), Exit.FAILED
    except (Interrupted, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
        error, code = f"interrupted ({signal.Signals(signum).name}): stopped the cluster", interrupted(signum)
    if error is not None:
        print(error if error.startswith("error: ") else f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(code)
    if result.already_done:
        print_summary(result.summary)
        return
    status = result.status
    print(f"job {result.job}: {status.rows} rows ({status.errors} errors) in {args.out}")
    if result.summary:
        print_summary(result.summary)
    if not args.no_report:
        from prefixflow.report.auto import auto_report

        auto_report(args.out, status.rows, result.model)
