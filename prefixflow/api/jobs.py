"""`prefixflow.Client`: submit jobs to a running cluster and follow them from Python.

    client = prefixflow.Client("nats://127.0.0.1:4222")
    job = client.submit(table, out="out/", max_tokens=32)   # returns once the job is created
    job.status().state                                      # queued, running, done, ...
    result = job.wait()                                     # or job.cancel()
    result.to_arrow()                                       # the output as a pyarrow.Table

A job runs what `prefixflow submit` runs (`prefixflow.client.submit.submit`: the same
fingerprint, resume, "already done" and refusal rules, the same publishing window) on the
client's own event loop thread (`prefixflow/api/portal.py`), so `submit` returns a handle
at once and every method works inside a running event loop (a notebook) as outside; each
has an `_async` twin. Failures are the typed exceptions of `prefixflow.shared.outcomes`
(`JobFailed`, `JobCancelled`, `JobPaused`, `InputError`, `OutputConflict`, `OptionError`,
`ClusterError`), never a `SystemExit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixflow.api.options import job_options
from prefixflow.api.portal import Portal
from prefixflow.shared.outcomes import ClusterError, OptionError

CONNECT_TIMEOUT = 10.0
"""Seconds a `Client` waits for NATS before `ClusterError`."""
CANCEL_TIMEOUT = 60.0
"""Seconds `Job.cancel` waits for the job to settle as cancelled."""


def output_location(out: str | Path) -> str | Path:
    """Where a job's output is, as the handle keeps it: an object store URI as given
    (`s3://bucket/prefix/`), a local directory made absolute."""
    from prefixflow.shared.outputs import is_output_uri

    text = os.fspath(out)
    return text if is_output_uri(text) else Path(text).resolve()


def output_dataset(out: str | Path):
    """A job's output as a `pyarrow.dataset.Dataset`: its `part-*.parquet` files under the
    job's schema (`_common_metadata`; after a job every part has it). In an object store
    (`s3://`, `gs://`) the files its manifest names (committed ones only, even mid-job),
    read with this process's credentials (the AWS chain and `AWS_ENDPOINT_URL`, GCS's
    application-default credentials)."""
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    from prefixflow.shared.outputs import committed_files, filesystem, is_output_uri

    if is_output_uri(os.fspath(out)):
        fs, base = filesystem(os.fspath(out))
        files = committed_files(os.fspath(out))
        try:
            schema = pq.read_schema(f"{base}/_common_metadata", filesystem=fs)
        except FileNotFoundError:
            schema = None
        if not files and schema is None:
            raise FileNotFoundError(f"{out}: no output here (no {base}/_manifest.json naming a part)")
        return ds.dataset(files, schema=schema, format="parquet", filesystem=fs)
    out = Path(out)
    files = sorted(str(p) for p in out.glob("part-*.parquet"))
    record = out / "_common_metadata"
    schema = pq.read_schema(record) if record.exists() else None
    if not files and schema is None:
        raise FileNotFoundError(f"{out}: no output (part-*.parquet) here: the sink writes on its own machine")
    return ds.dataset(files, schema=schema, format="parquet")


@dataclass
class Result:
    """A finished job: how many rows it wrote (`errors` of them error rows), its summary
    (`_summary.json`), and its output (`to_arrow`, `dataset`) in `out`."""

    job: str
    out: str | Path
    """The output: a local directory (absolute) or an object store URI."""
    rows: int
    errors: int
    summary: dict[str, Any] | None
    already_done: bool = False
    """The output held this job's finished output: nothing was run."""

    def dataset(self):
        """The output as a `pyarrow.dataset.Dataset` (read lazily, in bounded memory)."""
        return output_dataset(self.out)

    def to_arrow(self):
        """The output as one `pyarrow.Table` (in memory: for a large job use `dataset`)."""
        return self.dataset().to_table()


def result_of(status: Any, out: str | Path, already_done: bool = False) -> Result:
    """A `Result` from a job's final `JobStatus`."""
    return Result(status.job, output_location(out), status.rows, status.errors, status.summary, already_done)


def prepare(source: Any, options: dict[str, Any]):
    """The `Source` of `source` (a path or URI, or an in-memory input) and its name:
    `InputError` before anything is created when it cannot be read."""
    from prefixflow.client.memory import memory_source
    from prefixflow.client.sources import resolve
    from prefixflow.client.submit import count_rows

    if not (isinstance(source, str) or hasattr(source, "__fspath__")):
        return memory_source(source)  # `InputError` for what is no input at all
    src = resolve(os.fspath(source), options)
    count_rows(src)  # a Parquet file with no input column fails now
    return src


def given_name(source: Any) -> str:
    """The `source` argument as the job options' INPUT (a placeholder for in-memory data)."""
    if isinstance(source, (str, Path)) or hasattr(source, "__fspath__"):
        return os.fspath(source)
    return f"<{type(source).__name__}>"


class Job:
    """A submitted job: its id (`id`), its output directory (`out`), and its run in the
    client (publishing the rows, then following the sink until every row is written)."""

    def __init__(self, client: Client, job: str, out: str | Path, future: concurrent.futures.Future) -> None:
        self.client, self.id, self.out, self.future = client, job, output_location(out), future

    def __repr__(self) -> str:
        return f"<prefixflow.Job {self.id} out={str(self.out)!r}{' done' if self.future.done() else ''}>"

    def done(self) -> bool:
        """Whether the job has ended here (written, failed, cancelled or paused: `wait` says)."""
        return self.future.done()

    def wait(self, timeout: float | None = None) -> Result:
        """The job's `Result` once every row is written. Raises `JobFailed`,
        `JobCancelled` (cancelled or expired), `JobPaused` (its output lacks a resource; it
        resumes in the cluster, submit again to follow it) or `ClusterError`;
        `TimeoutError` after `timeout` seconds (the job goes on)."""
        try:
            return self.future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"job {self.id} not done after {timeout} s (it goes on; wait again)") from None

    async def wait_async(self, timeout: float | None = None) -> Result:
        """`wait`, awaited."""
        try:
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self.future)), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"job {self.id} not done after {timeout} s (it goes on; wait again)") from None

    def status(self):
        """The job as `prefixflow status` shows it (`prefixflow.client.status.JobView`:
        `state`, `rows`, `total`, `errors`, `rate`, `eta`, ...)."""
        return self.client.portal.call(self.client._status(self.id))

    async def status_async(self):
        return await self.client.portal.call_async(self.client._status(self.id))

    def cancel(self, wait: bool = True, timeout: float = CANCEL_TIMEOUT):
        """Cancel the job (as `prefixflow cancel`): the cluster stops feeding it, the rows
        written stay. `wait`: until it settles (then `wait()` raises `JobCancelled`). Its
        `JobView` after."""
        return self.client.portal.call(self.client._cancel(self.id, wait, timeout))

    async def cancel_async(self, wait: bool = True, timeout: float = CANCEL_TIMEOUT):
        return await self.client.portal.call_async(self.client._cancel(self.id, wait, timeout))

    def dataset(self):
        """The output written so far as a `pyarrow.dataset.Dataset`."""
        return output_dataset(self.out)

    def to_arrow(self):
        """The job's output as a `pyarrow.Table`, once it is done (`wait` first)."""
        return self.wait().to_arrow()


class Client:
    """A connection to a running prefixflow cluster (`prefixflow submit`'s, from Python).

    `nats_url`: the cluster's NATS (default `PFX_NATS_URL`, else nats://127.0.0.1:4222);
    credentials and TLS as the command line takes them (`PFX_NATS_*` environment);
    `tenant`: a tenant's jobs are `TENANT.JOB` (default `PFX_TENANT`). Use it as a context
    manager, or `close()` it: that stops following its jobs (they go on in the cluster)."""

    def __init__(self, nats_url: str | None = None, *, tenant: str | None = None,
                 connect_timeout: float = CONNECT_TIMEOUT) -> None:
        self.nats_url = nats_url or os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222")
        self.tenant = os.environ.get("PFX_TENANT", "") if tenant is None else tenant
        self.connect_timeout = connect_timeout
        self.portal = Portal()
        self.nc = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop following this client's jobs and close its connection (idempotent)."""
        if self.nc is not None and self.portal.thread.is_alive():
            from prefixflow.shared.bus.connection import close

            try:
                self.portal.call(close(self.nc), timeout=5)
            except (TimeoutError, OSError):
                pass
            self.nc = None
        self.portal.close()

    # -- on the portal's loop ----------------------------------------------------------------

    async def _connection(self):
        from prefixflow.shared.bus.connection import NatsRefused, connect

        if self.nc is None:
            try:
                self.nc = await connect(self.nats_url, "prefixflow-api", wait=self.connect_timeout)
            except (TimeoutError, NatsRefused, OSError) as exc:
                raise ClusterError(f"cannot reach NATS at {self.nats_url}: {exc or type(exc).__name__}") from None
        return self.nc

    async def _status(self, job: str):
        from prefixflow.client.status import JobView, read_jobs
        from prefixflow.shared.outcomes import JobState

        views = await read_jobs(await self._connection(), job)
        return views[0] if views else JobView(job, JobState.QUEUED)

    async def _cancel(self, job: str, wait: bool, timeout: float):
        from prefixflow.client.lifecycle import canceller, wait_cancelled
        from prefixflow.shared.bus.jobs import UnknownJob, cancel_job
        from prefixflow.shared.bus.kv_keys import bound
        from prefixflow.shared.wire import subjects

        nc = await self._connection()
        js = nc.jetstream()
        try:
            await cancel_job(js, nc, job, by=canceller())
        except UnknownJob:
            raise OptionError(f"no job {job!r} in the cluster (never submitted, or expired)") from None
        if wait:
            await wait_cancelled(bound(js, subjects.JOB_STATUS_KV), job, timeout)
        return await self._status(job)

    async def _follow(self, src: Any, out: str, job: str, opts, created: concurrent.futures.Future) -> Result:
        """`prefixflow submit`'s run of the job; `created` gets the job's id once it exists."""
        from prefixflow.client.submit import AlreadyDone, submit
        from prefixflow.shared.bus.connection import NatsRefused

        args = opts.args

        def on_created(name: str) -> None:
            if not created.done():
                created.set_result(name)

        try:
            status = await submit(
                src, nats_url=self.nats_url, job=job, out_dir=out, sampling=opts.sampling,
                progress=not args.no_progress, timeout=args.timeout, overwrite=args.overwrite,
                max_in_flight=args.max_in_flight, expires_in=args.expires_in, priority=args.priority,
                adopt=args.job is None, row_timeout=args.row_timeout, dedupe=not args.no_dedupe,
                on_created=on_created, **opts.chat,
            )
        except AlreadyDone as done:
            return result_of(done.status, out, already_done=True)
        except NatsRefused as exc:
            raise ClusterError(f"NATS at {self.nats_url} refused us: {exc}") from None
        return result_of(status, out)

    # -- the API -----------------------------------------------------------------------------

    def submit(self, source: Any, *, out: str | Path, **job: Any) -> Job:
        """Submit `source` as a job writing to `out`; returns its `Job` once the cluster
        has it (the rows are sent in the background).

        `source`: a file, a directory, a glob or a URI (as `prefixflow submit` takes), a
        `pyarrow.Table`, a pandas or Polars DataFrame, or an iterable of
        `pyarrow.RecordBatch` (read in batches; an iterator is spooled to a temporary
        file). `**job`: `prefixflow submit`'s options as keywords (`max_tokens=32`,
        `temperature=0.0`, `job="my-job"`, `overwrite=True`, `row_timeout=60`, ...;
        `prefixflow/api/options.py`). Raises `InputError`, `OptionError`,
        `OutputConflict` (`out` or the job id bound to another job or input),
        `JobFailed` (the job failed earlier), `ClusterError` at once; the same data and
        options into the same `out` again: a `Job` already done."""
        opts = job_options("submit", given_name(source), str(out), job)
        src = prepare(source, opts.storage_options)
        self.portal.call(self._connection())  # NATS unreachable: ClusterError now
        created, job_handle = self._launch(src, str(out), opts)
        concurrent.futures.wait([created])
        return self._started(job_handle, created)

    async def submit_async(self, source: Any, *, out: str | Path, **job: Any) -> Job:
        """`submit`, awaited (reading and hashing the input on a worker thread)."""
        opts = job_options("submit", given_name(source), str(out), job)
        src = await asyncio.to_thread(prepare, source, opts.storage_options)
        await self.portal.call_async(self._connection())
        created, job_handle = self._launch(src, str(out), opts)
        await asyncio.wrap_future(created)
        return self._started(job_handle, created)

    def _launch(self, src: Any, out: str, opts) -> tuple[concurrent.futures.Future, Job]:
        from prefixflow.cli.options import default_job_id
        from prefixflow.shared.wire import subjects

        name = opts.args.job
        if name is not None:
            name = subjects.qualify(name, self.tenant)
            if (why := subjects.job_id_error(name)) is not None:
                raise OptionError(why)
        else:  # NOTE: the command's id (name and second) plus a random tail: a notebook submits often
            name = subjects.qualify(f"{default_job_id(src.given)}-{secrets.token_hex(3)}", self.tenant)
        created: concurrent.futures.Future = concurrent.futures.Future()
        future = self.portal.start(self._follow(src, out, name, opts, created))

        def ended(f: concurrent.futures.Future) -> None:  # before it was created: an error, or already done
            if not created.done():
                created.set_result(None)

        future.add_done_callback(ended)
        return created, Job(self, name, out, future)

    @staticmethod
    def _started(job: Job, created: concurrent.futures.Future) -> Job:
        """The `Job` once created (its id: the one it runs under), or the error that ended it first."""
        if created.result() is None and job.future.exception() is not None:
            raise job.future.exception()
        if created.result() is not None:
            job.id = created.result()
        elif job.future.done():  # already done: the id of the job that has the output
            job.id = job.future.result().job
        return job
