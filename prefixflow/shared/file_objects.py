"""Where the batch service's files live: the JetStream object store (`subjects.FILES_OBJ`,
the default) or a prefix in an object store (`--files-uri s3://bucket/prefix`), for
batches larger than the NATS servers should hold.

Both hold the same objects under the same names: uploads (`file-...`), a batch's parsed
input and error file, and the results the sink exports for a batch job
(`<job>/output.jsonl`, `<job>/errors.jsonl`). The batch API and the sink must name the same
place (`PFX_FILES_URI`; `prefixflow cluster config --files-uri` writes it into every node's
env). An object store is reached with the process's own credentials (the AWS SDK's chain
and `AWS_ENDPOINT_URL`, as for outputs: `prefixflow/shared/outputs.py`), never with anything
from a message; object names are the service's own (ids it made), never a client's.

Each object is written whole (`put` streams into one upload: S3 shows an object only once
its upload completes) and read in chunks (`read_into`), so neither side holds a file in
memory.
"""

from __future__ import annotations

import asyncio
import re
from typing import BinaryIO, Protocol

from nats.js.errors import NotFoundError

from prefixflow.shared.bus.objects import read_object
from prefixflow.shared.outputs import filesystem, object_prefix
from prefixflow.shared.wire import subjects

CHUNK = 4 * 1024 * 1024
"""Bytes read or written at a time."""
NAME = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")
"""An object's name: the service's ids and fixed file names, `/`-separated, no `..`."""


class FileObjects(Protocol):
    where: str

    async def put(self, name: str, data: BinaryIO) -> int:
        """Store `data` (read to its end) as `name`, replacing it; its size."""
        ...

    async def read_into(self, name: str, into: BinaryIO) -> int:
        """Write object `name` into `into`; its size. `FileNotFoundError` if there is none."""
        ...

    async def delete(self, name: str) -> None:
        """Delete `name` (none: nothing to do)."""
        ...

    async def size(self, name: str) -> int | None:
        """The object's size (None: there is none)."""
        ...


def copy(src, dst) -> int:
    """`src` to its end into `dst`, `CHUNK` bytes at a time; the bytes copied."""
    size = 0
    while chunk := src.read(CHUNK):
        dst.write(chunk)
        size += len(chunk)
    return size


def checked(name: str) -> str:
    if not NAME.fullmatch(name) or ".." in name.split("/"):
        raise ValueError(f"not an object name: {name!r}")
    return name


class NatsObjects:
    """The JetStream object store `subjects.FILES_OBJ`."""

    where = f"the NATS object store {subjects.FILES_OBJ}"

    def __init__(self, js) -> None:
        self.js = js
        self.store = None

    async def _store(self):
        if self.store is None:
            self.store = await self.js.object_store(subjects.FILES_OBJ)
        return self.store

    async def put(self, name: str, data: BinaryIO) -> int:
        return (await (await self._store()).put(checked(name), data)).size or 0

    async def read_into(self, name: str, into: BinaryIO) -> int:
        try:  # the stream named: no stream lookup to grant
            return await read_object(self.js, subjects.FILES_OBJ, checked(name), into)
        except NotFoundError as exc:
            raise FileNotFoundError(f"{name} in {self.where}") from exc

    async def delete(self, name: str) -> None:
        try:
            await (await self._store()).delete(checked(name))
        except NotFoundError:
            pass

    async def size(self, name: str) -> int | None:
        try:
            return (await (await self._store()).get_info(checked(name))).size or 0
        except NotFoundError:
            return None


class UriObjects:
    """A prefix in an object store (`s3://bucket/prefix`, `gs://...`), through pyarrow's
    file systems (blocking calls in a thread)."""

    def __init__(self, uri: str) -> None:
        self.where = uri
        self.fs, self.base = filesystem(uri)

    def _path(self, name: str) -> str:
        return f"{self.base}/{checked(name)}"

    def _put(self, name: str, data: BinaryIO) -> int:
        with self.fs.open_output_stream(self._path(name)) as out:
            return copy(data, out)

    def _read(self, name: str, into: BinaryIO) -> int:
        with self.fs.open_input_stream(self._path(name)) as src:
            return copy(src, into)

    def _delete(self, name: str) -> None:
        try:
            self.fs.delete_file(self._path(name))
        except FileNotFoundError:
            pass

    def _size(self, name: str) -> int | None:
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self._path(name))
        return info.size if info.type == pafs.FileType.File else None

    async def put(self, name: str, data: BinaryIO) -> int:
        return await asyncio.to_thread(self._put, name, data)

    async def read_into(self, name: str, into: BinaryIO) -> int:
        return await asyncio.to_thread(self._read, name, into)

    async def delete(self, name: str) -> None:
        await asyncio.to_thread(self._delete, name)

    async def size(self, name: str) -> int | None:
        return await asyncio.to_thread(self._size, name)


def file_objects(js, uri: str = "") -> FileObjects:
    """The batch service's files: in `uri` (an object store prefix), else in NATS.
    `OutputLocationError` (a `ValueError`) for a `uri` that is not an object store prefix."""
    if not uri:
        return NatsObjects(js)
    return UriObjects(object_prefix(uri))
