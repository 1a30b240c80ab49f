"""The fingerprint of a job's input, by kind of source: what it holds, not where or
when it was written (a copy, or a fresh download of the same bytes, is the same job).

- every kind: the file's size and sampled blocks of `BLOCK` bytes: the first, the last
  and evenly spaced ones between, `BLOCKS` in all (a file up to `BLOCKS * BLOCK` bytes,
  4 MiB, is hashed whole). Reading 4 MiB whatever the size keeps it cheap at 10M rows;
- Parquet, also its footer (the serialized `FileMetaData` pyarrow reads: schema, row
  groups with their column chunks' sizes and statistics, key-value metadata), read
  whole whatever its size: one value changed in a big file shows in the sizes or the
  statistics of its column chunk unless both stay the same; then only a changed
  sampled block tells.

An input of several files (a directory, a glob: `prefixflow/client/sources.py`), wherever
they are (local, `s3://`, `gs://`), is a `dataset`: the digest of every file's name (below
the input's root) and size in name order, and of the fingerprints above of up to
`DATASET_SAMPLES` of its files evenly spaced in that order (the first and the last
included), each with 2 sampled blocks (plus its Parquet footer). That bounds the reads of
an input of 10,000 objects to a few hundred ranges; an edit that keeps every file's name
and size is seen only in a sampled file. A single file (local or an object) is
fingerprinted as above, so a file and its copy in a bucket are the same input.

An in-memory input of the Python API (a table, a DataFrame, batches: kind `arrow`) has
a hash of its rows computed while reading it (`prefixflow/client/memory.py`).

So an edit of a large JSONL/CSV file that keeps its size and falls between the sampled
blocks (or one of a large Parquet file that keeps every footer value) is not seen: the
job is taken as the same one and resumed. `--overwrite` (or another `--out`) runs it
fresh. The scheme number changes with the rule, and a fingerprint of another scheme is
"unknown", never a difference. Pure apart from reading the file.
"""

from __future__ import annotations

import hashlib
import io
import struct
from pathlib import Path
from typing import Any, BinaryIO

from prefixflow.client.sources import Source, resolve
from prefixflow.shared.wire.fingerprint import Fingerprint, spec_fields
from prefixflow.shared.wire.messages import JobSpec

BLOCK = 64 * 1024
BLOCKS = 64
DATASET_SAMPLES = 64
"""Files of a dataset whose content is sampled."""
SCHEME = 1
"""The rule above; raise it when the rule changes."""
KINDS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl",
         ".csv": "csv"}
PARQUET_MAGIC = b"PAR1"


def block_offsets(size: int, block: int = BLOCK, blocks: int = BLOCKS) -> list[int]:
    """Where the sampled blocks start: every block of a small file; else `blocks` of them,
    the first at 0, the last ending at the file's end, evenly spaced between."""
    if size <= block * blocks:
        return list(range(0, size, block))
    last = size - block
    return [i * last // (blocks - 1) for i in range(blocks)]


def parquet_footer(f: BinaryIO, size: int) -> bytes:
    """The Parquet footer (thrift `FileMetaData`) as stored; b"" if the file does not end
    like a Parquet file (the input reader says what is wrong with it)."""
    if size < 12:
        return b""
    f.seek(size - 8)
    tail = f.read(8)
    length = struct.unpack("<I", tail[:4])[0]
    if tail[4:] != PARQUET_MAGIC or length > size - 12:
        return b""
    f.seek(size - 8 - length)
    return f.read(length)


def of_input(path: str | Path, *, block: int = BLOCK, blocks: int = BLOCKS) -> dict[str, Any]:
    """The input part of a job's fingerprint (`Fingerprint.input`) of the file at `path`
    (its kind by its suffix); `block`, `blocks`: the sampling (tests use small ones)."""
    path = Path(path)
    with path.open("rb") as f:
        return of_stream(f, KINDS.get(path.suffix.lower(), "file"), block=block, blocks=blocks)


def of_stream(f: BinaryIO, kind: str, *, block: int = BLOCK, blocks: int = BLOCKS) -> dict[str, Any]:
    """`of_input` of a seekable binary file of `kind`."""
    size = f.seek(0, io.SEEK_END)
    digest = hashlib.sha256(f"{kind}/{SCHEME}/{size}\n".encode())
    if kind == "parquet":
        footer = parquet_footer(f, size)
        digest.update(len(footer).to_bytes(8, "little") + footer)
    for offset in block_offsets(size, block, blocks):
        f.seek(offset)
        digest.update(f.read(block))
    return {"kind": kind, "scheme": SCHEME, "size": size, "digest": digest.hexdigest()}


def sampled(n: int, samples: int = DATASET_SAMPLES) -> list[int]:
    """Which of `n` files a dataset's fingerprint samples: all up to `samples`, else
    `samples` of them evenly spaced, the first and the last included."""
    if n <= samples:
        return list(range(n))
    return sorted({i * (n - 1) // (samples - 1) for i in range(samples)})


def of_source(source: Source, *, block: int = BLOCK, blocks: int = BLOCKS) -> dict[str, Any]:
    """The input part of a job's fingerprint of a resolved input (see the module docstring)."""
    if len(source.shards) == 1 and source.shards[0].format == "arrow":  # computed while reading it
        return source.shards[0].fingerprint
    if source.single:
        shard = source.shards[0]
        with shard.open_file() as f:
            return of_stream(f, shard.format, block=block, blocks=blocks)
    shards = source.shards
    digest = hashlib.sha256(f"dataset/{SCHEME}/{len(shards)}\n".encode())
    for shard in shards:
        digest.update(f"{shard.name}\0{shard.size}\n".encode())
    for i in sampled(len(shards)):
        with shards[i].open_file() as f:
            digest.update(of_stream(f, shards[i].format, block=block, blocks=2)["digest"].encode())
    return {"kind": "dataset", "scheme": SCHEME, "size": sum(s.size for s in shards), "files": len(shards),
            "digest": digest.hexdigest()}


def of_job(source: str | Path | Source, spec: JobSpec) -> Fingerprint:
    """A job's fingerprint: its input's and its spec's."""
    source = source if isinstance(source, Source) else resolve(source)
    return Fingerprint(input=of_source(source), spec=spec_fields(spec))
