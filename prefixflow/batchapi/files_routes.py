"""`/v1/files` of the batch API: upload (size and the tenant's bytes quota checked while
it streams), list (cursor pages, bounded), read, content, delete (record and content:
its bytes stop counting)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Literal

from fastapi import Depends, FastAPI, Request
from fastapi.responses import FileResponse
from nats.js.errors import APIError
from starlette.background import BackgroundTask

from prefixflow.batchapi import upload
from prefixflow.batchapi.quotas import Exceeded, Ledger
from prefixflow.batchapi.replies import ApiError, listing, page_limit, quota_error, well_formed
from prefixflow.batchapi.store import MAX_PAGE, FileRec, Store, after_cursor

PURPOSES = ("batch", "batch_output", "user_data")


def add_file_routes(app: FastAPI, store: Store, ledger: Ledger, cfg, tenant) -> Callable[[str, str], Awaitable[FileRec]]:
    """The file routes on `app` (`tenant`: the dependency naming the request's tenant);
    returns `own_file(tenant, id)`: the tenant's file record, or a 404."""

    async def own_file(who: str, fid: str) -> FileRec:
        rec = await store.file(who, fid) if well_formed(fid) else None
        if rec is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no file {fid!r}", "not_found")
        return rec

    @app.post("/v1/files")
    async def create_file(request: Request, who: str = Depends(tenant)):
        # 1. Reserve what the upload may write: its Content-Length when given (the file is
        #    smaller), else the file limit; at most what the tenant's quota has left.
        length = request.headers.get("content-length")
        surely = max(int(length) - upload.FORM_SLACK, 1) if length is not None and length.isdigit() else 1
        wanted = min(int(length), cfg.max_file_bytes) if length is not None and length.isdigit() else cfg.max_file_bytes
        try:
            reserved = ledger.reserve(who, wanted, at_least=min(surely, cfg.max_file_bytes))
        except Exceeded as exc:
            raise quota_error(exc) from None
        try:
            # 2. Receive it, refused as soon as it passes the reservation.
            try:
                up = await upload.receive(request, min(reserved, cfg.max_file_bytes))
            except upload.TooLarge as exc:
                if reserved < cfg.max_file_bytes:  # the quota's room, not the file limit, stopped it
                    raise quota_error(Exceeded("stored_bytes", ledger.limits(who).stored_bytes,
                                               ledger.usage(who).stored_bytes, exc.seen)) from None
                raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"file over the limit of {exc.limit} bytes "
                               f"(refused after {exc.seen} bytes)", "file_too_large", param="file") from None
            except upload.BadForm as exc:
                raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
            # 3. Store it: its bytes count from its record on (the reservation goes).
            try:
                if up.purpose not in PURPOSES:
                    raise ApiError(HTTPStatus.BAD_REQUEST, f"purpose {up.purpose!r}: this service keeps 'batch' "
                                   "files", param="purpose")
                rec = await store.put_file(who, up.filename, up.purpose, up.file, up.lines)
            except APIError as exc:
                if upload.store_full(exc):
                    raise ApiError(HTTPStatus.INSUFFICIENT_STORAGE, f"the files store is full ({exc.description}): "
                                   "delete files or try later", "storage_full") from None
                raise
            finally:
                up.file.close()
        finally:
            ledger.release(who, reserved)
        return rec.openai()

    @app.get("/v1/files")
    async def list_files(who: str = Depends(tenant), purpose: str | None = None, after: str | None = None,
                         limit: int = MAX_PAGE, order: Literal["asc", "desc"] = "desc"):
        # NOTE: the ids in order, then only a page's records are read; a `purpose` filter
        # reads on past the page until it is full or the ids run out.
        limit = page_limit(limit, MAX_PAGE)
        ordered = after_cursor(await store.file_ids(who), after, order)
        data, seen = [], 0
        while seen < len(ordered) and len(data) < limit:
            chunk = ordered[seen:seen + limit - len(data)]
            seen += len(chunk)
            data += [r.openai() for r in await store.files(who, chunk) if purpose is None or r.purpose == purpose]
        return listing(data, seen < len(ordered))

    @app.get("/v1/files/{fid}")
    async def get_file(fid: str, who: str = Depends(tenant)):
        return (await own_file(who, fid)).openai()

    @app.get("/v1/files/{fid}/content")
    async def file_content(fid: str, who: str = Depends(tenant)):
        rec = await own_file(who, fid)
        fd, path = tempfile.mkstemp(prefix="pfx-content-")
        try:
            with os.fdopen(fd, "wb") as f:
                await store.read_object(rec.object, f)
        except Exception:
            os.unlink(path)
            raise
        return FileResponse(path, media_type="application/octet-stream", filename=rec.filename,
                            background=BackgroundTask(os.unlink, path))

    @app.delete("/v1/files/{fid}")
    async def delete_file(fid: str, who: str = Depends(tenant)):
        if not await store.delete_file(await own_file(who, fid)):
            raise ApiError(HTTPStatus.NOT_FOUND, f"no file {fid!r}", "not_found")  # deleted meanwhile
        return {"id": fid, "object": "file", "deleted": True}

    return own_file
