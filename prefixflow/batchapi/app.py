"""The OpenAI Batch API over HTTP (FastAPI): `/v1/files` and `/v1/batches`.

Why FastAPI on uvicorn: vLLM's own OpenAI server is built on them, so they come with
vLLM (no new dependency). An upload is parsed as it streams (`prefixflow/batchapi/upload.py`):
refused as soon as it passes the limit, spooled to a temporary file past 1 MiB, so a
large file never sits in memory; from there it goes to the object store in chunks (a full
store: 507). A malformed id is a 404 like any unknown one. Errors have OpenAI's shape (`{"error": {"message", "type",
"param", "code"}}`), so the `openai` client raises its own exception types; their
statuses are `prefixflow.shared.outcomes.API_ERRORS` (docs/outcomes.md), FastAPI's own
replies (422 for a body that does not validate, 404/405 of routing) and an unexpected
error included.

Every request names its tenant by its API key (`Authorization: Bearer`); records are
keyed by tenant (`prefixflow/batchapi/store.py`), so another tenant's id is a 404.
"""

from __future__ import annotations

import os
import re
import tempfile
from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from nats.js.errors import APIError
from pydantic import BaseModel
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixflow.batchapi import batches as b
from prefixflow.batchapi import lifecycle, upload
from prefixflow.batchapi.runner import Runner
from prefixflow.batchapi.store import BatchRec, Store, new_id, now
from prefixflow.shared.api_keys import tenant_of
from prefixflow.shared.bus.jobs import UnknownJob, cancel_job
from prefixflow.shared.outcomes import API_ERRORS


class ApiError(Exception):
    """An error reply in OpenAI's shape; its status is one of `API_ERRORS` (docs/outcomes.md),
    which also gives its `type`."""

    def __init__(self, status: HTTPStatus, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, API_ERRORS[status], param

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""What a file or batch id can look like (a key token of the records bucket)."""


def well_formed(id_: str) -> bool:
    """An id that can name a record (any other, e.g. `a:b` or `a.b`, is simply not found: 404)."""
    return ID_RE.fullmatch(id_) is not None


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def public(rec: BatchRec) -> dict[str, Any]:
    return {k: v for k, v in rec.batch.items() if not k.startswith("_")}


def make_app(store: Store, runner: Runner, keys: dict[str, str], cfg, js, nc) -> FastAPI:
    app = FastAPI(title="prefixflow batch API", docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # No such path (404) or method (405): OpenAI's shape, not Starlette's {"detail": ...}
        status = HTTPStatus(exc.status_code)
        if status not in API_ERRORS:  # none that routing raises today
            status = HTTPStatus.BAD_REQUEST
        return ApiError(status, f"{exc.detail}").response()

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own 422 {"detail": ...} would not be OpenAI's shape: a 400, as OpenAI answers
        problems = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return ApiError(HTTPStatus.BAD_REQUEST, f"invalid request: {problems}").response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        # NOTE: Starlette re-raises it after this reply, so the server's log has the traceback;
        # the client gets OpenAI's shape and no internals
        return ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error ({type(exc).__name__}): the service's log "
                        "has the details", "internal_error").response()

    async def tenant(authorization: str | None = Header(default=None)) -> str:
        who = tenant_of(keys, authorization)
        if who is None:
            raise ApiError(HTTPStatus.UNAUTHORIZED, "invalid or missing API key (Authorization: Bearer <key>)",
                           "invalid_api_key")
        return who

    async def own_file(tenant: str, fid: str):
        rec = await store.file(tenant, fid) if well_formed(fid) else None
        if rec is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no file {fid!r}", "not_found")
        return rec

    async def own_batch(tenant: str, bid: str) -> BatchRec:
        rec = await store.batch(tenant, bid) if well_formed(bid) else None
        if rec is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no batch {bid!r}", "not_found")
        return rec

    # --- files -------------------------------------------------------------------------

    @app.post("/v1/files")
    async def create_file(request: Request, who: str = Depends(tenant)):
        try:
            up = await upload.receive(request, cfg.max_file_bytes)
        except upload.TooLarge as exc:
            raise ApiError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"file over the limit of {exc.limit} bytes (refused "
                           f"after {exc.seen} bytes)", "file_too_large", param="file") from None
        except upload.BadForm as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc)) from None
        try:
            if up.purpose not in ("batch", "batch_output", "user_data"):
                raise ApiError(HTTPStatus.BAD_REQUEST, f"purpose {up.purpose!r}: this service keeps 'batch' files",
                               param="purpose")
            rec = await store.put_file(who, up.filename, up.purpose, up.file, up.lines)
        except APIError as exc:
            if upload.store_full(exc):
                raise ApiError(HTTPStatus.INSUFFICIENT_STORAGE, f"the files store is full ({exc.description}): "
                               "delete files or try later", "storage_full") from None
            raise
        finally:
            up.file.close()
        return rec.openai()

    @app.get("/v1/files")
    async def list_files(who: str = Depends(tenant), purpose: str | None = None):
        data = [r.openai() for r in await store.files(who) if purpose is None or r.purpose == purpose]
        return {"object": "list", "data": data, "has_more": False}

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
        await store.delete_file(await own_file(who, fid))
        return {"id": fid, "object": "file", "deleted": True}

    # --- batches -----------------------------------------------------------------------

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatch, who: str = Depends(tenant)):
        try:
            b.check_endpoint(body.endpoint, cfg.task)
            window = b.window_seconds(body.completion_window, cfg.completion_windows.split(","))
            b.priority(body.metadata)
            b.check_input(await own_file(who, body.input_file_id), cfg.max_batch_bytes, cfg.max_requests)
        except b.Invalid as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), exc.code, param=exc.param) from None
        bid, created = new_id("batch"), now()
        batch = {
            "id": bid, "object": "batch", "endpoint": body.endpoint, "input_file_id": body.input_file_id,
            "completion_window": body.completion_window, "status": "validating", "created_at": created,
            "expires_at": created + window, "metadata": body.metadata, "model": cfg.model,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "errors": None,
            "output_file_id": None, "error_file_id": None,
        }
        rec = BatchRec(who, bid, batch)
        await store.create_batch(rec)
        runner.start(rec)
        return public(rec)

    @app.get("/v1/batches/{bid}")
    async def get_batch(bid: str, who: str = Depends(tenant)):
        return public(await own_batch(who, bid))

    @app.get("/v1/batches")
    async def list_batches(who: str = Depends(tenant), after: str | None = None, limit: int = 20):
        limit = max(1, min(limit, 100))
        recs = await store.batches(who)
        if after is not None:
            ids = [r.batch["id"] for r in recs]
            recs = recs[ids.index(after) + 1:] if after in ids else []
        page = recs[:limit]
        data = [public(r) for r in page]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(recs) > limit}

    @app.post("/v1/batches/{bid}/cancel")
    async def cancel_batch(bid: str, who: str = Depends(tenant)):
        # A compare-and-set: a runner's write cannot undo it, nor it a runner's step.
        rec = await store.update_batch(who, bid, lifecycle.cancel(now())) if well_formed(bid) else None
        if rec is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no batch {bid!r}", "not_found")
        if rec.batch["status"] != "cancelling":
            return public(rec)  # finalizing or final already: nothing to cancel
        try:
            await cancel_job(js, nc, rec.job, by=f"api:{who}")
        except UnknownJob:
            pass  # no job yet: the runner never creates it, or cancels it once it exists
        runner.start(rec)
        return public(rec)

    return app
