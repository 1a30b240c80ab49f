"""Submitting a job and following it: what `prefixflow submit` and `prefixflow run` do.

1. Create the job spec in the jobs KV bucket (validated sampling parameters).
2. Stream the input file (Parquet or JSONL with a `prompt` column) in chunks
   (`client/columns.py`): each chunk's input columns are stored once in the blob store,
   and its model inputs go to `pfx.ingest.<job>` as msgpack arrays of rows, each with a
   `Nats-Msg-Id` so a re-publish inside the stream's duplicate window is dropped by the
   server.
3. Seal the job (set `total`) and follow the sink's progress until it is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pyarrow.parquet as pq
from nats.js.errors import KeyNotFoundError
from tqdm import tqdm

from client import columns
from client.progress import FleetProgress, progress_note
from shared.bus.blobs import put_blob
from shared.wire import messages as m
from shared.wire import subjects
from shared.wire.ids import IdSet
from shared.bus.connection import close, connect
from shared.bus.provision import provision
from shared.bus.publish import publish

READ_BATCH = 4096
PUBLISH_CONCURRENCY = 256
ROWS_PER_MESSAGE = 64


class JobFailed(Exception):
    """The cluster marked the job failed (its status says why)."""

    def __init__(self, job: str, reason: str | None) -> None:
        super().__init__(f"job {job} failed: {reason or 'no reason given'}")
        self.job = job
        self.reason = reason


def finished_ids(out_dir: str | Path):
    """Ids already written to `out_dir` by an earlier run of the job (resume)."""
    done = IdSet()
    for part in sorted(Path(out_dir).glob("part-*.parquet")):
        done.update(pq.read_table(part, columns=["id"]).column("id").to_pylist())
    return done


def count_rows(path: str | Path) -> int | None:
    path = Path(path)
    if path.suffix in (".parquet", ".pq"):
        return pq.ParquetFile(path).metadata.num_rows
    return None


class Submitter:
    def __init__(self, nats_url: str) -> None:
        self.nats_url = nats_url

    async def __aenter__(self) -> Submitter:
        self.nc = await connect(self.nats_url, "prefixflow-client")
        self.js = self.nc.jetstream()
        await provision(self.js)
        self.jobs_kv = await self.js.key_value(subjects.JOBS_KV)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await close(self.nc)

    async def create(self, spec: m.JobSpec) -> None:
        await self.jobs_kv.put(spec.job, m.encode_json(spec))

    async def put_columns(self, job: str, chunk: columns.Chunk) -> None:
        """Store a chunk's input columns (before its rows are published: the sink reads them)."""
        if chunk.kept:
            await put_blob(self.js, self.nc, job, columns.blob_key(chunk.src), chunk.kept)

    async def publish_rows(self, job: str, rows: list[dict[str, Any]], *, batch: int = ROWS_PER_MESSAGE) -> list:
        """Publish rows as msgpack arrays of up to `batch` rows (about 256 KiB at most);
        `batch=1` sends one map per row with its id in the `Pfx-Id` header."""
        encoder = msgspec.msgpack.Encoder()
        subject = subjects.ingest(job)
        ids = [row["id"] for row in rows]
        coros = []
        if batch == 1:
            for row in rows:
                rid = msgspec.json.encode(row["id"]).decode()
                coros.append(publish(self.js, subject, encoder.encode(row), headers={"Pfx-Id": rid, "Nats-Msg-Id": f"{job}:{rid}"}))
        else:
            size = lambda row: len(str(row.get("prompt", ""))) + len(str(row.get("messages", ""))) + 5 * len(row.get("prompt_token_ids") or ()) + 64  # noqa: E731
            for run in m.chunked(rows, size, batch, max_bytes=256 * 1024):
                msg_id = f"{job}:{run[0]['id']}:{run[-1]['id']}:{len(run)}"
                coros.append(publish(self.js, subject, encoder.encode(run), headers={"Nats-Msg-Id": msg_id}))
        for i in range(0, len(coros), PUBLISH_CONCURRENCY):
            await asyncio.gather(*coros[i : i + PUBLISH_CONCURRENCY])
        return ids

    async def status(self, job: str) -> m.JobStatus | None:
        try:
            entry = await self.status_kv.get(job)
        except KeyNotFoundError:
            return None
        return m.job_status_decoder.decode(entry.value)

    async def wait(
        self, job: str, total: int, *, progress: bool = True, timeout: float | None = None, check: Callable[[], None] | None = None
    ) -> m.JobStatus:
        """Follow the sink's progress until `total` rows are written; raise `JobFailed`
        as soon as the status says the job failed. `check()` runs each round (raise there
        to stop waiting). A NATS outage (nats-server restarting) is waited out."""
        # Rate and ETA are the sink's (rows per second over its last 30 s), as in `prefixflow status`;
        # prompts under way and tokens/s come from the replicas' status messages (client/progress.py).
        bar = tqdm(total=total, desc=f"job {job}", unit="row", disable=not progress, dynamic_ncols=True,
                   bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]")
        deadline = None if timeout is None else time.monotonic() + timeout
        fleet = FleetProgress()
        self.first_progress: float | None = None
        """When the line first showed work under way (`prefixflow bench batching` reads it)."""

        async def on_status(msg) -> None:
            try:
                fleet.update(m.engine_status_decoder.decode(msg.data), time.monotonic())
            except msgspec.DecodeError:
                return

        status_sub = await self.nc.subscribe(subjects.ALL_STATUS, cb=on_status)
        st = None
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
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job} not done after {timeout} s (status: {st})")
                await asyncio.sleep(0.5)
        finally:
            bar.close()
            try:
                await status_sub.unsubscribe()
            except nats.errors.Error:
                pass


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
) -> m.JobStatus:
    """Submit `input_path` as `job` and wait until the sink has every row."""
    if (problem := subjects.name_problem(job)) is not None:
        raise SystemExit(f"invalid job id {job!r}: {problem} (a job id is one NATS subject token: letters, digits, '-' and '_', at most 64)")
    out_dir = str(Path(out_dir).resolve())
    from client import openai_batch

    batch = None
    if openai_batch.is_batch_file(input_path):  # OpenAI Batch requests -> rows (client/openai_batch.py)
        import tempfile

        batch = openai_batch.read_batch(input_path, task)
        input_path = openai_batch.write_rows(batch, Path(tempfile.mkdtemp(prefix="pfx-batch-")) / "rows.jsonl")
    async with Submitter(nats_url) as client:
        # A job the cluster already marked failed would only fail again: say so now,
        # before publishing anything.
        before = await client.status(job)
        if before is not None and before.failed:
            raise JobFailed(job, f"{before.error} (earlier run; submit under a new --job id)")
        spec = m.JobSpec(job=job, out_dir=out_dir, sampling=sampling, model=model, created_at=time.time(),
                         chat_template=chat_template, chat_template_kwargs=chat_template_kwargs or {}, task=task)
        await client.create(spec)
        seen = IdSet()  # compact for integer ids: a 100M-row job's ids need ~12 MiB, not GBs
        # Resume: rows an earlier run of this job already wrote are not sent again.
        done = finished_ids(out_dir)
        expected = count_rows(input_path)
        bar = tqdm(total=expected, desc="publish", unit="row", disable=not progress, dynamic_ncols=True)
        skipped = 0
        for chunk in columns.chunks(input_path):
            rows = chunk.rows
            seen.update(chunk.ids)
            todo = [r for r in rows if r["id"] not in done] if len(done) else rows
            skipped += len(rows) - len(todo)
            if todo:
                await client.put_columns(job, chunk)
                await client.publish_rows(job, todo)
            bar.update(len(rows))
        bar.close()
        if skipped:
            print(f"resuming job {job}: {skipped} rows already done, {len(seen) - skipped} sent", flush=True)
        sealed = msgspec.structs.replace(spec, total=len(seen))
        await client.create(sealed)
        status = await client.wait(job, len(seen), progress=progress, timeout=timeout, check=check)
    if batch is not None:
        ok, errors = openai_batch.write_outputs(batch, out_dir, model)
        where = openai_batch.batch_dir(out_dir)
        print(f"OpenAI Batch: {ok} responses in {where}/output.jsonl, {errors} errors in {where}/errors.jsonl", flush=True)
    return status
