"""Only model inputs travel: a job's input split into what the pipeline needs and what it
keeps aside.

The client reads the input's files (`prefixflow/client/sources.py`) as Arrow record
batches (`prefixflow/client/readers.py`: Parquet row groups as they are; JSONL and CSV
through one schema per file). Each batch of up to
`CHUNK_ROWS` rows becomes

- the rows of the ingest messages: `id`, the model inputs (`prompt`, `messages`,
  `prompt_token_ids`) and the row's own sampling fields, plus a reference (`SRC_KEY`,
  `ROW_KEY`) to where the rest of the row is kept;
- a record batch of every input column but `prompt_token_ids` (`id` and `prompt`
  included), with the input's exact Arrow schema, stored once as the job's blob
  `in-<src>` (Arrow IPC file format) in the blob store (`prefixflow/shared/bus/blobs.py`).

The sink joins the stored columns back to the results by (`src`, `row`) when it writes a
part (`prefixflow/services/sink/inputs.py`), so the output keeps every input column's Arrow type and
values, whatever they are, and a 3 MiB document beside a prompt never rides the pipeline.
Pure apart from reading the input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa

from prefixflow.client import readers
from prefixflow.client.sources import InputError, Source, resolve
from prefixflow.shared.wire.messages import LORA_FIELD, ROW_FIELD, SRC_FIELD, input_blob
from prefixflow.shared.wire.structured import ROW_FIELDS

CHUNK_ROWS = readers.CHUNK_ROWS
"""Input rows per stored blob (and per read batch)."""
SRC_KEY = SRC_FIELD
ROW_KEY = ROW_FIELD
MODEL_COLUMNS = ("id", "prompt", "messages", "prompt_token_ids", LORA_FIELD, *ROW_FIELDS)
"""Input columns the ingest message carries (what the ingestor and engines use)."""
NOT_KEPT = ("prompt_token_ids",)
"""Input columns not copied to the output."""
INPUT_COLUMNS = ("prompt", "messages", "prompt_token_ids")


blob_key = input_blob


class Chunk(msgspec.Struct):
    """One batch of input rows, split."""

    src: int
    rows: list[dict[str, Any]]
    """Ingest rows: model inputs and the reference to the kept columns."""
    kept: bytes
    """The kept columns as an Arrow IPC file (empty: nothing to keep)."""
    ids: list[Any]


def ipc_bytes(batch: pa.RecordBatch | pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write(batch)
    return sink.getvalue().to_pybytes()


def read_ipc(data: bytes | pa.Buffer) -> pa.Table:
    return pa.ipc.open_file(pa.py_buffer(data) if isinstance(data, bytes) else data).read_all()


def chunks(source: str | Path | Source, options: dict[str, Any] | None = None) -> Iterator[Chunk]:
    """The input's rows as split chunks, numbered from 0 (`src`) across its shards in name
    order (`prefixflow/client/sources.py`). Row ids: the `id` column, else the row number
    across the shards (so a resume of a directory skips exactly what is done). Every shard
    has an `id` column or none does (`InputError`); a shard's other columns may differ
    from another's: the sink widens them by the job's output rules."""
    source = source if isinstance(source, Source) else resolve(source, options)
    first_row, src = 0, 0
    has_id: tuple[bool, str] | None = None
    for shard in source.shards:
        for batch, raw in readers.batches(shard):
            names = batch.schema.names
            if not set(INPUT_COLUMNS) & set(names):
                raise InputError(f"{shard.path}: no 'prompt', 'messages' or 'prompt_token_ids' column (columns: {names})")
            has_id = has_id or ("id" in names, shard.name)
            if has_id[0] != ("id" in names):
                with_id, without = (has_id[1], shard.name) if has_id[0] else (shard.name, has_id[1])
                raise InputError(f"{source.given}: {with_id} has an 'id' column and {without} has none: every file of "
                                 "an input has one, or none (then a row's id is its number across the files)")
            yield split(batch, src, first_row, raw)
            first_row += batch.num_rows
            src += 1


def split(batch: pa.RecordBatch | pa.Table, src: int, first_row: int, raw: list[dict[str, Any]] | None = None) -> Chunk:
    """Split one batch (`raw`: the same rows as parsed JSON, for the model inputs): ingest
    rows (model inputs + reference) and the kept columns."""
    names = batch.schema.names
    model = [n for n in MODEL_COLUMNS if n in names]
    if raw is not None:
        rows = [{n: r[n] for n in model if n in r} for r in raw]
    else:
        rows = batch.select(model).to_pylist() if model else [{} for _ in range(batch.num_rows)]
    if "id" not in names:
        for i, row in enumerate(rows):
            row["id"] = first_row + i
    kept_names = [n for n in names if n not in NOT_KEPT]
    kept = b""
    if kept_names:
        kept = ipc_bytes(batch.select(kept_names))
        for i, row in enumerate(rows):
            row[SRC_KEY] = src
            row[ROW_KEY] = i
    return Chunk(src, rows, kept, [r["id"] for r in rows])


table_of = readers.table_of
