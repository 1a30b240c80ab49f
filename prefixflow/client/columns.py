"""Only model inputs travel: a job's input file split into what the pipeline needs and what
it keeps aside.

The client reads the input as Arrow record batches (Parquet row groups as they are; JSONL
through one schema for the whole file, see `jsonl_batches`). Each batch of up to
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
Pure apart from reading the input file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.shared.wire.messages import LORA_FIELD, ROW_FIELD, SRC_FIELD, input_blob
from prefixflow.shared.wire.structured import ROW_FIELDS

CHUNK_ROWS = 4096
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


def chunks(path: str | Path) -> Iterator[Chunk]:
    """The input file as split chunks, numbered from 0 (`src`). Row ids: the `id` column,
    else the row number."""
    path = Path(path)
    if path.suffix in (".parquet", ".pq"):
        # Model inputs as Arrow gives them (a `messages` list of structs -> dicts).
        # NOTE: pre_buffer off: with it, pyarrow keeps every row group's buffered column
        # chunks for the file's lifetime (RSS grew ~230 MB per million 128-token rows;
        # `prefixflow bench soak` at 10M rows: 2.3 GB), without it memory is one batch.
        pairs = ((b, None) for b in pq.ParquetFile(path, pre_buffer=False).iter_batches(batch_size=CHUNK_ROWS))
    elif path.suffix in (".jsonl", ".json", ".ndjson"):
        # Model inputs as JSON gave them (a chat `messages` column the table holds as
        # text, where its shape varies, still reaches the ingestor as a list).
        pairs = jsonl_batches(path)
    else:
        raise SystemExit(f"{path}: want a .parquet or .jsonl file")
    first_row = 0
    for src, (batch, raw) in enumerate(pairs):
        names = batch.schema.names
        if not set(INPUT_COLUMNS) & set(names):
            raise SystemExit(f"{path}: no 'prompt', 'messages' or 'prompt_token_ids' column (columns: {names})")
        yield split(batch, src, first_row, raw)
        first_row += batch.num_rows


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


# --- JSONL: one Arrow schema for the whole file ----------------------------------------


def _json_rows(path: Path) -> Iterator[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = msgspec.json.decode(line)
            except msgspec.DecodeError as exc:
                raise SystemExit(f"{path}:{n}: not JSON: {exc}") from None
            if not isinstance(row, dict):
                raise SystemExit(f"{path}:{n}: want a JSON object per line")
            rows.append(row)
            if len(rows) >= CHUNK_ROWS:
                yield rows
                rows = []
    if rows:
        yield rows


def _as_json_text(values: list[Any]) -> pa.Array:
    return pa.array([None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values], pa.string())


def table_of(rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> pa.Table:
    """Rows as a table: with `schema`, every column of it (missing ones null, a string
    column takes any value as JSON text); without, types inferred per column, and a column
    whose values Arrow cannot hold as one type (a chat `messages` whose content is a
    string in one row, a list in another) as JSON text."""
    names = list(schema.names) if schema is not None else list(dict.fromkeys(k for r in rows for k in r))
    arrays = []
    for name in names:
        values = [r.get(name) for r in rows]
        want = schema.field(name).type if schema is not None else None
        if want is not None and pa.types.is_string(want):
            arrays.append(_as_json_text(values))
            continue
        try:
            arrays.append(pa.array(values, type=want))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            arrays.append(_as_json_text(values))
    return pa.Table.from_arrays(arrays, names=names)


def jsonl_schema(path: Path) -> pa.Schema:
    """One schema for every line of a JSONL file (first pass): each batch's inferred
    types, unified with Arrow's permissive promotion; a column whose types cannot be
    unified (a number here, a string there) is text."""
    fields: dict[str, pa.DataType] = {}
    for rows in _json_rows(path):
        for f in table_of(rows).schema:
            have = fields.get(f.name)
            if have is None or pa.types.is_null(have):
                fields[f.name] = f.type
            elif have != f.type and not pa.types.is_null(f.type):
                try:
                    fields[f.name] = pa.unify_schemas(
                        [pa.schema([(f.name, have)]), pa.schema([(f.name, f.type)])], promote_options="permissive"
                    ).field(f.name).type
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    fields[f.name] = pa.string()
    return pa.schema([(n, pa.string() if pa.types.is_null(t) else t) for n, t in fields.items()])


def jsonl_batches(path: Path) -> Iterator[tuple[pa.Table, list[dict[str, Any]]]]:
    """A JSONL file as tables of one schema, each with its rows as parsed (two passes;
    memory bounded by a batch)."""
    schema = jsonl_schema(path)
    for rows in _json_rows(path):
        yield table_of(rows, schema), rows
