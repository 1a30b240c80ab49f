"""Checks of OpenAI Batch result lines with the `openai` package's own types (the
response bodies, the error objects, the `BatchError` of a request that never ran), and,
for chat and embedding success lines, with vLLM's own `BatchRequestOutput`.

The `openai` package has no type for a whole result line, so `Line` composes its types
the way OpenAI documents a line: `{id, custom_id, response: {status_code, request_id,
body} | null, error: {code, message} | null}`, exactly one of `response` and `error`
set... except OpenAI's error file, where a request the API answered with an error has a
`response` (its status code and error body) and `error: null`.
"""

from __future__ import annotations

from typing import Any

from openai.types import BatchError, Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject
from pydantic import BaseModel, ConfigDict

BODY = {"/v1/chat/completions": ChatCompletion, "/v1/completions": Completion,
        "/v1/embeddings": CreateEmbeddingResponse}


class Response(BaseModel):
    model_config = ConfigDict(extra="forbid")
    status_code: int
    request_id: str
    body: dict[str, Any]


class Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    custom_id: str | None
    response: Response | None
    error: BatchError | None


def check_output_line(line: dict, url: str) -> Any:
    """An output.jsonl line: HTTP 200 with the endpoint's response body (its openai type)."""
    parsed = Line.model_validate(line)
    assert parsed.error is None and parsed.response is not None and parsed.response.status_code == 200, line
    assert parsed.id.startswith("batch_req_") and parsed.custom_id
    return BODY[url].model_validate(parsed.response.body, strict=False)


def check_error_line(line: dict) -> str:
    """An errors.jsonl line: either a request that never ran (`response: null`, `error`
    a BatchError with its code) or one answered with an error (a 4xx/5xx response whose
    body is `{"error": ErrorObject}`, `error: null`). Returns the error's code."""
    parsed = Line.model_validate(line)
    assert parsed.id.startswith("batch_req_"), line
    if parsed.response is None:
        assert parsed.error is not None and parsed.error.code and parsed.error.message, line
        return parsed.error.code
    assert parsed.error is None and parsed.response.status_code >= 400, line
    assert set(parsed.response.body) == {"error"}, line
    err = ErrorObject.model_validate(parsed.response.body["error"])
    assert err.message and err.type, line
    return err.code or ""


def check_vllm(line: dict) -> None:
    """A chat or embedding success line is also vLLM's own `BatchRequestOutput`."""
    from vllm.entrypoints.launchers.run_batch import BatchRequestOutput

    out = BatchRequestOutput.model_validate(line)
    assert out.response is not None and out.response.body is not None and out.error is None
