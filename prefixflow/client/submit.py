"""Submitting a job and following it: what `prefixflow submit` and `prefixflow run` do.

1. Create the job spec in the jobs KV bucket (validated sampling parameters).
2. Stream the input (a file, a directory, a glob or a URI of Parquet, JSONL or CSV files
   with a `prompt` column: `prefixflow/client/sources.py`) in chunks
   (`prefixflow/client/columns.py`), never further ahead of the sink than the in-flight window
   (`prefixflow/client/window.py`): each chunk's input columns are stored once in the blob store,
   and its model inputs go to `pfx.ingest.<job>` as msgpack arrays of rows, each with a
   `Nats-Msg-Id` so a re-publish inside the stream's duplicate window is dropped by the
   server.
3. Seal the job (set `total`) and follow the sink's progress until it is done.

Re-runs: the output directory is claimed for the job in the jobs bucket
(`subjects.dir_key`): another job's directory is refused (`DirTaken`) unless the job
overwrites it (`JobSpec.overwrite`); a job already done is not run again (`AlreadyDone`);
every job asks the sink which ids of each input chunk are on disk (`DoneQuery`) and
publishes only the others, so a resume sends only what is missing, from any machine and
whatever the cluster remembers; the first answer that says nothing of the job is on disk
ends the queries (a new job costs one round trip).

A job is what it was asked to do: its spec carries the fingerprint of its input and of
its spec (`prefixflow/client/fingerprint.py`, `prefixflow/shared/wire/fingerprint.py`). A
job id the cluster knows with another fingerprint is refused (`JobMismatch`, exit code 2:
a job id names one job, even with `overwrite`); with no job id given (`adopt`), the job
bound to the output directory is the one run when it was asked the same (resumed, or
already done), and one asked something else is refused (`JobMismatch`) unless
`overwrite` (then this new job replaces its output).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from prefixflow.client import columns, readers
from prefixflow.client.fingerprint import of_job
from prefixflow.client.sources import InputError, Source, resolve
from prefixflow.shared.outputs import canonical, is_output_uri
from prefixflow.client.progress import engines_note
from prefixflow.shared.bus.jobs import seal
from prefixflow.shared.eta import output_budget
from prefixflow.client.window import IN_FLIGHT_ROWS, Window
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.fingerprint import difference
from prefixflow.shared.wire.ids import IdSet
from prefixflow.shared.wire.limits import ROW_TIMEOUT
from prefixflow.shared.outcomes import usage_error

from prefixflow.client.done_queries import DONE_QUERY_FAILURES, DONE_QUERY_TIMEOUT, DoneQueries  # noqa: F401
from prefixflow.client.endings import (  # noqa: F401 - where callers have always found them
    ENDINGS, PAUSED_GRACE, AlreadyDone, DirTaken, JobCancelled, JobFailed, JobMismatch, JobPaused, OutputConflict,
    PauseWatch,
    ending, mismatch_text,
)
from prefixflow.client.submitter import EMPTY_JOB_WAIT, PUBLISH_CONCURRENCY, ROWS_PER_MESSAGE, Submitter  # noqa: F401

READ_BATCH = 4096


def count_rows(source: str | Path | Source, options: dict[str, Any] | None = None) -> int | None:
    """The input's row count when its files say it cheaply (every one Parquet: their
    footers), else None. Checks the Parquet files' schemas on the way (`InputError`: one
    with no model input column, or an `id` column in some files only), so such an input
    fails before a job is created."""
    source = source if isinstance(source, Source) else resolve(source, options)
    if len(source.shards) == 1 and source.shards[0].format == "arrow":  # in memory: counted while hashed
        return source.shards[0].rows
    parquet = [s for s in source.shards if s.format == "parquet"]
    total, has_id = 0, {}
    for shard in parquet:
        rows, schema = readers.parquet_rows(shard)
        total += rows
        if not set(columns.INPUT_COLUMNS) & set(schema.names):
            raise InputError(f"{shard.path}: no 'prompt', 'messages' or 'prompt_token_ids' column "
                             f"(columns: {schema.names})")
        has_id.setdefault("id" in schema.names, shard.name)
    if len(has_id) > 1:
        raise InputError(f"{source.given}: {has_id[True]} has an 'id' column and {has_id[False]} has none: every "
                         "file of an input has one, or none (then a row's id is its number across the files)")
    return total if len(parquet) == len(source.shards) else None


def read_chunks(job: str, source: Source) -> Iterator[columns.Chunk]:
    """The input's chunks; a file of it found bad while it is read (the job was created,
    rows may be out): `JobFailed` naming the file and the reason (exit code 1, not the 2
    of an input refused before anything was created)."""
    try:
        yield from columns.chunks(source)
    except InputError as exc:
        raise JobFailed(job, f"its input: {exc}") from None


async def submit(
    input_path: str | Path,
    *,
    nats_url: str,
    job: str,
    out_dir: str | Path,
    sampling: m.SamplingSpec,
    model: str = "",
    progress: bool = True,
    timeout: float | None = None,
    check: Callable[[], None] | None = None,
    chat_template: str = "",
    chat_template_kwargs: dict[str, Any] | None = None,
    task: str = "generate",
    overwrite: bool = False,
    resume: bool = False,
    max_in_flight: int = IN_FLIGHT_ROWS,
    expires_in: float | None = None,
    deliver: str = "",
    resolve_out: bool = True,
    priority: int = 1,
    adopt: bool = False,
    row_timeout: float = ROW_TIMEOUT,
    dedupe: bool = True,
    storage_options: dict[str, Any] | None = None,
    on_created: Callable[[str], None] | None = None,
) -> m.JobStatus:
    """Submit `input_path` as `job` and wait until the sink has every row.

    `input_path`: a file, a directory, a glob or a URI (`prefixflow/client/sources.py`;
    `storage_options`: its file system's arguments, kept on this machine); `InputError`
    when it cannot be read, before anything is created.

    Raises `DirTaken` when `out_dir` belongs to another job (unless `overwrite`: the sink
    then replaces that job's output), `AlreadyDone` when the job has every row already,
    `JobFailed` when the cluster marks it failed, `JobPaused` when it stays paused (its
    output lacks a resource: disk full...). Only the rows the sink does not have are
    published; `resume` (or a job the cluster knows) prints how many were skipped.
    `JobMismatch` when `job` was asked another input or spec; `adopt` (no job id given:
    `job` is a new one): the job bound to `out_dir` is run instead if it was asked the same
    (see the module docstring). `dedupe` False: every row generated on its own
    (`JobSpec.dedupe`). `on_created(job)` is called once the job's spec is in the cluster
    (`job`: the id it runs under, an adopted one included), before its rows are sent."""
    if (why := subjects.job_id_error(job)) is not None:
        raise usage_error(why)
    # `resolve_out=False`: a path relative to the sink's output root, as it is (the batch service's)
    # An s3:// or gs:// out is written by the sink with its own credentials: only its URI
    # goes into the spec (`prefixflow/shared/outputs.py`).
    if is_output_uri(str(out_dir)):
        out_dir = canonical(str(out_dir))
    else:
        out_dir = str(Path(out_dir).resolve()) if resolve_out else str(out_dir)
    from prefixflow.client import openai_batch

    now = time.time()
    spec = m.JobSpec(job=job, out_dir=out_dir, sampling=sampling, model=model, created_at=now,
                     chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {}, task=task,
                     overwrite=overwrite, expires_at=now + expires_in if expires_in else 0.0, deliver=deliver,
                     priority=priority, row_timeout=row_timeout, dedupe=dedupe)
    source = input_path if isinstance(input_path, Source) else resolve(input_path, storage_options)
    spec.fingerprint = asked = of_job(source, spec)  # of the input as given (a batch file, not its rows)
    batch = None
    if source.single and openai_batch.is_batch_file(source.shards[0]):  # OpenAI Batch requests -> rows (prefixflow/client/openai_batch.py)
        import tempfile

        batch = openai_batch.read_batch(source.shards[0], task)
        source = resolve(openai_batch.write_rows(batch, Path(tempfile.mkdtemp(prefix="pfx-batch-")) / "rows.jsonl"))
    expected = count_rows(source)
    async with Submitter(nats_url, tenant=subjects.tenant_of(job)) as client:
        if adopt and (owner := await client.dir_job(out_dir, job, asked, overwrite)) != job:
            job = spec.job = owner  # OUT's job, asked the same: resumed, or reported done
        # A job the cluster already marked failed would only fail again: say so now,
        # before publishing anything.
        before = await client.status(job)
        if before is not None and before.failed:
            raise JobFailed(job, f"{before.error} (earlier run; submit under a new --job id)")
        await client.follow_cancel(job)  # before the spec is read: a cancel in between is not missed
        earlier = await client.spec(job)
        if earlier is not None and (diff := difference(earlier.fingerprint, asked)) is not None:
            raise JobMismatch(f"job {job} was submitted with another input or spec ({diff}): a job id names one "
                              f"job; submit under another --job (with --overwrite to replace its output in {out_dir})")
        replaced = await client.claim_dir(out_dir, job, overwrite=overwrite)
        if replaced is not None:
            print(f"{out_dir} held job {replaced}'s output: job {job} replaces it (--overwrite)", flush=True)
        if (before is not None and before.cancelled) or (earlier is not None and earlier.cancelled_at):
            raise JobCancelled(job, before, " (earlier; submit under a new --job id)")
        same_dir = earlier is None or earlier.out_dir == out_dir
        if (replaced is None and same_dir and before is not None and before.done and before.total is not None
                and (expected is None or before.total >= expected)):
            raise AlreadyDone(before)
        resume = resume or (before is not None and before.rows > 0) or earlier is not None
        if earlier is not None and earlier.fingerprint is None:
            print(f"job {job} was submitted before jobs recorded what they were asked (no fingerprint): "
                  "taken as the same job", flush=True)
        await client.create(spec)
        if on_created is not None:
            on_created(job)
        seen = IdSet()  # compact for integer ids: a 100M-row job's ids need ~12 MiB, not GBs
        # Resume: rows the sink has written already are not sent again (asked per chunk;
        # also for a job new to this cluster, whose directory may hold an earlier run's
        # rows: the first answer says whether anything is on disk at all).
        queries = DoneQueries(client.nc, job)
        window = Window(max(max_in_flight, 1))  # publish no further ahead of the sink than this
        window.observe(before.rows + before.duplicates if before is not None else 0, time.monotonic())
        bar = tqdm(total=expected, desc="publish", unit="row", disable=not progress, dynamic_ncols=True)
        skipped = planned = 0
        ended = False  # cancelled or past its deadline: stop publishing; `wait` reports it
        for chunk in read_chunks(job, source):
            if ended or client.ended(spec):
                ended = True
                break
            seen.update(chunk.ids)
            planned += output_budget(chunk.rows, spec.sampling.max_tokens, spec.sampling.n)
            todo = await queries.missing(chunk.rows)
            skipped += len(chunk.rows) - len(todo)
            if todo:
                await client.put_columns(job, chunk)
                step = max(ROWS_PER_MESSAGE, window.limit // 4)  # a small window: a chunk goes in slices
                for i in range(0, len(todo), step):
                    if not await client.make_room(spec, window, len(todo[i : i + step]), check):
                        ended = True
                        break
                    await client.publish_rows(job, todo[i : i + step])
                    window.sent += len(todo[i : i + step])
            bar.update(len(chunk.rows))
        bar.close()
        if resume or skipped:
            note = f" (the sink did not answer: {queries.problem}; it drops the duplicates)" if queries.problem else ""
            print(f"resuming job {job}: {skipped} rows already done, {len(seen) - skipped} sent{note}", flush=True)
        if not ended:
            await seal(client.js, spec, len(seen), planned)  # not if cancelled meanwhile: `wait` then says so
        # Ended: the sink completes the job as cancelled (or expired) once its rows land.
        status = await client.wait(job, len(seen), progress=progress, timeout=timeout, check=check)
        if note := engines_note(client.fleet):
            print(note, flush=True)
    if batch is not None:
        ok, errors = openai_batch.write_outputs(batch, out_dir, model)
        where = openai_batch.batch_dir(out_dir)
        print(f"OpenAI Batch: {ok} responses in {where}/output.jsonl, {errors} errors in {where}/errors.jsonl", flush=True)
    return status
