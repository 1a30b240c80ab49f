"""The batch service's records: files in the JetStream object store (`subjects.FILES_OBJ`)
or an object store prefix (`files_uri`: `prefixflow/shared/file_objects.py`),
their metadata and the batches in a key-value bucket (`subjects.BATCHES_KV`), each key
under its tenant (`file.<tenant>.<id>`, `batch.<tenant>.<id>`): a tenant's request can only
ever name its own keys, so another tenant's file or batch is simply not found. Both
stores are replicated like the streams: any API replica serves them, a restart loses
nothing.

Ids sort by creation time (`new_id`), so a list is a page of a tenant's keys in id
order (`page_of`: `after` a cursor id, newest first) whose records alone are read.

Listing asks the server for the bucket's keys under one prefix (`kv_keys`: stream info,
no consumer), so the `api` user's grant needs nothing beyond reading and writing its own
bucket, and listing one tenant reads only that tenant's keys.

A batch record is created once (`create_batch`) and from then on only changed by
`update_batch`: a compare-and-set on the key's revision that reads the record again and
re-applies its change when another writer came first, so no writer undoes another's
change (a cancel is never overwritten by a runner's stale copy).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, BinaryIO, TypeVar

import msgspec
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from prefixflow.batchapi.quotas import Ledger
from prefixflow.shared.bus.kv_keys import kv_keys
from prefixflow.shared.file_objects import file_objects
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
    lines: int = 0
    """An upload's lines, counted as it arrived (0: not counted, e.g. a file stored before they were)."""

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `FileObject`."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed"}


class BatchRec(msgspec.Struct, omit_defaults=True):
    tenant: str
    job: str
    """The prefixflow job that runs it: `pfxapi.<batch id>` (`subjects.api_job`; a record
    written before that namespace names the bare batch id, and keeps it)."""
    batch: dict[str, Any]
    """OpenAI's `Batch` object as the API returns it."""
    requests: int = 0
    """Good request lines (sent to the cluster)."""
    bad: int = 0
    """Request lines that never ran (error lines)."""
    validated: bool = False
    """Its input was read (`requests`, `bad` and the parsed objects are set)."""
    lines: int = 0
    """Its input file's lines when it was created (the requests it queues: quotas)."""


def new_id(prefix: str) -> str:
    """A new id that sorts by creation time (milliseconds, then 12 random bytes): lists
    page through a tenant's keys in id order without reading every record."""
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(12)}"


MAX_PAGE = 10_000
"""Most items one list request returns (OpenAI's limit for files; batches: 100)."""


def after_cursor(ids: list[str], after: str | None, order: str = "desc") -> list[str]:
    """`ids` in id order (`desc`: newest first) from just after the cursor `after` (an
    id; it need not exist any more): each id once, whatever was deleted or added since."""
    ordered = sorted(set(ids), reverse=order == "desc")
    if after is None:
        return ordered
    return [i for i in ordered if (i < after if order == "desc" else i > after)]


def page_of(ids: list[str], after: str | None, limit: int, order: str = "desc") -> tuple[list[str], bool]:
    """One page: the first `limit` of `after_cursor`, and whether more follow."""
    ordered = after_cursor(ids, after, order)
    return ordered[:limit], len(ordered) > limit


def now() -> int:
    return int(time.time())


R = TypeVar("R")

MAX_CONFLICTS = 1000
"""Compare-and-set attempts before `update_record` gives up (each failed attempt means
another writer's change went in: only a storm of writers to one record gets there)."""


class TooManyConflicts(RuntimeError):
    """A record changed under `update_record` `MAX_CONFLICTS` times in a row."""


async def update_record(kv, key: str, cls: type[R], change: Callable[[R], R | None]) -> R | None:
    """Change the record at `key` by a compare-and-set on its revision: read it, apply
    `change` (to the record as read: it may change it in place; it returns the record to
    write, or None to leave it as it is) and write it only if nobody wrote it meanwhile;
    otherwise read it again and apply `change` to what the other writer wrote. So a
    change is never lost and never undoes another's: `change` must be a function of the
    record it is given (it may run several times). Returns the record as it now stands
    (None: there is none)."""
    for _ in range(MAX_CONFLICTS):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return None
        if not entry.value:
            return None
        new = change(msgspec.json.decode(entry.value, type=cls))
        if new is None:
            return msgspec.json.decode(entry.value, type=cls)
        try:
            await kv.update(key, msgspec.json.encode(new), last=entry.revision)
        except KeyWrongLastSequenceError:
            continue  # written meanwhile: apply the change to what is there now
        return new
    raise TooManyConflicts(f"{key}: changed by others {MAX_CONFLICTS} times in a row")


class Store:
    def __init__(self, nc, ledger: Ledger | None = None, files_uri: str = "") -> None:
        """`files_uri`: where the files' contents live (`prefixflow/shared/file_objects.py`:
        an object store prefix; "": the NATS object store)."""
        self.nc = nc
        self.js = nc.jetstream()
        self.files_uri = files_uri
        self.ledger = ledger
        """Told of every file written or deleted and of every batch record change (quotas)."""

    async def open(self) -> Store:
        self.kv = await self.js.key_value(subjects.BATCHES_KV)
        self.objects = file_objects(self.js, self.files_uri)
        return self

    # --- files ---------------------------------------------------------------------

    async def put_file(self, tenant: str, filename: str, purpose: str, data: BinaryIO, lines: int = 0) -> FileRec:
        fid = new_id("file")
        size = await self.objects.put(fid, data)
        rec = FileRec(fid, tenant, filename, purpose, size, now(), fid, lines)
        await self.save_file(rec)
        return rec

    async def save_file(self, rec: FileRec) -> FileRec:
        """Write a new file's record: its bytes count to its tenant from now. A record
        under that id already (a batch's output registered again after a restart) stays
        as it is and counts once: the record that stands."""
        try:
            await self.kv.create(file_key(rec.tenant, rec.id), msgspec.json.encode(rec))
        except KeyWrongLastSequenceError:
            return await self.file(rec.tenant, rec.id) or rec
        if self.ledger is not None:
            self.ledger.stored(rec.tenant, rec.bytes)
        return rec

    async def file(self, tenant: str, fid: str) -> FileRec | None:
        return await self._get(file_key(tenant, fid), FileRec)

    async def file_ids(self, tenant: str | None = None) -> list[str]:
        """The ids of the tenant's files (None: every tenant's, as `tenant.id`)."""
        keys = await self._keys(f"file.{tenant}.*" if tenant else "file.*.*")
        return [k.split(".", 2)[2] if tenant else k.split(".", 1)[1] for k in keys]

    async def files(self, tenant: str, ids: list[str]) -> list[FileRec]:
        """These files' records (gone ones left out), in the order given."""
        recs = [await self.file(tenant, fid) for fid in ids]
        return [r for r in recs if r is not None]

    async def delete_file(self, rec: FileRec) -> bool:
        """Delete the file's record and its content; whether this call deleted it (False:
        it was gone already). Its bytes stop counting to its tenant."""
        key = file_key(rec.tenant, rec.id)
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return False
        if not entry.value:
            return False
        try:
            await self.kv.delete(key, last=entry.revision)
        except KeyWrongLastSequenceError:
            return False  # deleted by another request meanwhile (a file record is never rewritten)
        await self.delete_object(rec.object)  # an upload's own, a batch output's or error file's
        if self.ledger is not None:
            self.ledger.freed(rec.tenant, rec.bytes)
        return True

    async def delete_object(self, name: str) -> None:
        """Delete an object (gone already: nothing to do)."""
        await self.objects.delete(name)

    async def read_object(self, name: str, into: BinaryIO) -> None:
        await self.objects.read_into(name, into)

    async def put_object(self, name: str, data: BinaryIO) -> int:
        return await self.objects.put(name, data)

    async def object_size(self, name: str) -> int | None:
        return await self.objects.size(name)

    # --- batches -------------------------------------------------------------------

    async def create_batch(self, rec: BatchRec) -> None:
        """Write a new batch's first record (its id is new: never an overwrite)."""
        await self.kv.create(batch_key(rec.tenant, rec.batch["id"]), msgspec.json.encode(rec))

    async def update_batch(self, tenant: str, bid: str, change: Callable[[BatchRec], BatchRec | None]) -> BatchRec | None:
        """Change a batch's record by a compare-and-set (`update_record`; the changes are
        in `prefixflow/batchapi/lifecycle.py`): the record as it now stands (None: no such batch)."""
        rec = await update_record(self.kv, batch_key(tenant, bid), BatchRec, change)
        if rec is not None and self.ledger is not None:
            self.ledger.observe(tenant, bid, rec.batch["status"])
        return rec

    async def delete_batch(self, rec: BatchRec) -> None:
        """Delete a final batch's record (its files are deleted by the caller)."""
        await self.kv.delete(batch_key(rec.tenant, rec.batch["id"]))
        if self.ledger is not None:
            self.ledger.forget(rec.tenant, rec.batch["id"])

    async def batch_ids(self, tenant: str) -> list[str]:
        return [k.split(".", 2)[2] for k in await self._keys(f"batch.{tenant}.*")]

    async def batch(self, tenant: str, bid: str) -> BatchRec | None:
        return await self._get(batch_key(tenant, bid), BatchRec)

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


def batch_key(tenant: str, bid: str) -> str:
    return f"batch.{tenant}.{bid}"


def file_key(tenant: str, fid: str) -> str:
    return f"file.{tenant}.{fid}"
