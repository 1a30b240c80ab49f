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

Every request names its tenant by its API key (`Authorization: Bearer`; the keys file is
read again when it changes: `prefixflow/shared/api_keys.py`); records are keyed by tenant
(`prefixflow/batchapi/store.py`), so another tenant's id is a 404. Each tenant's quotas
(`prefixflow/batchapi/quotas.py`, docs/quotas.md) are checked before it takes anything:
an upload past its bytes is a 507, a batch past its open batches, queued requests or
concurrent jobs a 429. Lists are cursor pages (`after`, `limit`, `has_more`) in id order,
newest first (ids sort by creation time). The file routes: `prefixflow/batchapi/files_routes.py`.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixflow.batchapi import batches as b
from prefixflow.batchapi import lifecycle
from prefixflow.batchapi.files_routes import add_file_routes
from prefixflow.batchapi.quotas import Exceeded, Ledger, Limits
from prefixflow.batchapi.replies import ApiError, listing, page_limit, quota_error, well_formed
from prefixflow.batchapi.runner import Runner
from prefixflow.batchapi.store import BatchRec, Store, new_id, now, page_of
from prefixflow.shared.api_keys import KeyRing
from prefixflow.shared.bus.jobs import UnknownJob, cancel_job
from prefixflow.shared.outcomes import API_ERRORS
from prefixflow.shared.wire import subjects

MAX_BATCH_PAGE = 100
"""Most batches one list request returns (OpenAI's)."""


class CreateBatch(BaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


def public(rec: BatchRec) -> dict[str, Any]:
    return {k: v for k, v in rec.batch.items() if not k.startswith("_")}


def make_app(store: Store, runner: Runner, keys: KeyRing, cfg, js, nc, ledger: Ledger | None = None) -> FastAPI:
    app = FastAPI(title="prefixflow batch API", docs_url=None, redoc_url=None)
    ledger = ledger if ledger is not None else Ledger(lambda _: Limits())

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
        who = keys.tenant(authorization)
        if who is None:
            raise ApiError(HTTPStatus.UNAUTHORIZED, "invalid or missing API key (Authorization: Bearer <key>)",
                           "invalid_api_key")
        return who

    async def own_batch(tenant: str, bid: str) -> BatchRec:
        rec = await store.batch(tenant, bid) if well_formed(bid) else None
        if rec is None:
            raise ApiError(HTTPStatus.NOT_FOUND, f"no batch {bid!r}", "not_found")
        return rec

    own_file = add_file_routes(app, store, ledger, cfg, tenant)

    @app.get("/v1/quota")
    async def quota(who: str = Depends(tenant)):
        """The tenant's quotas: {quota: {used, limit}} (limit 0: none)."""
        return {"object": "quota", "tenant": who, **ledger.report(who)}

    # --- batches -----------------------------------------------------------------------

    @app.post("/v1/batches")
    async def create_batch(body: CreateBatch, who: str = Depends(tenant)):
        try:
            b.check_endpoint(body.endpoint, cfg.task)
            window = b.window_seconds(body.completion_window, cfg.completion_windows.split(","))
            b.priority(body.metadata)
            file = await own_file(who, body.input_file_id)
            b.check_input(file, cfg.max_batch_bytes, cfg.max_requests)
        except b.Invalid as exc:
            raise ApiError(HTTPStatus.BAD_REQUEST, str(exc), exc.code, param=exc.param) from None
        bid, created = new_id("batch"), now()
        try:
            ledger.admit(who, bid, file.lines)  # NOTE: no await between its check and its take
        except Exceeded as exc:
            raise quota_error(exc) from None
        batch = {
            "id": bid, "object": "batch", "endpoint": body.endpoint, "input_file_id": body.input_file_id,
            "completion_window": body.completion_window, "status": "validating", "created_at": created,
            "expires_at": created + window, "metadata": body.metadata, "model": cfg.model,
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "errors": None,
            "output_file_id": None, "error_file_id": None,
        }
        rec = BatchRec(who, subjects.api_job(bid), batch, lines=file.lines)
        try:
            await store.create_batch(rec)
        except BaseException:
            ledger.forget(who, bid)
            raise
        runner.start(rec)
        return public(rec)

    @app.get("/v1/batches/{bid}")
    async def get_batch(bid: str, who: str = Depends(tenant)):
        return public(await own_batch(who, bid))

    @app.get("/v1/batches")
    async def list_batches(who: str = Depends(tenant), after: str | None = None, limit: int = 20):
        page, more = page_of(await store.batch_ids(who), after, page_limit(limit, MAX_BATCH_PAGE))
        recs = [await store.batch(who, bid) for bid in page]
        return listing([public(r) for r in recs if r is not None], more)

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

    @app.delete("/v1/batches/{bid}")
    async def delete_batch(bid: str, who: str = Depends(tenant)):
        """A final batch and its data: its output and error files (records and content)
        and what its job exported; its input file stays (a file of its own)."""
        rec = await own_batch(who, bid)
        if rec.batch["status"] not in b.TERMINAL:
            raise ApiError(HTTPStatus.CONFLICT, f"batch {bid} is {rec.batch['status']}: cancel it and delete it once "
                           "it is final", "batch_not_final")
        await runner.delete_outputs(rec)
        await store.delete_batch(rec)
        return {"id": bid, "object": "batch.deleted", "deleted": True}

    return app
