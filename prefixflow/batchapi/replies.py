"""Replies of the batch API: errors in OpenAI's shape (`ApiError`; statuses and types:
`prefixflow.shared.outcomes.API_ERRORS`, docs/outcomes.md), quota refusals, list pages
and id checks, shared by its routes (`prefixflow/batchapi/app.py`, `prefixflow/batchapi/files_routes.py`)."""

from __future__ import annotations

import re
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse

from prefixflow.batchapi.quotas import Exceeded
from prefixflow.shared.outcomes import API_ERRORS


class ApiError(Exception):
    """An error reply in OpenAI's shape; its status is one of `API_ERRORS` (docs/outcomes.md),
    which also gives its `type`."""

    def __init__(self, status: HTTPStatus, message: str, code: str | None = None, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.type, self.param = status, message, code, API_ERRORS[status], param
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


NO_RETRY = {"x-should-retry": "false"}
"""Tells the `openai` client not to retry (it retries 429 and 5xx by itself): a quota
frees only when the tenant's batches end or its files are deleted."""


def quota_error(exc: Exceeded) -> ApiError:
    """A tenant over a quota: 507 for bytes stored, 429 for the others (docs/quotas.md)."""
    if exc.storage:
        return ApiError(HTTPStatus.INSUFFICIENT_STORAGE, str(exc), "storage_quota_exceeded", headers=NO_RETRY)
    return ApiError(HTTPStatus.TOO_MANY_REQUESTS, str(exc), "rate_limit_exceeded", headers=NO_RETRY)


def page_limit(limit: int, most: int) -> int:
    """A list's `limit` (OpenAI's range: 1..most; outside it: 400)."""
    if not 1 <= limit <= most:
        raise ApiError(HTTPStatus.BAD_REQUEST, f"limit {limit}: want 1 to {most}", param="limit")
    return limit


def listing(data: list[dict[str, Any]], more: bool) -> dict[str, Any]:
    """A list answer as OpenAI's (a cursor page: `after` the last id for the next)."""
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


ID_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")
"""What a file or batch id can look like (a key token of the records bucket)."""


def well_formed(id_: str) -> bool:
    """An id that can name a record (any other, e.g. `a:b` or `a.b`, is simply not found: 404)."""
    return ID_RE.fullmatch(id_) is not None
