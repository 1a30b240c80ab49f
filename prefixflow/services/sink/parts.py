"""A job's Parquet files on disk: durable small parts, merged into files of ~a target size.

Names in a job's `out_dir`:
    part-000000-000099.parquet   a merged file: the rows of small parts 0..99, in order
    part-000100.parquet          a small part: the rows of one flush (not merged yet)
    .part-000100.parquet.tmp     a file being written (a crash leaves it: deleted on open)
    .part-000000-000099.ready    a merged file complete on disk whose small parts are
                                 being deleted (a crash leaves it: finished on open)
    _common_metadata             the job's schema so far (`growth.RECORD`)
`pyarrow.parquet.read_table(out_dir)` skips names starting with `.` or `_`.

Every file is written to a temporary name, fsynced and renamed, so a crash never leaves
a torn one. A merge never lets a reader see a row twice: the merged file keeps a hidden
name until its small parts are gone, and `recover` finishes an interrupted merge (and
deletes any small part inside a merged file's range) before the files are read.
"""

from __future__ import annotations

import ctypes
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.services.sink.growth import RECORD, int_id_mask, with_int_ids
from prefixflow.services.sink.schema import OUTPUT_TYPES
from prefixflow.shared.widening import conform

PART_NAME = re.compile(r"part-(\d+)(?:-(\d+))?\.parquet")
READY_NAME = re.compile(r"\.part-(\d+)-(\d+)\.ready")
ROW_GROUP_BYTES = 4 << 20
"""A merged file's row groups hold about this many bytes of Arrow data (tiny parts are
combined). The merge's memory grows with it (about 9x: reading, concatenating, encoding):
merging 700 small parts peaked at +37 MB with 4 MiB, +62 MB with 8, +97 MB with 16, and
with 64 MiB the sink's RSS doubled at the end of a 10M-row job (`prefixflow bench soak`)."""


@dataclass(frozen=True)
class Part:
    """One Parquet file of a job: the small parts `first`..`last` (one for a small part)."""

    first: int
    last: int
    path: Path
    merged: bool


def small_name(n: int) -> str:
    return f"part-{n:06d}.parquet"


def merged_name(first: int, last: int) -> str:
    return f"part-{first:06d}-{last:06d}.parquet"


def scan(out_dir: Path) -> list[Part]:
    """The job's Parquet files, in part order."""
    found = []
    for path in out_dir.glob("part-*.parquet"):
        if (m := PART_NAME.fullmatch(path.name)) is not None:
            first = int(m.group(1))
            found.append(Part(first, int(m.group(2) or first), path, m.group(2) is not None))
    return sorted(found, key=lambda p: (p.first, p.last))


def data_bytes(path: Path) -> int:
    """A Parquet file's size less its footer (schema and statistics, per file: several KiB
    for a wide schema): about what its rows add to a merged file."""
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size - 8)
        footer = int.from_bytes(f.read(4), "little")
    return max(size - footer - 12, 0)


def fsync_dir(path: Path) -> None:
    """Make the renames and deletions in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def recover(out_dir: Path) -> list[Part]:
    """Clean up after a crash, then the job's files: temporary files deleted, a merge
    that was deleting its small parts finished, a small part inside a merged file's range
    (a merge's leftover) deleted. Then every row is in exactly one file."""
    changed = False
    for path in list(out_dir.iterdir()):
        if path.name.endswith(".tmp") and path.name.lstrip(".").startswith("part-"):
            path.unlink(missing_ok=True)
            changed = True
    for path in list(out_dir.glob(".part-*.ready")):
        if (m := READY_NAME.fullmatch(path.name)) is not None:
            first, last = int(m.group(1)), int(m.group(2))
            _drop_smalls(out_dir, first, last)
            os.replace(path, out_dir / merged_name(first, last))
            changed = True
    files = scan(out_dir)
    for merged in [p for p in files if p.merged]:
        for p in files:
            if not p.merged and merged.first <= p.first <= merged.last:
                p.path.unlink(missing_ok=True)
                changed = True
    if changed:
        fsync_dir(out_dir)
        files = scan(out_dir)
    return files


def _drop_smalls(out_dir: Path, first: int, last: int) -> None:
    for p in scan(out_dir):
        if not p.merged and first <= p.first <= last:
            p.path.unlink(missing_ok=True)


def release_memory() -> None:
    """Return freed memory to the OS: Arrow's pool, and glibc's heaps (the merge runs in a
    worker thread, whose malloc arena glibc otherwise keeps)."""
    pa.default_memory_pool().release_unused()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def write_part(table: pa.Table, out_dir: Path, n: int) -> Part:
    """Write small part `n` durably (temporary name, fsync, rename, fsync the directory)."""
    final = out_dir / small_name(n)
    tmp = out_dir / f".{final.name}.tmp"
    try:
        pq.write_table(table, tmp)
        _fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a disk full: what was written of it goes, not left taking the room
        raise
    os.replace(tmp, final)
    fsync_dir(out_dir)
    return Part(n, n, final, False)


def merge(smalls: list[Part], out_dir: Path, schema: pa.Schema, row_group_bytes: int = ROW_GROUP_BYTES) -> Part:
    """Merge these small parts (consecutive in part order), streaming one at a time, into
    one file named by their range, then delete them. Rows keep their order and are
    widened to `schema` (the job's, grown from theirs); tiny parts are combined into row
    groups of about `row_group_bytes`."""
    first, last = smalls[0].first, smalls[-1].last
    tmp = out_dir / f".{merged_name(first, last)}.tmp"
    ready = out_dir / f".part-{first:06d}-{last:06d}.ready"
    try:
        with pq.ParquetWriter(tmp, _file_schema(schema, [p.path for p in smalls])) as writer:
            held: list[pa.Table] = []
            size = 0
            for part in smalls:
                table = conform(pq.ParquetFile(part.path).read(), schema)
                held.append(table)
                size += table.nbytes
                if size >= row_group_bytes:
                    _write_group(writer, held)
                    held, size = [], 0
            _write_group(writer, held)
        _fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        release_memory()  # the merge's buffers go back to the OS, not kept by the allocators
    # 1. complete on disk under a hidden name; 2. the small parts go; 3. it is shown.
    os.replace(tmp, ready)
    fsync_dir(out_dir)
    for part in smalls:
        part.path.unlink(missing_ok=True)
    final = out_dir / merged_name(first, last)
    os.replace(ready, final)
    fsync_dir(out_dir)
    return Part(first, last, final, True)


def _file_schema(schema: pa.Schema, paths: list[Path]) -> pa.Schema:
    """The schema of a file of these files' rows: with which ids were integers, if its
    id column is text (read from their footers only then)."""
    if "id" not in schema.names or not pa.types.is_string(schema.field("id").type):
        return schema
    return with_int_ids(schema, _int_ids(paths))


def _int_ids(paths: list[Path]) -> np.ndarray:
    """Which rows of these files, in order, had integer ids (their footers)."""
    masks = []
    for path in paths:
        pf = pq.ParquetFile(path)
        masks.append(int_id_mask(pf.schema_arrow, pf.metadata.num_rows))
    return np.concatenate(masks) if masks else np.zeros(0, bool)


def rewrite(part: Part, schema: pa.Schema) -> None:
    """Rewrite a file written under a narrower schema under `schema`, one row group at a
    time, in place: a temporary name, fsync, then renamed over the old file (a reader or
    a crash sees the old file or the new one, both with every row)."""
    tmp = part.path.parent / f".{part.path.name}.tmp"
    try:
        pf = pq.ParquetFile(part.path)
        with pq.ParquetWriter(tmp, _file_schema(schema, [part.path])) as writer:
            for i in range(pf.num_row_groups):
                table = conform(pf.read_row_group(i), schema)
                writer.write_table(table, row_group_size=max(table.num_rows, 1))
        _fsync(tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        release_memory()
    os.replace(tmp, part.path)
    fsync_dir(part.path.parent)


def write_record(out_dir: Path, schema: pa.Schema) -> None:
    """The job's schema so far as `_common_metadata` (tmp, fsync, rename)."""
    tmp = out_dir / f".{RECORD}.tmp"
    pq.write_metadata(schema, tmp)
    _fsync(tmp)
    os.replace(tmp, out_dir / RECORD)
    fsync_dir(out_dir)


def _write_group(writer: pq.ParquetWriter, tables: list[pa.Table]) -> None:
    if not tables:
        return
    table = pa.concat_tables(tables)
    if table.num_rows:
        writer.write_table(table, row_group_size=table.num_rows)


def empty_part_schema(schema: pa.Schema | None) -> pa.Schema:
    """The schema of a job's empty part: the job's own if a part fixed it, else `id` and
    the generated columns."""
    if schema is not None:
        return schema
    return pa.schema([("id", pa.int64()), *OUTPUT_TYPES.items()])


def write_empty_part(out_dir: Path, schema: pa.Schema | None = None, name: str = "part-000000.parquet") -> Path:
    """A Parquet part with no rows (a job of 0 prompts), so `pyarrow.parquet.read_table`
    of the directory gives an empty table with the job's columns. tmp, fsync, rename."""
    final = out_dir / name
    tmp = final.with_suffix(".tmp")
    pq.write_table(empty_part_schema(schema).empty_table(), tmp)
    _fsync(tmp)
    os.replace(tmp, final)
    fsync_dir(out_dir)
    return final
