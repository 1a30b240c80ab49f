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

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from tqdm import tqdm

from prefixflow.client import columns, readers
from prefixflow.client.fingerprint import of_job
from prefixflow.client.sources import InputError, Source, resolve
from prefixflow.shared.outputs import canonical, is_output_uri
from prefixflow.client.progress import FleetProgress, engines_note, progress_note
from prefixflow.shared.bus.jobs import follow_cancel, seal
from prefixflow.shared.eta import output_budget
from prefixflow.client.window import IN_FLIGHT_ROWS, Window
from prefixflow.shared.bus.blobs import put_blob
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.fingerprint import Fingerprint, difference
from prefixflow.shared.wire.ids import IdSet
from prefixflow.shared.wire.limits import ROW_TIMEOUT
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.outcomes import CommandError, Exit, PrefixflowError, usage_error
from prefixflow.shared.bus.publish import message_limit, publish

READ_BATCH = 4096
PUBLISH_CONCURRENCY = 256
ROWS_PER_MESSAGE = 64
DONE_QUERY_TIMEOUT = 5.0
"""Seconds a done query waits for the sink's answer (then the chunk's rows are sent)."""
DONE_QUERY_FAILURES = 2
"""Consecutive unanswered done queries after which a resume stops asking (a sink that
does not answer them): every remaining row is sent, and the sink drops duplicates."""
EMPTY_JOB_WAIT = 60.0
"""Seconds to wait for the sink to complete a job of no rows before giving up."""


class JobFailed(PrefixflowError):
    """The cluster marked the job failed (its status says why)."""

    def __init__(self, job: str, reason: str | None) -> None:
        super().__init__(f"job {job} failed: {reason or 'no reason given'}")
        self.job = job
        self.reason = reason


class JobCancelled(JobFailed):
    """The job was cancelled (`prefixflow cancel`) or expired: the rows written stay."""

    def __init__(self, job: str, status: m.JobStatus | None = None, note: str = "") -> None:
        rows = f": {status.rows} rows written ({status.errors} errors), they stay" if status is not None else ""
        how = "expired" if status is not None and (status.summary or {}).get("expired") else "cancelled"
        Exception.__init__(self, f"job {job} {how}{rows}{note}")
        self.job, self.reason, self.status = job, "cancelled", status


PAUSED_GRACE = 5.0
"""Seconds a job stays paused before the client gives up waiting (`JobPaused`): a pause
the sink resolves at its next probe does not end the command."""


class JobPaused(PrefixflowError):
    """The job is paused: its output lacks a resource (disk full, quota, read-only file
    system, no permission). Not failed: its results wait in the cluster and it resumes by
    itself once the sink can write; the same command then completes it. Exit code 75
    (`Exit.PAUSED`)."""

    code = Exit.PAUSED

    def __init__(self, job: str, status: m.JobStatus) -> None:
        super().__init__(f"job {job} paused: {status.paused} ({status.rows} rows written)")
        self.job, self.status = job, status
        self.path = status.paused_path or "its output directory"


class PauseWatch:
    """Raises `JobPaused` once a job has been paused for `PAUSED_GRACE` seconds."""

    def __init__(self, grace: float = PAUSED_GRACE) -> None:
        self.grace = grace
        self.since: float | None = None

    def observe(self, job: str, st: m.JobStatus | None, now: float) -> None:
        if st is None or not st.paused or st.done or st.failed:
            self.since = None
            return
        self.since = now if self.since is None else self.since
        if now - self.since >= self.grace:
            raise JobPaused(job, st)


class OutputConflict(PrefixflowError):
    """The output directory (or the job id) belongs to another job, or to one asked another
    input or spec: refused before anything ran (exit code 2)."""

    code = Exit.USAGE


class DirTaken(OutputConflict):
    """The output directory is bound to another job (`prefixflow` exits with code 2)."""

    def __init__(self, out_dir: str, owner: str, job: str) -> None:
        super().__init__(
            f"{out_dir} holds the output of job {owner}: pass --job {owner} to resume that job, "
            f"--overwrite to replace its output with job {job}'s, or another --out"
        )
        self.out_dir, self.owner, self.job = out_dir, owner, job


class JobMismatch(OutputConflict):
    """The job id, or the job bound to the output directory, was asked another input or
    spec than this one (`prefixflow` exits with code 2); the message names the difference."""


def mismatch_text(out_dir: str, owner: str, diff: str) -> str:
    """The refusal of another job into `owner`'s directory (`run` and `submit` say the same)."""
    return (f"{out_dir} holds the output of job {owner}, which was asked something else ({diff}): pass --overwrite "
            "to replace that output with this job's, or another --out")


class AlreadyDone(Exception):
    """The job is done already (every row written, `status.summary` its summary): nothing
    was published."""

    def __init__(self, status: m.JobStatus) -> None:
        super().__init__(f"job {status.job} is already done: {status.rows} rows ({status.errors} errors)")
        self.status = status


done_reply_decoder = msgspec.msgpack.Decoder(m.DoneReply)


class DoneQueries:
    """Resume: which rows of a chunk the sink has written already (`DoneQuery` on
    `subjects.done_query(job)`). A query not answered (timeout, no sink listening, an
    error reply) sends the chunk's rows as they are (the sink drops duplicates); after
    `DONE_QUERY_FAILURES` in a row it stops asking. No sink listening yet (a cluster just
    started: the sink subscribes after it is up) is asked again for `wait_for_sink` seconds
    first, so a job resumed at once does not recompute its finished rows."""

    def __init__(self, nc, job: str, *, timeout: float = DONE_QUERY_TIMEOUT,
                 wait_for_sink: float = DONE_QUERY_TIMEOUT) -> None:
        self.nc, self.job, self.timeout = nc, job, timeout
        self.wait_for_sink = wait_for_sink
        self.failures = 0
        self.problem: str | None = None
        """Why the last query went unanswered."""
        self.none_done = False
        """The sink said no row of the job was on disk: later chunks need no query."""

    async def missing(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.failures >= DONE_QUERY_FAILURES or self.none_done or not rows:
            return rows
        try:
            done = await self._ask_when_listened([r["id"] for r in rows])
        except (nats.errors.Error, asyncio.TimeoutError, msgspec.DecodeError, ValueError) as exc:
            self.failures += 1
            self.problem = str(exc) or type(exc).__name__
            return rows
        self.failures = 0
        return [r for r, d in zip(rows, done) if not d]

    async def _ask_when_listened(self, ids: list[Any]) -> list[bool]:
        """`_ask`, again while no sink listens, for `wait_for_sink` seconds (the first time)."""
        deadline = time.monotonic() + self.wait_for_sink
        while True:
            try:
                return await self._ask(ids)
            except nats.errors.NoRespondersError:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
            finally:
                self.wait_for_sink = 0.0  # only a cluster that just started is waited for

    async def _ask(self, ids: list[Any]) -> list[bool]:
        data = m.encode(m.DoneQuery(ids))
        if len(data) > message_limit(self.nc) and len(ids) > 1:  # long string ids: ask in halves
            half = len(ids) // 2
            return await self._ask(ids[:half]) + await self._ask(ids[half:])
        reply = done_reply_decoder.decode((await self.nc.request(subjects.done_query(self.job), data, timeout=self.timeout)).data)
        if reply.error is not None:
            raise ValueError(f"the sink cannot tell: {reply.error}")
        if len(reply.done) != len(ids):
            raise ValueError(f"the sink answered {len(reply.done)} of {len(ids)} ids")
        self.none_done = reply.on_disk == 0
        return reply.done


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


class Submitter:
    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url

    async def __aenter__(self) -> Submitter:
        self.nc = await connect(self.nats_url, "prefixflow-client")
        self.js = self.nc.jetstream()
        await provision(self.js)
        self.jobs_kv = await self.js.key_value(subjects.JOBS_KV)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        self.cancelled: set[str] = set()
        """Jobs of this client (`follow_cancel`) whose spec says cancelled after a notice."""
        return self

    async def follow_cancel(self, job: str) -> None:
        """Stop publishing `job` once it is cancelled: its own notices, each confirmed by
        its spec (`prefixflow.shared.bus.jobs.follow_cancel`: no other job's, no spoof)."""
        await follow_cancel(self.nc, self.jobs_kv, job, lambda spec: self.cancelled.add(spec.job))

    async def __aexit__(self, *exc: object) -> None:
        await close(self.nc)

    async def create(self, spec: m.JobSpec) -> None:
        await self.jobs_kv.put(spec.job, m.encode_json(spec))

    async def put_columns(self, job: str, chunk: columns.Chunk) -> None:
        """Store a chunk's input columns (before its rows are published: the sink reads them)."""
        if chunk.kept:
            await put_blob(self.js, self.nc, job, columns.blob_key(chunk.src), chunk.kept)

    async def publish_rows(self, job: str, rows: list[dict[str, Any]], *, batch: int = ROWS_PER_MESSAGE) -> list:
        """Publish rows as msgpack arrays of up to `batch` rows, cut by their encoded size
        under the server's limit (`message_limit`); `batch=1` sends one map per row with
        its id in the `Pfx-Id` header."""
        subject = subjects.ingest(job)
        ids = [row["id"] for row in rows]
        coros = []
        if batch == 1:
            for row in rows:
                rid = msgspec.json.encode(row["id"]).decode()
                coros.append(publish(self.js, subject, m.msgpack_encoder.encode(row), headers={"Pfx-Id": rid, "Nats-Msg-Id": f"{job}:{rid}"}))
        else:
            # NOTE: a single row over the limit goes alone and the server refuses it
            # (`MessageTooLarge`): a prompt that large cannot be a model input anyway.
            for b in m.encode_batches(rows, list, message_limit(self.js), batch):
                msg_id = f"{job}:{rows[b.start]['id']}:{rows[b.stop - 1]['id']}:{b.stop - b.start}"
                coros.append(publish(self.js, subject, b.data, headers={"Nats-Msg-Id": msg_id}))
        for i in range(0, len(coros), PUBLISH_CONCURRENCY):
            await asyncio.gather(*coros[i : i + PUBLISH_CONCURRENCY])
        return ids

    async def spec(self, job: str) -> m.JobSpec | None:
        """The job's spec in the jobs bucket (None: never created, or expired)."""
        try:
            entry = await self.jobs_kv.get(job)
        except KeyNotFoundError:
            return None
        try:
            return m.job_spec_decoder.decode(entry.value)
        except msgspec.DecodeError:
            return None

    async def claim_dir(self, out_dir: str, job: str, *, overwrite: bool = False) -> str | None:
        """Bind `out_dir` to `job` in the jobs bucket (`subjects.dir_key`). Bound to
        another job: `DirTaken`, or with `overwrite` rebound (returns the other job)."""
        key = subjects.dir_key(out_dir, subjects.tenant_of(job))
        try:
            await self.jobs_kv.create(key, job.encode())
            return None
        except KeyWrongLastSequenceError:
            pass  # bound already: to whom?
        try:
            owner = (await self.jobs_kv.get(key)).value.decode()
        except KeyNotFoundError:  # expired or deleted meanwhile
            owner = job
        if owner != job:
            if not overwrite:
                raise DirTaken(out_dir, owner, job)
        await self.jobs_kv.put(key, job.encode())
        return owner if owner != job else None

    async def dir_job(self, out_dir: str, job: str, asked: Fingerprint, overwrite: bool) -> str:
        """The job to run into `out_dir` when no job id was given (`job` is a new one): the
        job bound to it if it was asked the same (`asked`), else `job`. One asked something
        else: `JobMismatch`, unless `overwrite`. A bound job whose fingerprint is unknown
        (from before fingerprints, or gone from the bucket): `job` (`claim_dir` decides)."""
        try:
            owner = (await self.jobs_kv.get(subjects.dir_key(out_dir, subjects.tenant_of(job)))).value.decode()
        except KeyNotFoundError:
            return job
        earlier = await self.spec(owner) if owner != job else None
        if earlier is None or earlier.fingerprint is None:
            return job
        if (diff := difference(earlier.fingerprint, asked)) is None:
            return owner
        if overwrite:
            return job
        raise JobMismatch(mismatch_text(out_dir, owner, diff))

    async def status(self, job: str) -> m.JobStatus | None:
        try:
            entry = await self.status_kv.get(job)
        except KeyNotFoundError:
            return None
        return m.job_status_decoder.decode(entry.value)

    def ended(self, spec: m.JobSpec) -> bool:
        """The job was cancelled (a notice came and its spec confirmed it) or its deadline
        passed: publish no more."""
        return spec.job in self.cancelled or bool(spec.ended_at(time.time()))

    async def make_room(self, spec: m.JobSpec, window: Window, rows: int, check: Callable[[], None] | None = None) -> bool:
        """True once `rows` more may be published for the job (`prefixflow/client/window.py`),
        following the sink's count in the job's status meanwhile; False if the job ended
        (`ended`) meanwhile. Raises `JobFailed` when the status says the job failed;
        `check()` runs each round."""
        job = spec.job
        paused = PauseWatch()
        while not window.may_send(rows, time.monotonic()):
            if self.ended(spec):
                return False
            try:
                st = await self.status(job)
            except (nats.errors.Error, TimeoutError, OSError):
                st = None  # nats-server away: no news (the window's stall clock runs)
            else:
                if st is not None and st.failed:
                    raise JobFailed(job, st.error)
                paused.observe(job, st, time.monotonic())
                window.observe(st.rows + st.duplicates if st is not None else 0, time.monotonic())
            if window.may_send(rows, time.monotonic()):
                break
            if check is not None:
                check()
            await asyncio.sleep(0.25)
        return not self.ended(spec)

    async def wait(
        self, job: str, total: int, *, progress: bool = True, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> m.JobStatus:
        """Follow the sink's progress until `total` rows are written; raise `JobFailed`
        as soon as the status says the job failed (and `TimeoutError` when a job of no
        rows is not completed within `EMPTY_JOB_WAIT`). `check()` runs each round (raise there
        to stop waiting). `JobPaused` once the job has been paused for `PAUSED_GRACE`
        seconds. A NATS outage (nats-server restarting) is waited out."""
        # Rate and ETA are the sink's (rows per second over its last 30 s), as in `prefixflow status`;
        # prompts under way and tokens/s come from the replicas' status messages (prefixflow/client/progress.py).
        bar = tqdm(total=total, desc=f"job {job}", unit="row", disable=not progress, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        fleet = self.fleet = FleetProgress()
        self.first_progress: float | None = None
        """When the line first showed work under way (`prefixflow bench batching` reads it)."""

        async def on_status(msg) -> None:
            try:
                fleet.update(m.engine_status_decoder.decode(msg.data), time.monotonic())
            except msgspec.DecodeError:
                return

        # A tenant may not read the replicas' status (it names every tenant's jobs): its
        # progress line shows rows only.
        status_sub = None if subjects.tenant_of(job) else await self.nc.subscribe(subjects.ALL_STATUS, cb=on_status)
        st = None
        paused = PauseWatch()
        try:
            while True:
                try:
                    st = await self.status(job)
                except (nats.errors.Error, TimeoutError, OSError):
                    # NOTE: nats-server away or restarting (the client reconnects by
                    # itself); the timeout below still applies.
                    pass
                if st is not None and st.failed:
                    raise JobFailed(job, st.error)
                if st is not None and st.done and st.cancelled:
                    raise JobCancelled(job, st)
                paused.observe(job, st, time.monotonic())
                if self.first_progress is None and ((st is not None and st.rows) or fleet.held(job)):
                    self.first_progress = time.time()
                if st is not None:
                    bar.n = min(st.rows, total)
                bar.set_postfix_str(progress_note(st, fleet, job), refresh=False)
                bar.refresh()
                if st is not None and st.done and st.total == total:
                    return st
                if check is not None:
                    check()
                if total == 0 and time.monotonic() - started > EMPTY_JOB_WAIT:
                    raise TimeoutError(f"job {job} has no rows and the cluster did not complete it within "
                                       f"{EMPTY_JOB_WAIT:.0f} s (status: {st})")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job} not done after {timeout} s (status: {st})")
                await asyncio.sleep(0.5)
        finally:
            bar.close()
            try:
                if status_sub is not None:
                    await status_sub.unsubscribe()
            except nats.errors.Error:
                pass


def read_chunks(job: str, source: Source) -> Iterator[columns.Chunk]:
    """The input's chunks; a file of it found bad while it is read (the job was created,
    rows may be out): `JobFailed` naming the file and the reason (exit code 1, not the 2
    of an input refused before anything was created)."""
    try:
        yield from columns.chunks(source)
    except InputError as exc:
        raise JobFailed(job, f"its input: {exc}") from None



def ending(exc: Exception, *, cluster_stays: bool) -> CommandError:
    """The message and exit code (a `CommandError`) `submit` and `run` end with for one of `ENDINGS`
    (docs/outcomes.md); `cluster_stays`: the job's cluster runs on after the command (`submit`),
    not `run`'s own."""
    if isinstance(exc, JobPaused):
        then = (f"the job waits on the cluster and resumes by itself once {exc.path} takes writes again; "
                "run the same command again to follow it to the end" if cluster_stays
                else f"once {exc.path} takes writes again, run the same command to resume it")
        return CommandError(f"{exc}\n{then}", Exit.PAUSED)
    if isinstance(exc, OutputConflict):  # OUT (or the id) bound to another job, input or spec
        return CommandError(str(exc), Exit.USAGE)
    return CommandError(str(exc), Exit.FAILED)  # JobFailed: failed, cancelled or expired


ENDINGS = (JobFailed, JobPaused, OutputConflict)
"""`submit`'s exceptions that end a command with a documented code (`ending`)."""


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
    async with Submitter(nats_url) as client:
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
            planned += output_budget(chunk.rows, spec.sampling.max_tokens)
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
