"""A batch job's results for the batch service (`prefixflow serve api`): when a job whose
spec says `deliver="openai-batch"` completes (done, cancelled or expired), the sink turns
its Parquet parts into OpenAI Batch result lines (`prefixflow/shared/openai_batch.py`) and puts them
into the batch service's files (the NATS object store, or `--files-uri`) as `<job>/output.jsonl` and `<job>/errors.jsonl`, before the
job's done status: a service that sees the job done finds its results there, from any
machine. Memory: one record batch of a part at a time; the lines go through local files
(`OUT/_batch/`) that the object store reads in chunks.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq

from prefixflow.shared.openai_batch import object_names, result_line
from prefixflow.shared.file_objects import file_objects

DELIVER = "openai-batch"
"""`JobSpec.deliver` of a job whose results the sink exports."""
COLUMNS = ("id", "url", "output", "outputs", "finish_reason", "prompt_tokens", "cached_tokens", "output_tokens", "error",
           "embedding", "lora")
"""The output columns a result line is made of (`url`, `lora`: the request's, kept as input
columns; a line that named a LoRA adapter is answered in its name)."""
READ_ROWS = 4096


class ExportFailed(Exception):
    """The results could not be stored (tried again next round)."""


def write_lines(parts: list[Path], model: str, ok_path: Path, err_path: Path) -> tuple[int, int]:
    """Every row of the parts as a result line, into `ok_path` and `err_path`; (ok, errors)."""
    created = int(time.time())
    n_ok = n_err = 0
    ok_path.parent.mkdir(parents=True, exist_ok=True)
    with ok_path.open("w") as ok_f, err_path.open("w") as err_f:
        for part in parts:
            pf = pq.ParquetFile(part, pre_buffer=False)
            columns = [c for c in COLUMNS if c in pf.schema_arrow.names]
            for batch in pf.iter_batches(batch_size=READ_ROWS, columns=columns):
                for row in batch.to_pylist():
                    named = row.get("lora") or model
                    good, line = result_line(str(row["id"]), row.get("url") or "", row, named, created)
                    (ok_f if good else err_f).write(json.dumps(line) + "\n")
                    n_ok += good
                    n_err += not good
    return n_ok, n_err


async def put_results(js, job: str, ok_path: Path, err_path: Path, files_uri: str = "") -> None:
    """Store the two files as the job's result objects (replacing an earlier export), in
    the batch service's files (`files_uri`: `prefixflow/shared/file_objects.py`)."""
    try:
        store = file_objects(js, files_uri)
        for name, path in zip(object_names(job), (ok_path, err_path), strict=True):
            with path.open("rb") as f:
                await store.put(name, f)
    except Exception as exc:  # noqa: BLE001 - any transport or server error: retried
        raise ExportFailed(f"results of {job} not stored: {exc!r}") from exc
