"""Running batches: each batch not in a final state has one task in the API process
that takes it from where its record says it is (so a restarted API resumes every batch:
the cluster's done queries make a resubmitted job send only what is missing).

validating: the input file is read from the object store into rows (bad lines become
error lines; none good: `failed`); its bad lines and request ids are kept in the object
store (`parsed_names`), so the batch can be finalized without its input. in_progress: the
rows are submitted as the job `batch.job` (its spec delivers OpenAI Batch results:
`prefixflow/services/sink/export.py`, and carries the batch's deadline); the counters follow
the job's status. A job the cluster has already (done while the API was down) or whose
every row is published (sealed) is not submitted again: its end is awaited. finalizing:
the sink's exported lines become the output file, its error lines plus the bad lines
(plus, for a cancelled or expired batch, a line per request without a result) the error
file.

Every record change is a compare-and-set (`prefixflow/batchapi/lifecycle.py`), so a cancel
made meanwhile (by this API process or another) is never overwritten. A cancel that
finds no job yet (`UnknownJob`: the runner is still reading the input) is carried out by
the runner: it never creates the job of a batch that is `cancelling`, and while the job
runs it checks the record every `CANCEL_POLL_SECONDS` and cancels the job when the batch
is `cancelling` (so a cancel that lands between the check and the job's creation is
carried out at the job's first poll).

The runner reads the cluster's job records over the API's one long-lived NATS connection;
`submit` keeps its own connection while it publishes a batch's rows and follows its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import structlog
from nats.js.errors import KeyNotFoundError

from prefixflow.batchapi import batches as b
from prefixflow.batchapi import lifecycle
from prefixflow.batchapi.store import BatchRec, FileRec, Store, now
from prefixflow.client.submit import AlreadyDone, JobCancelled, JobFailed, submit
from prefixflow.shared.bus.connection import SHUTDOWN, StoppedWhileConnecting
from prefixflow.shared.bus.jobs import UnknownJob, cancel_job
from prefixflow.shared.bus.publish import message_limit
from prefixflow.shared.openai_batch import object_names
from prefixflow.shared.outcomes import CommandError
from prefixflow.shared.process.tasks import stop_task, stop_tasks
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()

PROGRESS_SECONDS = 2.0
"""How often a running batch's counters are brought up to date."""
CANCEL_POLL_SECONDS = 0.5
"""How often a running batch's record is checked for a cancel (one KV read)."""
SETTLE_POLL_SECONDS = 0.5
"""How often the job's status is read while waiting for the sink to complete it."""


def parsed_names(job: str) -> tuple[str, str]:
    """The files object store's objects of a batch's parsed input: (its bad lines as
    error lines, the custom_ids of its good requests), JSONL; kept from validation until
    the batch is final."""
    return f"{job}/input-errors.jsonl", f"{job}/input-ids.jsonl"


def ended_of(st: m.JobStatus) -> str:
    """How a finished job ended: "" (every row), "cancelled" or "expired"; a failed job
    fails its batch."""
    if st.failed:
        raise JobFailedError(f"the cluster failed the batch's job: {st.error}")
    if not st.cancelled:
        return ""
    return "expired" if (st.summary or {}).get("expired") else "cancelled"


async def read_record(kv, key: str, decoder):
    """The record at `key`, decoded (None: there is none)."""
    try:
        entry = await kv.get(key)
    except KeyNotFoundError:
        return None
    return decoder.decode(entry.value)


class JobFailedError(ValueError):
    """The cluster marked the batch's job failed."""


def stopping() -> bool:
    """The service was asked to stop (`run_service`'s stop event, `SHUTDOWN`)."""
    return (stop := SHUTDOWN.get()) is not None and stop.is_set()


class Runner:
    def __init__(self, store: Store, nats_url: str, cfg, js, nc) -> None:
        self.store, self.nats_url, self.cfg = store, nats_url, cfg
        self.js, self.nc = js, nc
        """The API's connection (long-lived): every read of the cluster's job records."""
        self.served = b.served_names(cfg.model, cfg.served_names)
        self.adapters = frozenset(n.strip() for n in cfg.lora_adapters.split(",") if n.strip())
        self.tasks: dict[str, asyncio.Task] = {}

    async def open(self) -> Runner:
        self.jobs_kv = await self.js.key_value(subjects.JOBS_KV)
        self.status_kv = await self.js.key_value(subjects.JOB_STATUS_KV)
        return self

    async def resume_all(self) -> None:
        for rec in await self.store.batches():
            if rec.batch["status"] not in b.TERMINAL:
                self.start(rec)

    def start(self, rec: BatchRec) -> None:
        bid = rec.batch["id"]
        if bid in self.tasks and not self.tasks[bid].done():
            return
        self.tasks = {k: t for k, t in self.tasks.items() if not t.done()}  # bounded: running batches only
        self.tasks[bid] = asyncio.create_task(self.run(rec.tenant, bid), name=f"batch {bid}")

    async def stop(self) -> None:
        await stop_tasks(self.tasks.values())

    async def run(self, tenant: str, bid: str) -> None:
        work = Path(tempfile.mkdtemp(prefix=f"pfx-{bid}-"))
        try:
            rec = await self.store.batch(tenant, bid)
            while rec is not None and rec.batch["status"] not in b.TERMINAL:
                rec = await self.step(rec, work)
        except asyncio.CancelledError:
            raise
        except (Exception, CommandError) as exc:  # noqa: BLE001 - the batch fails with the reason; the service goes on
            if isinstance(exc, StoppedWhileConnecting) or stopping():
                # The API is stopping (SIGTERM: a restart, systemd): what failed is this
                # process's connection, not the batch. Its record stays as it is and the
                # next start resumes it (`resume_all`).
                log.info("batch left for the API's next start: stopping", batch=bid, error=repr(exc))
                return
            # NOTE: a CommandError (what the client code raises to end a command, a SystemExit)
            # must fail this batch, never end the API.
            log.exception("batch failed", batch=bid)
            reason = exc.message if isinstance(exc, CommandError) else str(exc)
            await self.change(tenant, bid, lifecycle.failed(f"{type(exc).__name__}: {reason}"))
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def change(self, tenant: str, bid: str, change: lifecycle.Change) -> BatchRec | None:
        """Change the batch's record (a compare-and-set): the record as it now stands."""
        rec = await self.store.update_batch(tenant, bid, change)
        if rec is not None:
            log.info("batch", batch=bid, tenant=tenant, status=rec.batch["status"])
        return rec

    async def step(self, rec: BatchRec, work: Path) -> BatchRec | None:
        """One transition of the batch (its record as it now stands, None if it is gone)."""
        tenant, bid, status = rec.tenant, rec.batch["id"], rec.batch["status"]
        if status == "validating" or (status == "cancelling" and not rec.validated):
            parsed = await self.parse(rec, work)
            await self.keep_parsed(rec, work)
            error_file = None
            if status == "validating" and lifecycle.fails_validation(parsed.requests, parsed.duplicates):
                error_file = await self.error_file(rec, work / "bad.jsonl")
            now_rec = await self.change(tenant, bid, lifecycle.validated(
                parsed.requests, parsed.bad, parsed.errors, parsed.duplicates,
                error_file.id if error_file is not None else None))
            if error_file is not None and (now_rec is None or now_rec.batch.get("error_file_id") != error_file.id):
                await self.store.delete_file(error_file)  # cancelled meanwhile: finalizing writes its own
            return now_rec
        if status in lifecycle.RUNNING:
            return await self.change(tenant, bid, lifecycle.ran(await self.execute(rec, work)))
        if status == "finalizing":
            return await self.finalize(rec, work)
        raise ValueError(f"unknown batch status {status!r}")

    async def parse(self, rec: BatchRec, work: Path) -> b.Parsed:
        """The batch's input, read again (the same every time), streaming: rows in
        `work/rows.jsonl`, error lines in `work/bad.jsonl`, good ids in `work/ids.jsonl`."""
        src = work / "input.jsonl"
        if not src.exists():
            fid = rec.batch["input_file_id"]
            frec = await self.store.file(rec.tenant, fid)
            if frec is None:
                raise ValueError(f"input file {fid} is gone")
            with src.open("wb") as f:
                await self.store.read_object(frec.object, f)
        return await asyncio.to_thread(b.parse_file, src, work / "rows.jsonl", work / "bad.jsonl", work / "ids.jsonl",
                                       rec.batch["endpoint"], self.served, self.cfg.max_requests, self.adapters,
                                       max_line_bytes(self.nc))

    async def keep_parsed(self, rec: BatchRec, work: Path) -> None:
        """Keep what finalizing needs of the input (`parsed_names`: the files `parse`
        wrote) in the object store."""
        for name, path in zip(parsed_names(rec.job), (work / "bad.jsonl", work / "ids.jsonl"), strict=True):
            with path.open("rb") as f:
                await self.store.put_object(name, f)

    async def error_file(self, rec: BatchRec, path: Path) -> FileRec:
        """`path` (error lines) stored and registered as the batch's error file."""
        name = error_file_object(rec.job)
        with path.open("rb") as f:
            size = await self.store.put_object(name, f)
        return await self.register(rec, name, "errors", size)

    async def parsed_files(self, rec: BatchRec, work: Path) -> tuple[Path, Path]:
        """The batch's bad lines and good ids (`keep_parsed`) as local files; read from
        the object store, or from the input when they are not there (a batch validated
        by an API before they were kept)."""
        paths = work / "bad.jsonl", work / "ids.jsonl"
        if all(p.exists() for p in paths):
            return paths
        names = parsed_names(rec.job)
        if all([await self.store.object_size(name) is not None for name in names]):
            for name, path in zip(names, paths, strict=True):
                with path.open("wb") as f:
                    await self.store.read_object(name, f)
        else:
            await self.parse(rec, work)
            await self.keep_parsed(rec, work)
        return paths

    async def execute(self, rec: BatchRec, work: Path) -> str:
        """Run the batch's job to its end: "" (every row), "cancelled" or "expired"."""
        st = await self.job_status(rec.job)
        log.info("batch job", batch=rec.batch["id"], job=rec.job, rows=st.rows if st else 0, done=bool(st and st.done))
        if st is not None and (st.done or st.failed):
            return ended_of(st)  # it ended while no runner followed it (the API was down)
        spec = await self.job_spec(rec.job)
        fresh = await self.store.batch(rec.tenant, rec.batch["id"])  # a cancel since the last step?
        if spec is None and (fresh is None or fresh.batch["status"] == "cancelling"):
            return "cancelled"  # cancelled before its job was created: it never will be
        follow = asyncio.create_task(self.follow(rec))
        try:
            if spec is not None and (spec.total is not None or spec.cancelled_at):
                # Every row published already (or cancelled): the input is not needed again.
                log.info("batch job sealed before: waiting for its end", batch=rec.batch["id"], job=rec.job)
                return ended_of(await self.settled(rec.job))
            if not (work / "rows.jsonl").exists():
                await self.parse(rec, work)
            left = rec.batch["expires_at"] - time.time()
            log.info("batch job submitting", batch=rec.batch["id"], job=rec.job, resumed=spec is not None)
            await submit(
                work / "rows.jsonl", nats_url=self.nats_url, job=rec.job,
                out_dir=f"{self.cfg.out_prefix}/{rec.tenant}/{rec.batch['id']}", resolve_out=False,
                sampling=m.SamplingSpec(), model=self.cfg.model, progress=False,
                task="embed" if rec.batch["endpoint"] == b.EMBED_URL else "generate",
                expires_in=max(left, 0.001), deliver="openai-batch", priority=b.priority(rec.batch.get("metadata")),
            )
            return ""
        except AlreadyDone as done:  # done between the status read above and the submit's
            return ended_of(done.status)
        except JobCancelled:
            return ended_of(await self.settled(rec.job))  # its results are exported before its done status
        except JobFailed as exc:
            raise JobFailedError(f"the cluster failed the batch's job: {exc.reason}") from None
        finally:
            await stop_task(follow)  # a cancel alone can be lost (`prefixflow/shared/process/tasks.py`)
            with contextlib.suppress(Exception):  # best effort: finalizing sets the final counts
                await self.update_counts(rec)

    async def job_status(self, job: str) -> m.JobStatus | None:
        return await read_record(self.status_kv, job, m.job_status_decoder)

    async def job_spec(self, job: str) -> m.JobSpec | None:
        return await read_record(self.jobs_kv, job, m.job_spec_decoder)

    async def settled(self, job: str) -> m.JobStatus:
        """The job's status once the sink has completed it (waits as long as that takes)."""
        while True:
            st = await self.job_status(job)
            if st is not None and (st.done or st.failed):
                return st
            await asyncio.sleep(SETTLE_POLL_SECONDS)

    async def follow(self, rec: BatchRec) -> None:
        """While the batch's job runs: cancel the job once the batch is `cancelling` (also
        a cancel that found no job yet), and keep its counters up to date."""
        counted = time.monotonic()
        while True:
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            try:
                fresh = await self.store.batch(rec.tenant, rec.batch["id"])
                if fresh is not None and fresh.batch["status"] == "cancelling":
                    await self.cancel_job(rec.job, by=f"api:{rec.tenant}")
                if time.monotonic() - counted >= PROGRESS_SECONDS:
                    counted = time.monotonic()
                    await self.update_counts(rec)
            except Exception as exc:  # noqa: BLE001 - best effort; tried again at the next poll
                log.warning("batch not followed", batch=rec.batch["id"], error=repr(exc))

    async def cancel_job(self, job: str, by: str) -> None:
        """Mark the job cancelled (`by`: who cancelled, `JobSpec.cancelled_by`) if it exists
        and is not yet (a job spec rewritten by a resubmit is cancelled again)."""
        spec = await self.job_spec(job)
        if spec is not None and not spec.cancelled_at:
            with contextlib.suppress(UnknownJob):
                await cancel_job(self.js, self.nc, job, by=by)
                log.info("batch job cancelled", job=job)

    async def update_counts(self, rec: BatchRec) -> None:
        st = await self.job_status(rec.job)
        if st is not None:
            await self.store.update_batch(rec.tenant, rec.batch["id"], lifecycle.counted(st.rows, st.errors))

    async def finalize(self, rec: BatchRec, work: Path) -> BatchRec | None:
        ended = rec.batch.get("_ended", "")
        ok_name, err_name = object_names(rec.job)
        ok_path, err_path = work / "output.jsonl", work / "errors.jsonl"
        for name, path in ((ok_name, ok_path), (err_name, err_path)):
            with path.open("wb") as f:
                if await self.store.object_size(name) is not None:  # none: the job never ran
                    await self.store.read_object(name, f)
        bad_path, ids_path = await self.parsed_files(rec, work)
        have = await asyncio.to_thread(custom_ids, [ok_path, err_path])
        with err_path.open("a") as f, bad_path.open() as bad:
            shutil.copyfileobj(bad, f)
            if ended:
                with ids_path.open() as ids:
                    for line in b.missing_lines((json.loads(x) for x in ids if x.strip()), have, f"batch_{ended}"):
                        f.write(json.dumps(line) + "\n")
        fields = {}
        out_size = ok_path.stat().st_size
        if out_size:
            fields["output_file_id"] = (await self.register(rec, ok_name, "output", out_size)).id
        if err_path.stat().st_size:
            fields["error_file_id"] = (await self.error_file(rec, err_path)).id
        ok = sum(1 for _ in ok_path.open("rb"))
        failed = rec.requests + rec.bad - ok
        fields["request_counts"] = {"total": rec.requests + rec.bad, "completed": ok, "failed": failed}
        final = await self.change(rec.tenant, rec.batch["id"], lifecycle.finished(fields))
        if final is not None and final.batch["status"] in b.TERMINAL:
            for name in parsed_names(rec.job):  # needed only until the batch is final
                await self.store.delete_object(name)
        return final

    async def delete_outputs(self, rec: BatchRec) -> None:
        """Delete a final batch's data: its output and error files (records and content:
        their bytes stop counting) and every object its job and its runs left."""
        bid = rec.batch["id"]
        fids = {rec.batch.get("output_file_id"), rec.batch.get("error_file_id"),
                *(output_file_id(bid, kind) for kind in OUTPUT_KINDS)} - {None}
        for fid in sorted(fids):
            frec = await self.store.file(rec.tenant, fid)
            if frec is not None:
                await self.store.delete_file(frec)
        for name in (*object_names(rec.job), error_file_object(rec.job), *parsed_names(rec.job)):
            await self.store.delete_object(name)

    async def register(self, rec: BatchRec, obj: str, kind: str, size: int) -> FileRec:
        """The batch's output or error file (`obj`, `size` bytes) as a file of its tenant.
        Its id is the batch's (`output_file_id`): registered again (finalizing re-run after
        a restart) it is the same file, counted once."""
        frec = FileRec(output_file_id(rec.batch["id"], kind), rec.tenant, f"{rec.batch['id']}_{kind}.jsonl",
                       "batch_output", size, now(), obj)
        return await self.store.save_file(frec)


OUTPUT_KINDS = ("output", "errors")
"""A batch's files: its output file and its error file."""


def error_file_object(job: str) -> str:
    """The object of a batch's error file (the sink's error lines and the bad lines)."""
    return f"{job}/errors-all.jsonl"


def output_file_id(bid: str, kind: str) -> str:
    """The id of a batch's output file (`kind` "output") or error file ("errors"): the
    batch id's own, so it sorts beside its batch and a second registration finds the first."""
    return f"file_{bid.removeprefix('batch_')}_{kind}"


def max_line_bytes(nc) -> int:
    """The longest request line a batch may hold: half the server's message limit (a
    chat row carries its `messages` as the model input and again as an input column)."""
    return message_limit(nc) // 2


def custom_ids(paths: list[Path]) -> set[str]:
    """The custom_ids that have a line in these result files."""
    ids = set()
    for p in paths:
        with p.open("rb") as f:
            for line in f:
                if line.strip():
                    cid = json.loads(line).get("custom_id")
                    if cid is not None:
                        ids.add(cid)
    return ids
