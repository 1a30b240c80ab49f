"""The input columns of a job's rows, as the sink joins them to the results.

The client (or the ingestor, for rows published without a reference) keeps a job's
input columns as blobs `in-<src>` (Arrow IPC files, `prefixflow/client/columns.py`); a result names
its row as (`src`, `row`). Before it writes a part, the sink fetches the blobs the part
needs into a local cache directory (one file per blob, memory-mapped when read, so a
table costs address space rather than memory), then takes each row's columns from there.
A job's files are removed when it is done; open tables are kept for the most recently
used blobs only (`MAX_OPEN`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path

import pyarrow as pa
import structlog
from nats.js import JetStreamContext

from prefixflow.shared.bus.blobs import BlobMissing, get_blob
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.ipc_size import MAGIC, NotArrowIpc, decompressed_bytes

log = structlog.get_logger()

MAX_OPEN = 64
"""Memory-mapped blob tables kept open (least recently used closed first)."""

MAX_INFLATE = 32 << 20
"""Bytes a blob may take once read beyond its own size. An uncompressed blob is memory-
mapped (it costs address space); a compressed one is read into memory, so the open
tables hold at most `MAX_OPEN` x this much. A blob over it (a few KB of ZSTD can claim
gigabytes) is refused like a missing one: its rows get null input columns, logged."""


def refusal(data: bytes) -> str | None:
    """Why the sink will not read blob `data` (None: it will): not Arrow IPC, or it
    decompresses past `MAX_INFLATE` (told from its headers, nothing decompressed)."""
    try:
        inflated = decompressed_bytes(data) - len(data)
    except NotArrowIpc as exc:
        return f"not an Arrow IPC file: {exc}"
    if inflated > MAX_INFLATE:
        return f"it decompresses to {inflated + len(data):,} bytes from {len(data):,}, past the sink's cap of {MAX_INFLATE:,} more"
    return None


def read_blob(path: Path) -> pa.Table:
    """A cached blob, memory-mapped, read as the stream of messages the file holds after
    its magic: the very messages `refusal` measured (a file's footer could point at
    others)."""
    buf = pa.memory_map(str(path)).read_buffer()
    if buf.size >= 8 and buf.slice(0, 6).to_pybytes() == MAGIC:
        buf = buf.slice(8)
    return pa.ipc.open_stream(buf).read_all()


class InputCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="pfx-sink-inputs-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.missing: set[tuple[str, int]] = set()
        """Blobs that could not be found (expired, purged): their rows get null inputs."""
        self.open: OrderedDict[tuple[str, int], pa.Table] = OrderedDict()

    def path(self, job: str, src: int) -> Path:
        return self.root / job / f"{m.input_blob(src)}.arrow"

    async def fetch(self, js: JetStreamContext, job: str, srcs: set[int]) -> None:
        """Bring the blobs `srcs` of `job` into the cache (those not there yet)."""
        for src in sorted(srcs):
            path = self.path(job, src)
            if src < 0 or path.exists() or (job, src) in self.missing:
                continue
            try:
                data = await get_blob(js, job, m.input_blob(src))
            except BlobMissing as exc:
                log.error("input columns not found: those rows get null input columns", job=job, src=src, error=str(exc))
                self.missing.add((job, src))
                continue
            if (why := refusal(data)) is not None:
                log.error("input columns refused: those rows get null input columns", job=job, src=src, reason=why)
                self.missing.add((job, src))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

    def table(self, job: str, src: int) -> pa.Table | None:
        """The record batch of blob `src` of `job` (None: no such blob)."""
        key = (job, src)
        table = self.open.pop(key, None)
        if table is None:
            path = self.path(job, src)
            if src < 0 or not path.exists():
                return None
            table = read_blob(path)
        self.open[key] = table
        while len(self.open) > MAX_OPEN:
            self.open.popitem(last=False)
        return table

    def drop(self, job: str) -> None:
        """Forget a job's blobs (it is done)."""
        for key in [k for k in self.open if k[0] == job]:
            del self.open[key]
        self.missing = {k for k in self.missing if k[0] != job}
        shutil.rmtree(self.root / job, ignore_errors=True)

    def close(self) -> None:
        self.open.clear()
        shutil.rmtree(self.root, ignore_errors=True)
