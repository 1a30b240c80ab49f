"""Submitting a job and following it: what `prefixflow submit` and `prefixflow run` do.

1. Create the job spec in the jobs KV bucket (validated sampling parameters).
2. Stream the input file (Parquet or JSONL with a `prompt` column) to `pfx.ingest.<job>`,
   one msgpack message per row, with the id in the `Pfx-Id` header and a `Nats-Msg-Id`
   so a re-publish inside the stream's duplicate window is dropped by the server.
3. Seal the job (set `total`) and follow the sink's progress until it is done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.json as pajson
import pyarrow.parquet as pq
from nats.js.errors import KeyNotFoundError
from tqdm import tqdm

from shared.wire import messages as m
from shared.wire import subjects
from shared.bus.connection import close, connect
from shared.bus.provision import provision
from shared.bus.publish import publish

READ_BATCH = 4096
PUBLISH_CONCURRENCY = 256
ROWS_PER_MESSAGE = 64


def read_rows(path: str | Path) -> Iterator[list[dict[str, Any]]]:
    """Batches of rows of a Parquet or JSONL file; adds `id` (row number) if absent."""
    path = Path(path)
    if path.suffix in (".parquet", ".pq"):
        batches = (b for b in pq.ParquetFile(path).iter_batches(batch_size=READ_BATCH))
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        batches = iter(pajson.read_json(path).to_batches(max_chunksize=READ_BATCH))
    else:
        raise SystemExit(f"{path}: want a .parquet or .jsonl file")
    row_number = 0
    for batch in batches:
        if "prompt" not in batch.schema.names and "prompt_token_ids" not in batch.schema.names:
            raise SystemExit(f"{path}: no 'prompt' or 'prompt_token_ids' column (columns: {batch.schema.names})")
        rows = batch.to_pylist()
        if "id" not in batch.schema.names:
            for i, row in enumerate(rows):
                row["id"] = row_number + i
        row_number += len(rows)
        yield rows


def finished_ids(out_dir: str | Path):
    """Ids already written to `out_dir` by an earlier run of the job (resume)."""
    from shared.wire.ids import IdSet

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
            size = lambda row: len(str(row.get("prompt", ""))) + 5 * len(row.get("prompt_token_ids") or ()) + 64  # noqa: E731
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
        """Follow the sink's progress until `total` rows are written; `check()` runs each
        round (the all-in-one mode uses it to fail fast if a service died)."""
        bar = tqdm(total=total, desc=f"job {job}", unit="row", disable=not progress, dynamic_ncols=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                st = await self.status(job)
                if st is not None:
                    bar.n = min(st.rows, total)
                    bar.set_postfix(errors=st.errors, refresh=False)
                    bar.refresh()
                    if st.done and st.total == total:
                        return st
                if check is not None:
                    check()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"job {job} not done after {timeout} s (status: {st})")
                await asyncio.sleep(0.5)
        finally:
            bar.close()


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
) -> m.JobStatus:
    """Submit `input_path` as `job` and wait until the sink has every row."""
    if not subjects.is_valid_name(job):
        raise SystemExit(f"invalid job id {job!r}: use letters, digits, '-' and '_' (at most 64)")
    out_dir = str(Path(out_dir).resolve())
    async with Submitter(nats_url) as client:
        spec = m.JobSpec(job=job, out_dir=out_dir, sampling=sampling, model=model, created_at=time.time())
        await client.create(spec)
        seen: set = set()
        # Resume: rows an earlier run of this job already wrote are not sent again.
        done = finished_ids(out_dir)
        expected = count_rows(input_path)
        bar = tqdm(total=expected, desc="publish", unit="row", disable=not progress, dynamic_ncols=True)
        skipped = 0
        for rows in read_rows(input_path):
            seen.update(r["id"] for r in rows)
            todo = [r for r in rows if r["id"] not in done] if len(done) else rows
            skipped += len(rows) - len(todo)
            if todo:
                await client.publish_rows(job, todo)
            bar.update(len(rows))
        bar.close()
        if skipped:
            print(f"resuming job {job}: {skipped} rows already done, {len(seen) - skipped} sent", flush=True)
        sealed = msgspec.structs.replace(spec, total=len(seen))
        await client.create(sealed)
        return await client.wait(job, len(seen), progress=progress, timeout=timeout, check=check)


def summary_table(summary: dict[str, Any]) -> pa.Table:
    """The summary as a small table (overall + per replica) for printing."""
    rows = [dict(scope="all", **{k: v for k, v in summary.items() if k not in ("replicas", "job", "wall_seconds")})]
    for name, s in summary.get("replicas", {}).items():
        rows.append(dict(scope=name, **s))
    return pa.Table.from_pylist(rows)
