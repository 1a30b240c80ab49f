"""Each data file of an input as Arrow record batches, in bounded memory, by its format.

- Parquet: row groups read by range as they come (`iter_batches`, no pre-buffering);
- JSON lines: one Arrow schema for the whole file (a first pass typing each field by the
  job's widening rules, `prefixflow/shared/widening.py`, as the raw ingest path does: a
  field whose type changes between lines widens, never fails), then tables of that
  schema, each with its rows as parsed (the model inputs as JSON gave them);
- CSV: one schema for the whole file (a first pass reads every column as text and types
  each batch's values: int64, float64 or text; the batches' types joined by the job's
  widening rules, `prefixflow/shared/widening.py`), then pyarrow's streaming reader with
  those types. pyarrow alone types a CSV by its first block and fails on a later one.

Each pass streams the file (`Shard.open_file`/`open_stream`): memory is one batch, not
the file, wherever it lives. Pure apart from reading the shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from prefixflow.client.sources import InputError, Shard
from prefixflow.shared.widening import NULL, STRING, Kind, column_of, join, kind_of_array, kind_of_values

CHUNK_ROWS = 4096
"""Input rows per read batch (and per stored blob)."""
LINE_BLOCK = 1 << 20
"""Bytes read at a time when splitting a stream into lines."""

Pair = tuple[pa.RecordBatch | pa.Table, list[dict[str, Any]] | None]
"""A batch and, for JSON lines, its rows as parsed."""


def batches(shard: Shard) -> Iterator[Pair]:
    """The shard's rows as batches of up to `CHUNK_ROWS`."""
    if shard.format == "arrow":  # an in-memory input (`prefixflow/client/memory.py`)
        return ((b, None) for b in shard.open_batches())
    if shard.format == "parquet":
        return parquet_batches(shard)
    if shard.format == "csv":
        return csv_batches(shard)
    return jsonl_batches(shard)


def parquet_batches(shard: Shard) -> Iterator[Pair]:
    # NOTE: pre_buffer off: with it, pyarrow keeps every row group's buffered column
    # chunks for the file's lifetime (RSS grew ~230 MB per million 128-token rows;
    # `prefixflow bench soak` at 10M rows: 2.3 GB), without it memory is one batch.
    try:
        pf = pq.ParquetFile(shard.open_file(), pre_buffer=False)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{shard.path}: not a Parquet file: {exc}") from None
    return ((b, None) for b in pf.iter_batches(batch_size=CHUNK_ROWS))


def parquet_rows(shard: Shard) -> tuple[int, pa.Schema]:
    """A Parquet shard's row count and schema (its footer only)."""
    try:
        with shard.open_file() as f:
            meta = pq.ParquetFile(f).metadata
            return meta.num_rows, meta.schema.to_arrow_schema()
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{shard.path}: not a Parquet file: {exc}") from None


# --- JSON lines --------------------------------------------------------------------------


def lines(shard: Shard) -> Iterator[bytes]:
    """The shard's lines (a stream read `LINE_BLOCK` bytes at a time)."""
    with shard.open_stream() as f:
        rest = b""
        while block := f.read(LINE_BLOCK):
            parts = (rest + block).split(b"\n")
            rest = parts.pop()
            yield from parts
        if rest:
            yield rest


def json_rows(shard: Shard) -> Iterator[list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    for n, line in enumerate(lines(shard), 1):
        if not line.strip():
            continue
        try:
            row = msgspec.json.decode(line)
        except msgspec.DecodeError as exc:
            raise InputError(f"{shard.path}:{n}: not JSON: {exc}") from None
        if not isinstance(row, dict):
            raise InputError(f"{shard.path}:{n}: want a JSON object per line")
        rows.append(row)
        if len(rows) >= CHUNK_ROWS:
            yield rows
            rows = []
    if rows:
        yield rows


def table_of(rows: list[dict[str, Any]], schema: pa.Schema | None = None) -> pa.Table:
    """Rows as a table: with `schema` (a `jsonl_schema`), every column of it, missing
    values null; without, the rows' own. Each column is typed and filled by the job's
    widening rules (`prefixflow/shared/widening.py`, `column_of`): every value exact, or
    its canonical text in a text column (docs/schema-growth.md)."""
    kinds = row_kinds(rows) if schema is None else {f.name: Kind(f.type) for f in schema}
    names = list(kinds)
    arrays = [column_of([r.get(n) for r in rows], _declared(kinds[n])) for n in names]
    return pa.Table.from_arrays(arrays, names=names)


def row_kinds(rows: list[dict[str, Any]]) -> dict[str, Kind]:
    """Each field's kind over a batch of rows (`widening.kind_of_values`), in first-seen order."""
    names = dict.fromkeys(k for r in rows for k in r)
    return {n: kind_of_values([r.get(n) for r in rows]) for n in names}


def _declared(kind: Kind) -> Kind:
    """A column no row gave a value is text (a declared schema has no null columns)."""
    return STRING if pa.types.is_null(kind.type) else kind


def jsonl_schema(shard: Shard) -> pa.Schema:
    """One schema for every line of a JSONL file (first pass): each batch's kinds joined
    by the job's widening rules (`widening.join`: int + string -> string, int + float ->
    float64 while every int is exact in it, a nested value beside anything else -> JSON
    text), the same rules the raw ingest path and the sink use; a field no line gives a
    value is text."""
    kinds: dict[str, Kind] = {}
    for rows in json_rows(shard):
        for name, kind in row_kinds(rows).items():
            kinds[name] = join(kinds.get(name, NULL), kind)
    return pa.schema([(n, _declared(k).type) for n, k in kinds.items()])


def jsonl_batches(shard: Shard) -> Iterator[Pair]:
    """A JSONL file as tables of one schema, each with its rows as parsed (two passes;
    memory bounded by a batch)."""
    schema = jsonl_schema(shard)
    for rows in json_rows(shard):
        yield table_of(rows, schema), rows


# --- CSV ---------------------------------------------------------------------------------


def _csv_reader(shard: Shard, convert: pacsv.ConvertOptions | None = None) -> pacsv.CSVStreamingReader:
    try:
        return pacsv.open_csv(shard.open_stream(), convert_options=convert)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"{shard.path}: not a CSV file: {exc}") from None


def text_kind(arr: pa.Array) -> Kind:
    """The kind of a CSV column's text values (nulls: empty or a null marker): int64 if
    every value is an integer, float64 if a number (string if an integer among them is
    past +-2^53: `widening.SAFE_INT`), else string."""
    if arr.null_count == len(arr):
        return NULL
    ints = arr.filter(pc.match_substring_regex(arr, r"^[+-]?[0-9]+$"))
    try:
        int_kind = kind_of_array(ints.cast(pa.int64())) if len(ints) else NULL
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return STRING  # past int64: its text
    if len(ints) == len(arr) - arr.null_count:
        return int_kind
    try:
        arr.cast(pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return STRING
    return join(int_kind, Kind(pa.float64()))


def csv_schema(shard: Shard) -> pa.Schema:
    """One schema for a whole CSV file (see the module docstring)."""
    names = _csv_reader(shard).schema.names
    as_text = pacsv.ConvertOptions(column_types={n: pa.string() for n in names}, strings_can_be_null=True)
    kinds = dict.fromkeys(names, NULL)
    try:
        for batch in _csv_reader(shard, as_text):
            for name, col in zip(batch.schema.names, batch.columns):
                kinds[name] = join(kinds[name], text_kind(col))
    except pa.ArrowInvalid as exc:
        raise InputError(f"{shard.path}: bad CSV: {exc}") from None
    return pa.schema([(n, pa.string() if pa.types.is_null(k.type) else k.type) for n, k in kinds.items()])


def csv_batches(shard: Shard) -> Iterator[Pair]:
    schema = csv_schema(shard)
    reader = _csv_reader(shard, pacsv.ConvertOptions(column_types=schema))
    pending: list[pa.RecordBatch] = []
    rows = 0
    try:
        for batch in reader:  # pyarrow's blocks: cut (or gathered) to CHUNK_ROWS
            pending.append(batch)
            rows += batch.num_rows
            while rows >= CHUNK_ROWS:
                table = pa.Table.from_batches(pending, reader.schema)
                yield table.slice(0, CHUNK_ROWS), None
                rest = table.slice(CHUNK_ROWS)
                pending, rows = rest.to_batches(), rest.num_rows
    except pa.ArrowInvalid as exc:
        raise InputError(f"{shard.path}: bad CSV: {exc}") from None
    if rows:
        yield pa.Table.from_batches(pending, reader.schema), None
