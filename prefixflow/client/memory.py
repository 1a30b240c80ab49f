"""In-memory inputs of the Python API: a `pyarrow.Table` (or `RecordBatch`), a pandas or
Polars DataFrame, or an iterable of record batches, as a `Source` the submit path reads
like a file (`prefixflow/client/readers.py`: format `arrow`).

- Every kind is read in batches of `CHUNK_ROWS` rows (batches of one schema are gathered
  or cut to that size, so the rows of each stored chunk do not depend on how the caller
  chunked its data): memory is the caller's data plus one batch. pandas and Polars are
  never imported: a DataFrame is recognised by its type's module (duck typing) and
  converted a slice at a time (`pyarrow.RecordBatch.from_pandas`, `iter_slices`).
- The input's fingerprint (`prefixflow/client/fingerprint.py`, kind `arrow`) is a hash
  computed while reading it: of each batch's Arrow IPC bytes, in order, after copying it
  compactly (`take`), so the same rows with the same schema hash the same however they
  were sliced or chunked. A Table or a DataFrame can be read twice: it is hashed in a
  first pass (nothing kept), then read again to be published. An iterator can be read
  once: it is spooled batch by batch to Arrow IPC files in a temporary directory
  (deleted when the `Source` is collected, at the latest at exit), hashed on the way,
  and published from there. So the
  fingerprint is known before the job is created, and a re-run of the same data into the
  same output is "already done" and other data refused, by the rules of a file input;
  checking after publishing instead would mix two inputs' rows in one output on a
  mismatch.
"""

from __future__ import annotations

import hashlib
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs

from prefixflow.client.columns import INPUT_COLUMNS
from prefixflow.client.readers import CHUNK_ROWS
from prefixflow.client.sources import InputError, Shard, Source

SCHEME = 1
"""The hashing rule above; raise it when the rule changes."""


@dataclass(frozen=True)
class ArrowShard(Shard):
    """An in-memory input as the one shard of its `Source` (format `arrow`)."""

    open_batches: Callable[[], Iterator[pa.RecordBatch]] | None = field(default=None, repr=False, compare=False)
    """A fresh pass over its batches (`CHUNK_ROWS` rows each)."""
    rows: int = 0
    fingerprint: dict[str, Any] = field(default_factory=dict, compare=False)
    """The input part of its job's fingerprint (`Fingerprint.input`)."""
    spool: Any = field(default=None, repr=False, compare=False)
    """The temporary directory a one-shot iterator was spooled to (deleted with it)."""


def kind_of(obj: Any) -> str | None:
    """Which in-memory input `obj` is: table, pandas, polars, batches; None: not one (a path
    or a URI, or something else)."""
    if isinstance(obj, (str, bytes, Path)) or hasattr(obj, "__fspath__"):
        return None
    if isinstance(obj, (pa.Table, pa.RecordBatch)):
        return "table"
    package = type(obj).__module__.split(".", 1)[0]
    if package == "pandas" and hasattr(obj, "iloc"):
        return "pandas"
    if package == "polars" and hasattr(obj, "iter_slices"):
        return "polars"
    if package == "polars" and hasattr(obj, "collect"):
        raise InputError("a Polars LazyFrame: collect() it first (or pass an iterator of its record batches)")
    if isinstance(obj, pa.RecordBatchReader) or hasattr(obj, "__arrow_c_stream__") or isinstance(obj, Iterable):
        return "batches"
    return None


def _strip(batch: pa.RecordBatch) -> pa.RecordBatch:
    """Without schema metadata (pandas' index description): the output keeps the columns."""
    return batch.replace_schema_metadata(None) if batch.schema.metadata else batch


def _table_batches(table: pa.Table | pa.RecordBatch) -> Iterator[pa.RecordBatch]:
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    return iter(table.to_batches())


def _pandas_batches(df: Any) -> Iterator[pa.RecordBatch]:
    schema = pa.Schema.from_pandas(df, preserve_index=False)
    for start in range(0, len(df), CHUNK_ROWS):
        yield pa.RecordBatch.from_pandas(df.iloc[start : start + CHUNK_ROWS], schema=schema, preserve_index=False)


def _polars_batches(df: Any) -> Iterator[pa.RecordBatch]:
    for piece in df.iter_slices(CHUNK_ROWS):
        yield from piece.to_arrow().to_batches()


def _stream_batches(obj: Any) -> Iterator[pa.RecordBatch]:
    """An iterable of record batches (or tables), a `RecordBatchReader`, or any object of
    the Arrow C stream protocol (DuckDB, ...)."""
    if not isinstance(obj, pa.RecordBatchReader) and hasattr(obj, "__arrow_c_stream__"):
        obj = pa.RecordBatchReader.from_stream(obj)
    for n, item in enumerate(obj):
        if isinstance(item, pa.RecordBatch):
            yield item
        elif isinstance(item, pa.Table):
            yield from item.to_batches()
        else:
            raise InputError(f"item {n} of the input is a {type(item).__name__}, not a pyarrow.RecordBatch")


def rebatched(batches: Iterable[pa.RecordBatch], rows: int = CHUNK_ROWS) -> Iterator[pa.RecordBatch]:
    """`batches` as batches of `rows` rows (the last of each run of one schema shorter),
    without schema metadata; empty batches dropped."""
    pending: list[pa.RecordBatch] = []
    held = 0

    def flush(upto: int) -> Iterator[pa.RecordBatch]:
        nonlocal pending, held
        table = pa.Table.from_batches(pending)
        for start in range(0, upto, rows):
            piece = table.slice(start, min(rows, upto - start)).combine_chunks()
            yield from piece.to_batches()
        rest = table.slice(upto)
        pending, held = ([b for b in rest.to_batches() if b.num_rows], rest.num_rows)

    for batch in batches:
        batch = _strip(batch)
        if not batch.num_rows:
            continue
        if pending and batch.schema != pending[0].schema:
            yield from flush(held)
        pending.append(batch)
        held += batch.num_rows
        if held >= rows:
            yield from flush(held - held % rows)
    if held:
        yield from flush(held)


def batch_digest(batch: pa.RecordBatch) -> bytes:
    """A batch's Arrow IPC stream bytes (schema and rows), copied compactly first."""
    compact = batch.take(pa.array(range(batch.num_rows), pa.int64()))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, compact.schema) as writer:
        writer.write_batch(compact)
    return hashlib.sha256(sink.getvalue()).digest()


class Hasher:
    """The fingerprint of an in-memory input, fed its batches in order; each batch's
    columns checked on the way (`InputError`: no model input column, an `id` column in
    some batches only), so a bad input fails before a job is created."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.digest = hashlib.sha256(f"arrow/{SCHEME}\n".encode())
        self.rows = 0
        self.has_id: bool | None = None

    def update(self, batch: pa.RecordBatch) -> None:
        names = batch.schema.names
        if not set(INPUT_COLUMNS) & set(names):
            raise InputError(f"{self.name}: no 'prompt', 'messages' or 'prompt_token_ids' column (columns: {names})")
        if self.has_id is not None and self.has_id != ("id" in names):
            raise InputError(f"{self.name}: an 'id' column in some batches and not in others (rows {self.rows}...)")
        self.has_id = "id" in names
        self.digest.update(batch_digest(batch))
        self.rows += batch.num_rows

    def fingerprint(self) -> dict[str, Any]:
        # NOTE: "size" is the row count (an in-memory input has no file size): a difference says
        # "N bytes, not M" of rows; the digest decides.
        return {"kind": "arrow", "scheme": SCHEME, "size": self.rows, "digest": self.digest.hexdigest()}


def _spool(batches: Iterator[pa.RecordBatch], name: str) -> tuple[tempfile.TemporaryDirectory, list[Path], Hasher]:
    """Write a one-shot stream to IPC files (a new file where the schema changes), hashing."""
    spool = tempfile.TemporaryDirectory(prefix="pfx-input-")
    files: list[Path] = []
    hasher = Hasher(name)
    writer, schema = None, None
    try:
        for batch in batches:
            if writer is None or batch.schema != schema:
                if writer is not None:
                    writer.close()
                files.append(Path(spool.name) / f"{len(files):06d}.arrow")
                writer, schema = pa.ipc.new_file(str(files[-1]), batch.schema), batch.schema
            hasher.update(batch)
            writer.write_batch(batch)
    except BaseException:
        spool.cleanup()
        raise
    finally:
        if writer is not None:
            writer.close()
    return spool, files, hasher


def _read_spool(files: list[Path]) -> Iterator[pa.RecordBatch]:
    for path in files:
        with pa.memory_map(str(path)) as source:
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)


def memory_source(obj: Any, name: str | None = None) -> Source:
    """An in-memory input as a `Source` of one `ArrowShard` (see the module docstring);
    `name`: how messages and default job ids call it. `InputError`: not an input, or no
    rows."""
    kind = kind_of(obj)
    if kind is None:
        raise InputError(f"a {type(obj).__name__} is not an input: pass a path or URI, a pyarrow.Table, a pandas or "
                         "Polars DataFrame, or an iterator of pyarrow.RecordBatch")
    name = name or {"table": "table", "pandas": "dataframe", "polars": "dataframe"}.get(kind, "batches")
    spool = None
    if kind == "batches":
        spool, files, hasher = _spool(rebatched(_stream_batches(obj)), name)

        def again() -> Iterator[pa.RecordBatch]:
            return _read_spool(files)
    else:
        first = {"table": _table_batches, "pandas": _pandas_batches, "polars": _polars_batches}[kind]

        def again() -> Iterator[pa.RecordBatch]:
            return rebatched(first(obj))

        hasher = Hasher(name)
        for batch in again():  # the first pass: the fingerprint (nothing kept)
            hasher.update(batch)
    if not hasher.rows:
        if spool is not None:
            spool.cleanup()
        raise InputError(f"{name}: no rows")
    shard = ArrowShard(pafs.LocalFileSystem(), f"<{name}>", name, 0, "arrow", open_batches=again, rows=hasher.rows,
                       fingerprint=hasher.fingerprint(), spool=spool)
    return Source(name, (shard,), False)
