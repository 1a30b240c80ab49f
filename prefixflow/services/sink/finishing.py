"""The files of a finished job (every row on disk): an empty part for a job of no rows (so
its directory reads as an empty table), `_summary.json`, and for a job delivered to the
batch service its results as JSON lines, put in the object store."""

from __future__ import annotations

import asyncio

from nats.js import JetStreamContext

from prefixflow.services.sink import export
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.wire import messages as m


async def write_final(js: JetStreamContext, job: str, out: JobOutput, spec: m.JobSpec, files_uri: str = "") -> dict:
    """Write the finished job's files (the caller holds the sink's disk lock). Returns
    its summary; raises `export.ExportFailed` if its results could not be exported."""
    if not out.parts():
        name = f"part-{out.next_part:06d}.parquet"  # the writer's name of its next part
        await asyncio.to_thread(out.store.write_empty, out.schema, name)
        out.next_part += 1
    summary = await asyncio.to_thread(out.write_summary, spec)
    if spec.deliver == export.DELIVER:  # the batch service reads the results from the object store
        if out.dir is None:
            # NOTE: not `ExportFailed` (retried every round): this never succeeds, the job fails
            raise ValueError(f"a batch job's output must be a local directory, not {out.store.where}")
        ok_path, err_path = out.dir / "_batch" / "output.jsonl", out.dir / "_batch" / "errors.jsonl"
        await asyncio.to_thread(export.write_lines, out.parts(), spec.model, ok_path, err_path)
        await export.put_results(js, job, ok_path, err_path, files_uri)
    return summary
