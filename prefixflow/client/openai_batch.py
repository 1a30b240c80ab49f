"""OpenAI Batch API files in and out (`prefixflow run batch.jsonl`, `submit` too).

Input: one request per line, `{"custom_id", "method": "POST", "url", "body"}` with `url`
`/v1/chat/completions` (body `messages`) or `/v1/completions` (body `prompt`: a string
or token ids). Each good line becomes a row (id = `custom_id`; `messages` / `prompt`;
the body's sampling fields in a `sampling` column, `response_format` as a column, its
`model` as the `lora` column: the base model's name means no adapter, another name a LoRA
adapter the engines serve, or an error row), so chat requests are rendered and bucketed
like any chat row. A bad line (not JSON, not an
object, missing field, method not POST, unknown url, body not an object, duplicate
`custom_id`, a prompt that is not one string, an endpoint of the other task) never
reaches the cluster: it becomes an error line naming the line and the reason.
`/v1/embeddings` lines (`input`: one string or token ids) run in an embed job
(`--task embed`); their body is a CreateEmbeddingResponse.

Output, next to the Parquet parts and `_summary.json`, in `OUT/_batch/` (so
`pyarrow.parquet.read_table(OUT)` still reads just the parts): `output.jsonl` (one line per
request that succeeded: `{"id", "custom_id", "response": {"status_code": 200,
"request_id", "body"}, "error": null}`, the body a ChatCompletion or Completion with
`usage.prompt_tokens_details.cached_tokens`) and `errors.jsonl` (bad lines and requests
that failed: status 400, the body an OpenAI error object). Tests validate both with the
`openai` package's own types.

Pure conversion functions; file I/O only in `read_batch` and `write_outputs`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixflow.client.sources import Shard
from prefixflow.shared.openai_batch import EMBED_URL, URLS, error_line, result_line
from prefixflow.shared.wire.messages import LORA_FIELD

__all__ = ["EMBED_URL", "URLS", "BadLine", "BatchInput", "error_line", "is_batch_file", "output_lines", "parse_line",
           "read_batch", "request_row", "write_outputs", "write_rows"]

IGNORED = frozenset({"user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"})
"""Body fields without effect on a batch result."""
SAMPLING = frozenset({
    "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_tokens", "seed", "n",
    "presence_penalty", "frequency_penalty", "ignore_eos", "stop",
})


class BadLine(ValueError):
    """A request line that cannot run; the message is the reason."""


@dataclass
class BatchInput:
    rows: list[dict[str, Any]] = field(default_factory=list)
    """One row per good request (id = custom_id)."""
    requests: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """custom_id -> (line number, url, model asked for)."""
    bad: list[dict[str, Any]] = field(default_factory=list)
    """Error lines of the requests that never ran."""


SNIFF_LINES = 16
"""Non-blank lines `is_batch_file` looks at."""
SNIFF_BYTES = 1 << 20
"""A local line is read in pieces of at most this much (a piece of a longer line is no
JSON object: the next line is looked at)."""
REQUEST_KEYS = frozenset({"custom_id", "method", "url", "body"})


def _lines(source: str | Path | Shard) -> Iterator[bytes]:
    """The lines of a local file (in pieces of at most `SNIFF_BYTES`) or of an input's
    file (`Shard`: local or in a bucket)."""
    if isinstance(source, Shard):
        from prefixflow.client.readers import lines

        yield from lines(source)
        return
    with Path(source).open("rb") as f:
        while line := f.readline(SNIFF_BYTES):
            yield line


def is_batch_file(source: str | Path | Shard) -> bool:
    """A JSONL file of OpenAI Batch request lines: among its first `SNIFF_LINES`
    non-blank lines, JSON objects with `custom_id`, one of which has one more of a
    request line's keys (`method`, `url`, `body`); an object without `custom_id` first
    makes it a plain file. Other keys beside them (an unknown extra field) do not
    matter, nor do bad lines before it (each becomes an error line)."""
    if isinstance(source, Shard):
        if source.format != "jsonl":
            return False
    elif Path(source).suffix not in (".jsonl", ".ndjson", ".json") or not Path(source).is_file():
        return False
    seen = 0
    for line in _lines(source):
        if not line.strip():
            continue
        seen += 1
        if seen > SNIFF_LINES:
            break
        try:
            first = json.loads(line)
        except (ValueError, RecursionError):
            continue  # a bad line (or a piece of a long one): look at the next
        if isinstance(first, dict):
            if "custom_id" not in first:
                return False  # a plain row
            if len(REQUEST_KEYS & first.keys()) >= 2:
                return True
            # a request line missing fields (an error line): look at the next
    return False


def request_row(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """The row of one request; raises BadLine."""
    kind = URLS[url]
    row: dict[str, Any] = {"id": custom_id, "url": url}
    sampling: dict[str, Any] = {}
    for key, value in body.items():
        if key in IGNORED or value is None:
            continue
        if key == "model":
            if value and kind != "embedding":  # the ingestor reads the base model's names as no adapter
                row[LORA_FIELD] = value
            continue
        if key == "input" and kind == "embedding":
            if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
                value = value[0]
            if isinstance(value, str) and value:
                row["prompt"] = value
            elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                row["prompt_token_ids"] = value
            else:
                raise BadLine("'input' must be one string or a list of token ids (one input per request)")
        elif key in ("encoding_format", "dimensions") and kind == "embedding":
            if key == "encoding_format" and value != "float":
                raise BadLine("only encoding_format 'float' is supported")
            if key == "dimensions":
                raise BadLine("'dimensions' is not supported (the model's hidden size is returned)")
        elif key == "messages" and kind == "chat":
            row["messages"] = value
        elif key == "prompt" and kind == "completion":
            if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
                value = value[0]
            if isinstance(value, str):
                row["prompt"] = value
            elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
                row["prompt_token_ids"] = value
            else:
                raise BadLine("'prompt' must be one string or a list of token ids (one prompt per request)")
        elif key == "response_format":
            row["response_format"] = value
        elif key == "stream":
            if value:
                raise BadLine("'stream' is not supported in a batch")
        elif key == "stop":
            sampling["stop"] = [value] if isinstance(value, str) else value
        elif key == "logprobs":
            if kind == "chat":
                if value:
                    sampling["logprobs"] = body.get("top_logprobs") or 0
            else:
                sampling["logprobs"] = value
        elif key == "top_logprobs":
            continue  # with `logprobs` above
        else:
            # Sampling fields, and anything unknown: the ingestor refuses those by name.
            sampling[key] = value
    if kind == "chat" and "messages" not in row:
        raise BadLine("missing 'messages' in body")
    if kind == "completion" and "prompt" not in row and "prompt_token_ids" not in row:
        raise BadLine("missing 'prompt' in body")
    if kind == "embedding":
        if "prompt" not in row and "prompt_token_ids" not in row:
            raise BadLine("missing 'input' in body")
        if sampling:
            raise BadLine(f"unknown embeddings field(s): {', '.join(sorted(sampling))}")
    if sampling:
        row["sampling"] = sampling
    return row


def parse_line(n: int, line: bytes | str, seen: set[str], task: str = "generate") -> tuple[str, str, str, dict[str, Any]]:
    """(custom_id, url, model, row) of a request line; raises BadLine."""
    try:
        req = json.loads(line)
    except ValueError as exc:
        raise BadLine(f"not JSON: {exc}") from None
    if not isinstance(req, dict):
        raise BadLine("want a JSON object per line")
    for key in ("custom_id", "method", "url", "body"):
        if key not in req:
            raise BadLine(f"missing '{key}'")
    custom_id, url, body = req["custom_id"], req["url"], req["body"]
    if not isinstance(custom_id, str) or not custom_id:
        raise BadLine("'custom_id' must be a non-empty string")
    if custom_id in seen:
        raise BadLine(f"duplicate custom_id {custom_id!r}")
    seen.add(custom_id)
    if req["method"] != "POST":
        raise BadLine(f"method {req['method']!r} is not POST")
    if url not in URLS:
        raise BadLine(f"unknown url {url!r} (want {', '.join(URLS)})")
    if (url == EMBED_URL) != (task == "embed"):
        article = "an" if task == "embed" else "a"
        raise BadLine(f"url {url} in {article} {task} job (embeddings run with --task embed, alone)")
    if not isinstance(body, dict):
        raise BadLine("'body' must be an object")
    return custom_id, url, str(body.get("model") or ""), request_row(custom_id, url, body)


def read_batch(source: str | Path | Shard, task: str = "generate") -> BatchInput:
    out = BatchInput()
    seen: set[str] = set()
    for n, line in enumerate(_lines(source), 1):
        if not line.strip():
            continue
        try:
            custom_id, url, model, row = parse_line(n, line, seen, task)
        except BadLine as exc:
            out.bad.append(error_line(_custom_id_of(line), f"line {n}: {exc}"))
            continue
        out.requests[custom_id] = (n, url, model)
        out.rows.append(row)
    return out


def _custom_id_of(line: bytes) -> str | None:
    try:
        cid = json.loads(line).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return cid if isinstance(cid, str) else None


def output_lines(batch: BatchInput, rows: list[dict[str, Any]], model: str) -> tuple[list[dict], list[dict]]:
    """(output.jsonl lines, errors.jsonl lines) from the job's output rows, in input order."""
    created = int(time.time())
    by_id = {str(r["id"]): r for r in rows}
    ok, errors = [], list(batch.bad)
    for custom_id, (n, url, asked) in sorted(batch.requests.items(), key=lambda kv: kv[1][0]):
        row = by_id.get(custom_id)
        if row is None:
            errors.append(error_line(custom_id, f"line {n}: no result", "missing_result"))
            continue
        named = asked if row.get(LORA_FIELD) else model or asked  # an adapter's line names the adapter
        good, line = result_line(custom_id, url, row, named, created, f"line {n}")
        (ok if good else errors).append(line)
    return ok, errors


def write_rows(batch: BatchInput, path: Path) -> Path:
    """The requests as prefixflow input rows (JSONL)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in batch.rows))
    return path


def write_outputs(batch: BatchInput, out_dir: str | Path, model: str) -> tuple[int, int]:
    """Write output.jsonl and errors.jsonl from the job's Parquet output; (ok, errors)."""
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    parts = sorted(out_dir.glob("part-*.parquet"))
    rows = [r for p in parts for r in pq.read_table(p).to_pylist()]
    ok, errors = output_lines(batch, rows, model)
    target = batch_dir(out_dir)
    target.mkdir(parents=True, exist_ok=True)
    for name, lines in (("output.jsonl", ok), ("errors.jsonl", errors)):
        tmp = target / f".{name}.tmp"
        tmp.write_text("".join(json.dumps(line) + "\n" for line in lines))
        tmp.replace(target / name)
    return len(ok), len(errors)


def batch_dir(out_dir: str | Path) -> Path:
    """Where output.jsonl and errors.jsonl go: `OUT/_batch/` (a leading `_`, so
    `pyarrow.parquet.read_table(OUT)` still reads just the Parquet parts)."""
    return Path(out_dir) / "_batch"
