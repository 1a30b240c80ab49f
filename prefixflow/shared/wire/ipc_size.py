"""What an Arrow IPC blob takes once read, from its message headers alone.

A blob of a job's input columns (`prefixflow/client/columns.py`) is an Arrow IPC file.
Uncompressed, the sink memory-maps it: a read costs address space, not memory. A
compressed one (LZ4 or ZSTD buffers, which the IPC format allows and our writers never
use) is decompressed into memory by `read_all()`, and a few kilobytes can claim
gigabytes. Whoever can put a blob for a job could stall the sink for every job that way,
so the sink asks `decompressed_bytes` first and refuses a blob over its cap
(`prefixflow/services/sink/inputs.py`).

How: the file is the IPC stream after an 8-byte magic; each record batch (and dictionary
batch) message has a FlatBuffers header (`Message.fbs`: `Message.header` a
`RecordBatch` with its `buffers` and, when compressed, a `compression` table). In a
compressed body every buffer starts with its uncompressed length as a little-endian
int64 (-1: stored as is), so the sum of those is what the batch takes once read. Only
headers and those 8-byte prefixes are read; nothing is decompressed. A header that does
not parse is `NotArrowIpc`.
"""

from __future__ import annotations

import struct

import pyarrow as pa

MAGIC = b"ARROW1"
RECORD_BATCH, DICTIONARY_BATCH = 3, 2
"""`MessageHeader` union tags (Message.fbs)."""


class NotArrowIpc(ValueError):
    """The bytes are not an Arrow IPC file or stream this reader understands."""


class _Table:
    """A FlatBuffers table: fields by their index in the schema (vtable slots)."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        self.vtable = pos - _i32(buf, pos)
        self.vsize = _u16(buf, self.vtable)

    def _slot(self, field: int) -> int:
        at = 4 + 2 * field
        return _u16(self.buf, self.vtable + at) if at < self.vsize else 0

    def u8(self, field: int, default: int = 0) -> int:
        off = self._slot(field)
        return self.buf[self.pos + off] if off else default

    def table(self, field: int) -> _Table | None:
        off = self._slot(field)
        if not off:
            return None
        at = self.pos + off
        return _Table(self.buf, at + _u32(self.buf, at))

    def structs(self, field: int, size: int) -> list[int]:
        """Positions of a vector of structs of `size` bytes."""
        off = self._slot(field)
        if not off:
            return []
        at = self.pos + off
        vec = at + _u32(self.buf, at)
        n = _u32(self.buf, vec)
        if vec + 4 + n * size > len(self.buf):
            raise NotArrowIpc("a vector runs past its header")
        return [vec + 4 + i * size for i in range(n)]


def _u16(buf: bytes, at: int) -> int:
    return struct.unpack_from("<H", buf, at)[0]


def _u32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<I", buf, at)[0]


def _i32(buf: bytes, at: int) -> int:
    return struct.unpack_from("<i", buf, at)[0]


def _i64(buf, at: int) -> int:
    return struct.unpack_from("<q", buf, at)[0]


def batch_bytes(metadata: bytes, body: bytes | pa.Buffer | memoryview) -> int:
    """What one message's body takes once read (0 for a schema message)."""
    try:
        message = _Table(metadata, _u32(metadata, 0))
        kind = message.u8(1)
        header = message.table(2)
        if header is not None and kind == DICTIONARY_BATCH:
            kind, header = RECORD_BATCH, header.table(1)
        if kind != RECORD_BATCH or header is None:
            return 0
        compressed = header.table(3) is not None
        size = len(body)
        total = 0
        for at in header.structs(2, 16):  # struct Buffer { offset: long; length: long; }
            offset, length = _i64(metadata, at), _i64(metadata, at + 8)
            if offset < 0 or length < 0 or offset + length > size:
                raise NotArrowIpc("a buffer lies outside its message body")
            if not compressed or length == 0:
                total += length
                continue
            if length < 8:
                raise NotArrowIpc("a compressed buffer without its length prefix")
            raw = _i64(body, offset)
            total += length - 8 if raw == -1 else raw
            if raw < -1:
                raise NotArrowIpc("a negative uncompressed length")
        return total
    except (struct.error, IndexError) as exc:
        raise NotArrowIpc(f"a message header does not parse: {exc}") from exc


def decompressed_bytes(data: bytes | pa.Buffer) -> int:
    """Bytes the record batches of an Arrow IPC file or stream take once read."""
    buf = pa.py_buffer(data) if isinstance(data, bytes) else data
    start = 8 if buf.size >= 8 and buf.slice(0, 6).to_pybytes() == MAGIC else 0
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.BufferReader(buf.slice(start)))
        total = 0
        while True:
            try:
                msg = reader.read_next_message()
            except StopIteration:
                break
            if msg is None:
                break
            if msg.type in ("record batch", "dictionary batch"):
                body = msg.body
                total += batch_bytes(msg.metadata.to_pybytes(), memoryview(body) if body is not None else b"")
        return total
    except (pa.ArrowException, OSError) as exc:  # pyarrow's reader: ArrowInvalid, or OSError for a bad length
        raise NotArrowIpc(str(exc)) from exc
