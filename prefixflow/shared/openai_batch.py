"""OpenAI Batch API result lines, from prefixflow output rows: pure functions shared by
the client (`prefixflow run batch.jsonl`, `prefixflow/client/openai_batch.py`) and the sink, which
exports a batch job's rows as `output.jsonl` / `errors.jsonl` for the batch service
(`prefixflow/services/sink/export.py`).

A row becomes an output line (HTTP 200, the body a ChatCompletion, Completion or
CreateEmbeddingResponse with usage and `prompt_tokens_details.cached_tokens`) or, when it
carries an error, an error line (HTTP 400, the body an OpenAI error object). The tests
validate both with the `openai` package's own types.
"""

from __future__ import annotations

import uuid
from typing import Any

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/embeddings": "embedding"}
"""Endpoints served (url -> kind); a job serves the generate ones or, with `--task embed`,
`/v1/embeddings`."""
EMBED_URL = "/v1/embeddings"
_FINISH = {"stop": "stop", "length": "length"}


def error_line(custom_id: str | None, message: str, code: str = "invalid_request") -> dict[str, Any]:
    """An errors.jsonl line: HTTP 400 with an OpenAI error body."""
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {
            "status_code": 400,
            "request_id": f"req_{uuid.uuid4().hex}",
            "body": {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}},
        },
        "error": None,
    }


NOT_RUN = {
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
    "batch_expired": "This request could not be executed before the completion window expired.",
}
"""OpenAI's codes (and words) for a request that never ran: its line has no response."""


def not_run_line(custom_id: str | None, code: str, message: str = "") -> dict[str, Any]:
    """An errors.jsonl line as OpenAI writes it for a request that never got a response
    (`batch_cancelled`, `batch_expired`): `response: null`, `error: {code, message}`."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message or NOT_RUN.get(code, code)}}


def response_body(kind: str, row: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    """A ChatCompletion / Completion body from an output row."""
    texts = row.get("outputs") or [row.get("output") or ""]
    finish = _FINISH.get(row.get("finish_reason") or "", "stop")
    prompt, completion = int(row.get("prompt_tokens") or 0), int(row.get("output_tokens") or 0)
    usage = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(row.get("cached_tokens") or 0)},
    }
    rid = uuid.uuid4().hex
    if kind == "embedding":
        return {"object": "list", "model": model,
                "data": [{"object": "embedding", "index": 0, "embedding": list(row.get("embedding") or [])}],
                "usage": {"prompt_tokens": prompt, "total_tokens": prompt}}
    if kind == "chat":
        choices = [{"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": finish, "logprobs": None}
                   for i, t in enumerate(texts)]
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": created, "model": model,
                "choices": choices, "usage": usage}
    choices = [{"index": i, "text": t, "finish_reason": finish, "logprobs": None} for i, t in enumerate(texts)]
    return {"id": f"cmpl-{rid}", "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def result_line(custom_id: str, url: str, row: dict[str, Any], model: str, created: int, where: str = "") -> tuple[bool, dict[str, Any]]:
    """(ok, line) of one request's output row: an output line, or an error line when the
    row carries an error (`where`: how to name the request in the message, e.g. "line 7")."""
    if row.get("error"):
        return False, error_line(custom_id, f"{where}: {row['error']}" if where else str(row["error"]))
    body = response_body(URLS.get(url, "completion"), row, model, created)
    return True, {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
                  "response": {"status_code": 200, "request_id": f"req_{uuid.uuid4().hex}", "body": body}, "error": None}


def object_names(job: str) -> tuple[str, str]:
    """The files object store's objects of a batch job's exported results (the sink
    writes them, the batch service serves them): (output lines, error lines)."""
    return f"{job}/output.jsonl", f"{job}/errors.jsonl"
