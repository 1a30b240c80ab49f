"""A job's grown schema as its files hold it (the rules: `prefixflow/shared/widening.py`).

- Each file's columns, as kinds to join (`file_kinds`): its footer's types, and for an
  integer column whether it holds a value past +-2^53, from the row groups' statistics
  (the column is read only where a row group has none).
- The ids of a text id column keep their type: a file whose `id` column is text (ids
  given as integers and strings in one job, `5` and `"5"` two rows) records which rows'
  ids were integers in its footer's key-value metadata (`INT_IDS`: a bitmap), so a
  restarted sink reads each id back as it was given (`typed_ids`) and dedupes `5` and
  `"5"` as two ids.
"""

from __future__ import annotations

import base64
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.shared.widening import Kind, int_is_safe, kind_of_array

INT_IDS = b"prefixflow.int_ids"
"""Footer key: zlib'd little-endian bitmap, bit i set when row i's id was an integer."""
RECORD = "_common_metadata"
"""The job's schema so far, in its `out_dir` (a Parquet file of no rows, the usual name
for a dataset's common schema): `pq.read_schema(OUT / "_common_metadata")`."""


class RewriteFailed(Exception):
    """A file of a finished job could not be rewritten under its final schema (every row
    is on disk already; the job is finished again next round)."""


def int_id_mask(schema: pa.Schema, rows: int) -> np.ndarray:
    """Which rows of a file (its schema, with metadata) had integer ids."""
    t = schema.field("id").type
    if pa.types.is_integer(t):
        return np.ones(rows, bool)
    raw = (schema.metadata or {}).get(INT_IDS)
    if raw is None:
        return np.zeros(rows, bool)
    bits = np.frombuffer(zlib.decompress(base64.b64decode(raw)), np.uint8)
    return np.unpackbits(bits, count=rows, bitorder="little").astype(bool)


def with_int_ids(schema: pa.Schema, mask: np.ndarray) -> pa.Schema:
    """`schema` for a file of these rows: with `INT_IDS` where its id column is text and
    some id was an integer."""
    if "id" not in schema.names or pa.types.is_integer(schema.field("id").type) or not mask.any():
        return schema
    bits = np.packbits(mask, bitorder="little").tobytes()
    return schema.with_metadata({**(schema.metadata or {}), INT_IDS: base64.b64encode(zlib.compress(bits))})


def typed_ids(column: pa.ChunkedArray | pa.Array, mask: np.ndarray) -> np.ndarray | list:
    """A file's ids as they were given (a numpy array for an integer column)."""
    if pa.types.is_integer(column.type) and column.null_count == 0:
        return column.to_numpy()
    values = column.to_pylist()
    if pa.types.is_integer(column.type) or not mask.any():
        return values
    return [int(v) if is_int and v is not None else v for v, is_int in zip(values, mask.tolist())]


def file_kinds(path: Path) -> dict[str, Kind]:
    """The kinds of a file's columns (footer and statistics; a column read only where its
    statistics are missing)."""
    pf = pq.ParquetFile(path)
    meta = pf.metadata
    kinds = {}
    for f in pf.schema_arrow:
        if not pa.types.is_integer(f.type):
            kinds[f.name] = Kind(f.type)
            continue
        safe = True
        for rg in range(meta.num_row_groups):
            group = meta.row_group(rg)
            col = next((group.column(j) for j in range(group.num_columns) if group.column(j).path_in_schema == f.name), None)
            stats = col.statistics if col is not None else None
            if stats is None or not stats.has_min_max:
                if stats is not None and stats.null_count == group.num_rows:
                    continue  # all null
                return {**kinds, **_read_kinds(pf, [n for n in pf.schema_arrow.names if n not in kinds])}
            if not (int_is_safe(int(stats.min)) and int_is_safe(int(stats.max))):
                safe = False
                break
        kinds[f.name] = Kind(f.type, not safe)
    return kinds


def _read_kinds(pf: pq.ParquetFile, names: list[str]) -> dict[str, Kind]:
    table = pf.read(columns=names)
    return {n: kind_of_array(table.column(n)) for n in names}
