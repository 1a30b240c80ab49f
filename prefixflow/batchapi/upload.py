"""Receiving a file upload (`POST /v1/files`) with its size checked while it streams.

Starlette's form parsing (what FastAPI's `UploadFile` gives) reads the whole body before
the handler sees it: a 5 GB upload was spooled to disk in full before the size check
refused it. Here the multipart body is parsed as it arrives (Starlette's own parser,
fed by a stream that counts): a `Content-Length` over the limit is refused before a byte
is read, and a body without one (chunked) is refused as soon as its file part passes the
limit, so at most `limit` bytes (plus one chunk) are ever read or spooled. The file part
goes to a spooled temporary file (memory up to 1 MiB, then disk) from which the object
store reads it in chunks. Its lines (newlines) are counted on the way, so `create_batch`
can refuse a file of too many requests without reading it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO

from nats.js.errors import APIError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

FORM_SLACK = 64 << 10
"""Bytes of a multipart body beyond its file: boundaries, part headers, the `purpose` field."""
STORE_FULL_CODES = frozenset({10047, 10077})
"""JetStream error codes of a store out of room (insufficient resources; maximum bytes exceeded)."""


class TooLarge(Exception):
    """The upload passed the limit (`seen`: bytes read when it was refused)."""

    def __init__(self, seen: int, limit: int) -> None:
        super().__init__(f"file of more than {limit} bytes is over the limit of {limit}")
        self.seen, self.limit = seen, limit


class BadForm(ValueError):
    """The body is not the multipart form an upload is (`file` and `purpose`)."""


@dataclass
class Upload:
    file: BinaryIO
    """The file's bytes (a spooled temporary file, at its start)."""
    filename: str
    purpose: str
    size: int
    lines: int
    """Newline-terminated lines (a last line without one counts too; blank lines count)."""


class _CountingParser(MultiPartParser):
    """Starlette's multipart parser that counts the file part's bytes and lines as they
    arrive and stops at `limit`."""

    def __init__(self, headers, stream, limit: int) -> None:
        super().__init__(headers, stream, max_files=1, max_fields=8, max_part_size=FORM_SLACK)
        self.limit, self.size, self.lines, self.last = limit, 0, 0, b"\n"

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._current_part.file is not None and end > start:
            self.size += end - start
            if self.size > self.limit:
                raise TooLarge(self.size, self.limit)
            self.lines += data.count(b"\n", start, end)
            self.last = data[end - 1:end]
        super().on_part_data(data, start, end)


async def receive(request: Request, limit: int) -> Upload:
    """The upload of `request` (TooLarge past `limit` bytes of file; BadForm for a body
    that is not an upload form)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + FORM_SLACK:
        raise TooLarge(int(length), limit)  # refused before a byte is read
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise BadForm("want a multipart/form-data body with 'file' and 'purpose'")
    read = 0

    async def stream():
        nonlocal read
        async for chunk in request.stream():
            read += len(chunk)
            if read > limit + FORM_SLACK:  # a body of fields or of anything else
                raise TooLarge(read, limit)
            yield chunk

    parser = _CountingParser(request.headers, stream(), limit)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadForm(f"not a multipart upload: {exc.message}") from None
    file, purpose = form.get("file"), form.get("purpose")
    if not isinstance(file, UploadFile) or not isinstance(purpose, str):
        await form.close()
        raise BadForm("want the fields 'file' (a file) and 'purpose'")
    lines = parser.lines + (parser.size > 0 and parser.last != b"\n")
    file.file.seek(0)
    return Upload(file.file, file.filename or "upload.jsonl", purpose, parser.size, lines)


def store_full(exc: BaseException) -> bool:
    """The files store (or the server's storage) has no room for this write."""
    if not isinstance(exc, APIError):
        return False
    text = (exc.description or "").lower()
    return exc.err_code in STORE_FULL_CODES or "maximum bytes" in text or "insufficient" in text
