"""Running batches: each batch not in a final state has one task in the API process
that takes it from where its record says it is (so a restarted API resumes every batch:
the cluster's done queries make a resubmitted job send only what is missing).

validating: the input file is read from the object store into rows (bad lines become
error lines; none good: `failed`). in_progress: the rows are submitted as the job
`batch.job` (its spec delivers OpenAI Batch results: `prefixflow/services/sink/export.py`, and
carries the batch's deadline); the counters follow the job's status. finalizing: the
sink's exported lines become the output file, its error lines plus the bad lines (plus,
for a cancelled or expired batch, a line per request without a result) the error file.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from pathlib import Path

import structlog

from prefixflow.client.submit import JobCancelled, JobFailed, Submitter, submit
from prefixflow.batchapi import batches as b
from prefixflow.batchapi.store import BatchRec, FileRec, Store, new_id, now
from prefixflow.shared.openai_batch import object_names
from prefixflow.shared.wire import messages as m

log = structlog.get_logger()

PROGRESS_SECONDS = 2.0
"""How often a running batch's counters are brought up to date."""


class Runner:
    def __init__(self, store: Store, nats_url: str, cfg) -> None:
        self.store, self.nats_url, self.cfg = store, nats_url, cfg
        self.served = b.served_names(cfg.model, cfg.served_names)
        self.adapters = frozenset(n.strip() for n in cfg.lora_adapters.split(",") if n.strip())
        self.tasks: dict[str, asyncio.Task] = {}

    async def resume_all(self) -> None:
        for rec in await self.store.batches():
            if rec.batch["status"] not in b.TERMINAL:
                self.start(rec)

    def start(self, rec: BatchRec) -> None:
        bid = rec.batch["id"]
        if bid in self.tasks and not self.tasks[bid].done():
            return
        self.tasks[bid] = asyncio.create_task(self.run(rec.tenant, bid), name=f"batch {bid}")

    async def stop(self) -> None:
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def run(self, tenant: str, bid: str) -> None:
        work = Path(tempfile.mkdtemp(prefix=f"pfx-{bid}-"))
        try:
            rec = await self.store.batch(tenant, bid)
            while rec is not None and rec.batch["status"] not in b.TERMINAL:
                rec = await self.step(rec, work)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the batch fails with the reason; the service goes on
            log.exception("batch failed", batch=bid)
            rec = await self.store.batch(tenant, bid)
            if rec is not None and rec.batch["status"] not in b.TERMINAL:
                await self.set(rec, "failed", errors={"object": "list", "data": [
                    {"code": "internal_error", "message": f"{type(exc).__name__}: {exc}", "line": None, "param": None}]})
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def set(self, rec: BatchRec, status: str, **fields) -> BatchRec:
        rec.batch.update(status=status, **fields)
        if status in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelled"):
            rec.batch.setdefault(f"{status}_at" if status != "in_progress" else "in_progress_at", now())
        await self.store.save_batch(rec)
        log.info("batch", batch=rec.batch["id"], tenant=rec.tenant, status=status)
        return rec

    async def step(self, rec: BatchRec, work: Path) -> BatchRec:
        fresh = await self.store.batch(rec.tenant, rec.batch["id"])
        if fresh is not None and fresh.batch["status"] == "cancelling" and rec.batch["status"] != "finalizing":
            rec.batch.update(status="cancelling", cancelling_at=fresh.batch.get("cancelling_at"))
        status = rec.batch["status"]
        parsed = await self.parse(rec, work)
        if status == "cancelling" and not await self.job_exists(rec):  # cancelled before it was submitted
            rec.requests, rec.bad = len(parsed.ids), len(parsed.bad)
            return await self.set(rec, "finalizing", _ended="cancelled")
        if status == "validating":
            rec.requests, rec.bad = len(parsed.ids), len(parsed.bad)
            if not parsed.ids:
                return await self.set(rec, "failed", errors={"object": "list", "data": parsed.bad_errors},
                                      request_counts=b.counts(0, rec.bad, 0, 0))
            return await self.set(rec, "in_progress", request_counts=b.counts(rec.requests, rec.bad, 0, 0))
        if status in ("in_progress", "cancelling"):
            ended = await self.execute(rec, work)
            fresh = await self.store.batch(rec.tenant, rec.batch["id"])
            if not ended and fresh is not None and fresh.batch["status"] == "cancelling":
                ended = "cancelled"  # cancelled as its last rows landed: cancelled, with every result
                rec.batch.update(status="cancelling", cancelling_at=fresh.batch.get("cancelling_at"))
            return await self.set(rec, "finalizing", _ended=ended)
        if status == "finalizing":
            return await self.finalize(rec, parsed, work)
        raise ValueError(f"unknown batch status {status!r}")

    async def parse(self, rec: BatchRec, work: Path) -> b.Parsed:
        """The batch's input, read again (the same every time): rows in `work/rows.jsonl`."""
        src = work / "input.jsonl"
        if not src.exists():
            fid = rec.batch["input_file_id"]
            frec = await self.store.file(rec.tenant, fid)
            if frec is None:
                raise ValueError(f"input file {fid} is gone")
            with src.open("wb") as f:
                await self.store.read_object(frec.object, f)
        return await asyncio.to_thread(b.parse_file, src, work / "rows.jsonl", rec.batch["endpoint"], self.served,
                                       self.cfg.max_requests, self.adapters)

    async def execute(self, rec: BatchRec, work: Path) -> str:
        """Run the batch's job to its end: "" (every row), "cancelled" or "expired"."""
        follow = asyncio.create_task(self.follow(rec))
        try:
            left = rec.batch["expires_at"] - time.time()
            await submit(
                work / "rows.jsonl", nats_url=self.nats_url, job=rec.job,
                out_dir=f"{self.cfg.out_prefix}/{rec.tenant}/{rec.batch['id']}", resolve_out=False,
                sampling=m.SamplingSpec(), model=self.cfg.model, progress=False,
                task="embed" if rec.batch["endpoint"] == b.EMBED_URL else "generate",
                expires_in=max(left, 0.001), deliver="openai-batch", priority=b.priority(rec.batch.get("metadata")),
            )
            return ""
        except JobCancelled:
            st = await self.settled(rec.job)  # its results are exported before its done status
            return "expired" if (st.summary or {}).get("expired") else "cancelled"
        except JobFailed as exc:
            raise ValueError(f"the cluster failed the batch's job: {exc.reason}") from None
        finally:
            follow.cancel()
            await self.update_counts(rec)

    async def settled(self, job: str) -> m.JobStatus:
        """The job's status once the sink has completed it (waits as long as that takes)."""
        async with Submitter(self.nats_url) as client:
            while True:
                st = await client.status(job)
                if st is not None and (st.done or st.failed):
                    return st
                await asyncio.sleep(0.5)

    async def job_exists(self, rec: BatchRec) -> bool:
        async with Submitter(self.nats_url) as client:
            return await client.spec(rec.job) is not None

    async def follow(self, rec: BatchRec) -> None:
        while True:
            await asyncio.sleep(PROGRESS_SECONDS)
            try:
                await self.update_counts(rec)
            except Exception as exc:  # noqa: BLE001 - counters are best effort; tried again
                log.warning("batch counters not updated", batch=rec.batch["id"], error=repr(exc))

    async def update_counts(self, rec: BatchRec) -> None:
        async with Submitter(self.nats_url) as client:
            st = await client.status(rec.job)
        if st is not None:
            fresh = await self.store.batch(rec.tenant, rec.batch["id"])  # keep a cancel made meanwhile
            if fresh is not None and fresh.batch["status"] == "cancelling":
                rec.batch["status"], rec.batch["cancelling_at"] = "cancelling", fresh.batch.get("cancelling_at")
            rec.batch["request_counts"] = b.counts(rec.requests, rec.bad, st.rows, st.errors)
            await self.store.save_batch(rec)

    async def finalize(self, rec: BatchRec, parsed: b.Parsed, work: Path) -> BatchRec:
        ended = rec.batch.pop("_ended", "")
        ok_name, err_name = object_names(rec.job)
        ok_path, err_path = work / "output.jsonl", work / "errors.jsonl"
        for name, path in ((ok_name, ok_path), (err_name, err_path)):
            with path.open("wb") as f:
                if await self.store.object_size(name) is not None:  # none: the job never ran
                    await self.store.read_object(name, f)
        have = await asyncio.to_thread(custom_ids, [ok_path, err_path])
        with err_path.open("a") as f:
            for line in parsed.bad:
                f.write(json.dumps(line) + "\n")
            if ended:
                for line in b.missing_lines(parsed.ids, have, f"batch_{ended}"):
                    f.write(json.dumps(line) + "\n")
        fields = {}
        out_size = ok_path.stat().st_size
        if out_size:
            fields["output_file_id"] = (await self.register(rec, ok_name, "output", out_size)).id
        if err_path.stat().st_size:
            final_err = f"{rec.job}/errors-all.jsonl"
            with err_path.open("rb") as f:
                size = await self.store.put_object(final_err, f)
            fields["error_file_id"] = (await self.register(rec, final_err, "errors", size)).id
        ok = sum(1 for _ in ok_path.open("rb"))
        failed = rec.requests + rec.bad - ok
        fields["request_counts"] = {"total": rec.requests + rec.bad, "completed": ok, "failed": failed}
        return await self.set(rec, {"": "completed", "cancelled": "cancelled", "expired": "expired"}[ended], **fields)

    async def register(self, rec: BatchRec, obj: str, kind: str, size: int) -> FileRec:
        frec = FileRec(new_id("file"), rec.tenant, f"{rec.batch['id']}_{kind}.jsonl", "batch_output", size, now(), obj)
        await self.store.save_file(frec)
        return frec


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
