"""The batch service's records: files in the JetStream object store (`subjects.FILES_OBJ`),
their metadata and the batches in a key-value bucket (`subjects.BATCHES_KV`), each key
under its tenant (`file.<tenant>.<id>`, `batch.<tenant>.<id>`): a tenant's request can only
ever name its own keys, so another tenant's file or batch is simply not found. Both
stores are replicated like the streams: any API replica serves them, a restart loses
nothing.

Listing asks the server for the bucket's keys under one prefix (`kv_keys`: stream info,
no consumer), so the `api` user's grant needs nothing beyond reading and writing its own
bucket, and listing one tenant reads only that tenant's keys.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, BinaryIO

import msgspec
from nats.js.errors import KeyNotFoundError, NotFoundError

from prefixflow.shared.bus.kv_keys import kv_keys
from prefixflow.shared.bus.objects import read_object
from prefixflow.shared.wire import subjects


class FileRec(msgspec.Struct, omit_defaults=True):
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int
    object: str
    """The object holding its content (an upload's own; a batch output's, the sink's export)."""

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `FileObject`."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class BatchRec(msgspec.Struct, omit_defaults=True):
    tenant: str
    job: str
    """The prefixflow job that runs it (its id: the batch id)."""
    batch: dict[str, Any]
    """OpenAI's `Batch` object as the API returns it."""
    requests: int = 0
    """Good request lines (sent to the cluster)."""
    bad: int = 0
    """Request lines that never ran (error lines)."""


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


class Store:
    def __init__(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream()

    async def open(self) -> Store:
        self.kv = await self.js.key_value(subjects.BATCHES_KV)
        self.objects = await self.js.object_store(subjects.FILES_OBJ)
        return self

    # --- files ---------------------------------------------------------------------

    async def put_file(self, tenant: str, filename: str, purpose: str, data: BinaryIO) -> FileRec:
        fid = new_id("file")
        info = await self.objects.put(fid, data)
        rec = FileRec(fid, tenant, filename, purpose, info.size or 0, now(), fid)
        await self.save_file(rec)
        return rec

    async def save_file(self, rec: FileRec) -> None:
        await self.kv.put(f"file.{rec.tenant}.{rec.id}", msgspec.json.encode(rec))

    async def file(self, tenant: str, fid: str) -> FileRec | None:
        return await self._get(f"file.{tenant}.{fid}", FileRec)

    async def files(self, tenant: str) -> list[FileRec]:
        recs = [await self._get(k, FileRec) for k in await self._keys(f"file.{tenant}.>")]
        return sorted((r for r in recs if r is not None), key=lambda r: r.created_at, reverse=True)

    async def delete_file(self, rec: FileRec) -> None:
        await self.kv.delete(f"file.{rec.tenant}.{rec.id}")
        if rec.object == rec.id:  # its own upload (a batch output's object is the job's)
            try:
                await self.objects.delete(rec.object)
            except NotFoundError:
                pass

    async def read_object(self, name: str, into: BinaryIO) -> None:
        await read_object(self.js, subjects.FILES_OBJ, name, into)  # the stream named: no stream lookup to grant

    async def put_object(self, name: str, data: BinaryIO) -> int:
        return (await self.objects.put(name, data)).size or 0

    async def object_size(self, name: str) -> int | None:
        try:
            return (await self.objects.get_info(name)).size or 0
        except NotFoundError:
            return None

    # --- batches -------------------------------------------------------------------

    async def save_batch(self, rec: BatchRec) -> None:
        await self.kv.put(f"batch.{rec.tenant}.{rec.batch['id']}", msgspec.json.encode(rec))

    async def batch(self, tenant: str, bid: str) -> BatchRec | None:
        return await self._get(f"batch.{tenant}.{bid}", BatchRec)

    async def batches(self, tenant: str | None = None) -> list[BatchRec]:
        """The tenant's batches (None: every tenant's), newest first."""
        keys = await self._keys(f"batch.{tenant}.>" if tenant else "batch.>")
        recs = [await self._get(k, BatchRec) for k in keys]
        return sorted((r for r in recs if r is not None), key=lambda r: (r.batch["created_at"], r.batch["id"]),
                      reverse=True)

    async def _keys(self, pattern: str) -> list[str]:
        return await kv_keys(self.nc, subjects.BATCHES_KV, pattern)

    async def _get(self, key: str, cls):
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        return msgspec.json.decode(entry.value, type=cls) if entry.value else None
