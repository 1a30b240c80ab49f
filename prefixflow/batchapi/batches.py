"""The batch service's pure logic: reading a batch input file into rows (with the
checks a hosted batch API makes), the Batch object's states and counters, and the error
lines of requests that never got a result. No I/O but the local files given.

States (OpenAI's): `validating` -> `in_progress` -> `finalizing` -> `completed`; `failed`
when no request line can run (its `errors` name the bad lines); `cancelling` ->
`cancelled` and `expired` (after `completion_window`) keep the results written, and every
request without one gets an error line (`batch_cancelled`, `batch_expired`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixflow.client.openai_batch import BadLine, parse_line
from prefixflow.shared.openai_batch import EMBED_URL, URLS, error_line, not_run_line
from prefixflow.shared.outcomes import BatchState
from prefixflow.shared.wire.limits import MAX_SCHEMA_DEPTH, json_depth
from prefixflow.shared.wire.messages import LORA_FIELD

TERMINAL = frozenset({BatchState.COMPLETED, BatchState.FAILED, BatchState.EXPIRED, BatchState.CANCELLED})
"""A batch's final states (every state: `prefixflow.shared.outcomes.BatchState`, docs/outcomes.md)."""
MAX_LISTED_ERRORS = 100
"""Bad lines named in a failed batch's `errors`."""


class Invalid(ValueError):
    """The create request cannot become a batch (HTTP 400; `param`, `code` as OpenAI's
    error body has them)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def window_seconds(window: str, allowed: Iterable[str] = ("24h",)) -> int:
    """`completion_window` in seconds: one of the `allowed` windows (OpenAI's: only
    "24h"; the API's `--completion-windows` may add others, each a duration such as
    "24h", "90m", "3600s"). The batch expires at the window's end."""
    allowed = [w.strip() for w in allowed if w.strip()]
    m = re.fullmatch(r"\s*(\d+)\s*([hms])\s*", window or "")
    if window not in allowed or not m or int(m.group(1)) <= 0:
        raise Invalid(f"completion_window {window!r} is not supported (want {' or '.join(map(repr, allowed))})",
                      "completion_window")
    return int(m.group(1)) * {"h": 3600, "m": 60, "s": 1}[m.group(2)]


def priority(metadata: dict[str, str] | None) -> int:
    """The batch's job weight from `metadata["priority"]` (a whole number 1..MAX_PRIORITY,
    as OpenAI metadata values are strings); 1 when absent."""
    from prefixflow.shared.wire.messages import MAX_PRIORITY

    text = (metadata or {}).get("priority")
    if text is None:
        return 1
    if not str(text).strip().isdigit() or not 1 <= int(text) <= MAX_PRIORITY:
        raise Invalid(f"metadata.priority {text!r}: want a whole number from 1 to {MAX_PRIORITY}")
    return int(text)


def check_input(file, max_bytes: int, max_requests: int) -> None:
    """OpenAI's limits of a batch's input file (`Invalid` with its code): at most
    `max_bytes` bytes and `max_requests` lines (counted at upload; blank lines count)."""
    if file.bytes > max_bytes:
        raise Invalid(f"the input file has {file.bytes} bytes: a batch's input file may have at most {max_bytes} "
                      "bytes", "input_file_id", "batch_file_too_large")
    if file.lines > max_requests:
        raise Invalid(f"the input file has {file.lines} lines: a batch may have at most {max_requests} requests",
                      "input_file_id", "too_many_requests_in_batch")


def check_endpoint(endpoint: str, task: str) -> None:
    if endpoint not in URLS:
        raise Invalid(f"endpoint {endpoint!r} is not served (want one of {', '.join(URLS)})", "endpoint")
    if (endpoint == EMBED_URL) != (task == "embed"):
        raise Invalid(f"endpoint {endpoint}: this cluster's engines {'embed' if task == 'embed' else 'generate'}",
                      "endpoint")


MAX_LINE_DEPTH = MAX_SCHEMA_DEPTH + 16
"""Nesting of objects and arrays in one request line (a `json_schema` may nest
`MAX_SCHEMA_DEPTH` levels, the line's own shape adds a few): a line nested deeper is an
error line, never a RecursionError that fails the batch."""
ID_PREFIX = 64 << 10
"""Bytes at the start of a line that cannot be parsed whole (over-long, over-deep) in
which its `custom_id` is looked for (its error line names it)."""
_CUSTOM_ID = re.compile(rb'"custom_id"\s*:\s*("(?:[^"\\]|\\.)*")')


@dataclass
class Parsed:
    """What reading a batch input found (the lines themselves went to files)."""

    requests: int = 0
    """Good request lines (rows written)."""
    bad: int = 0
    """Lines that never run (error lines written), duplicates included."""
    duplicates: int = 0
    """Lines whose `custom_id` an earlier line has (OpenAI fails such a batch)."""
    errors: list[dict[str, Any]] = field(default_factory=list)
    """The bad lines as a Batch's `errors.data` entries (the first MAX_LISTED_ERRORS;
    duplicates first, since they alone fail the batch)."""


def read_lines(f, max_line_bytes: int) -> Iterator[tuple[int, bytes, int]]:
    """(line number, line, its size) of a binary file; a line over `max_line_bytes` is
    read in pieces and only its first `ID_PREFIX` bytes are kept (memory: one line up to
    the limit, whatever the file holds)."""
    n = 0
    while True:
        line = f.readline(max_line_bytes + 1)
        if not line:
            return
        n += 1
        size = len(line)
        head, rest = line[:ID_PREFIX] if size > max_line_bytes else line, line
        while size > max_line_bytes and not rest.endswith(b"\n"):  # skip the rest of the line
            rest = f.readline(1 << 20)
            if not rest:
                break
            size += len(rest)
        yield n, head, size


def custom_id_of(line: bytes) -> str | None:
    """The `custom_id` of a line that is not a good request (None if it has none)."""
    try:
        cid = json.loads(line).get("custom_id")
    except (ValueError, AttributeError, RecursionError):
        match = _CUSTOM_ID.search(line[:ID_PREFIX])
        try:
            cid = json.loads(match.group(1)) if match else None
        except ValueError:
            cid = None
    return cid if isinstance(cid, str) else None


def parse_deep(n: int, line: bytes, task: str) -> tuple[str, str, str, dict[str, Any]]:
    """`parse_line`, with a line nested deeper than `MAX_LINE_DEPTH` a BadLine (also one
    so deep that the JSON decoder gives up: RecursionError)."""
    why = f"nested deeper than {MAX_LINE_DEPTH} levels of objects and arrays"
    try:
        parsed = parse_line(n, line, set(), task)
    except RecursionError:
        raise BadLine(why) from None
    if json_depth(parsed[3], MAX_LINE_DEPTH) > MAX_LINE_DEPTH:
        raise BadLine(why)
    return parsed


class Duplicate(BadLine):
    """A `custom_id` an earlier line has."""


def parse_file(path: Path, rows_path: Path, bad_path: Path, ids_path: Path, endpoint: str, served: set[str],
               max_requests: int, adapters: frozenset[str] = frozenset(), max_line_bytes: int = 1 << 20) -> Parsed:
    """Read the batch input at `path`, streaming: the good requests as prefixflow rows
    (JSONL) to `rows_path`, their custom_ids (JSON strings, one a line) to `ids_path`, the
    error lines of the bad ones to `bad_path`. Memory is bounded whatever the file: one
    line (at most `max_line_bytes`), a digest per good id, `MAX_LISTED_ERRORS` errors.

    A line is bad when it does not parse as a request, is over `max_line_bytes` (the
    server's message limit: it could never travel) or nested deeper than
    `MAX_LINE_DEPTH`, repeats an earlier line's `custom_id` (code `duplicate_custom_id`),
    names another endpoint than the batch's, or a model the cluster does not serve:
    neither one of the base model's names (`served`) nor one of its LoRA `adapters` (its
    row's `lora`)."""
    out = Parsed()
    seen: set[bytes] = set()  # digests: 50,000 ids of any length in ~5 MiB
    listed_dups: list[dict[str, Any]] = []
    listed: list[dict[str, Any]] = []
    task = "embed" if endpoint == EMBED_URL else "generate"
    with (path.open("rb") as f, rows_path.open("w") as rows, bad_path.open("w") as bad,
          ids_path.open("w") as ids):
        for n, line, size in read_lines(f, max_line_bytes):
            if not line.strip():
                continue
            try:
                if size > max_line_bytes:
                    raise BadLine(f"line of {size} bytes is over the limit of {max_line_bytes} bytes (the server's "
                                  "message size)")
                custom_id, url, model, row = parse_deep(n, line, task)
                digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()
                if digest in seen:
                    raise Duplicate(f"duplicate custom_id {custom_id!r}: custom_id must be unique in a batch")
                seen.add(digest)
                if url != endpoint:
                    raise BadLine(f"url {url} in a batch for {endpoint}")
                if model in served:
                    row.pop(LORA_FIELD, None)  # the base model, by any of its names
                elif model and model not in adapters:
                    also = f" and the LoRA adapters {', '.join(sorted(adapters))}" if adapters else ""
                    raise BadLine(f"model {model!r} is not served here (this cluster serves {sorted(served)[0]!r}{also})")
                if out.requests >= max_requests:
                    raise BadLine(f"more than {max_requests} requests in one batch")
            except BadLine as exc:
                dup = isinstance(exc, Duplicate)
                code = "duplicate_custom_id" if dup else "invalid_request"
                out.bad += 1
                out.duplicates += dup
                bad.write(json.dumps(error_line(custom_id_of(line), f"line {n}: {exc}", code)) + "\n")
                into = listed_dups if dup else listed
                if len(into) < MAX_LISTED_ERRORS:
                    into.append({"code": code, "message": str(exc), "line": n, "param": "custom_id" if dup else None})
                continue
            out.requests += 1
            ids.write(json.dumps(custom_id) + "\n")
            rows.write(json.dumps(row) + "\n")
    out.errors = (listed_dups + listed)[:MAX_LISTED_ERRORS]
    return out


def counts(requests: int, bad: int, rows: int, errors: int) -> dict[str, int]:
    """`request_counts`: every line is counted; a line that never ran is failed."""
    return {"total": requests + bad, "completed": max(rows - errors, 0), "failed": errors + bad}


def missing_lines(ids: Iterable[str], have: set[str], code: str) -> Iterator[dict[str, Any]]:
    """Error lines of the requests without a result (a cancelled or expired batch), as
    OpenAI writes them: `response: null`, `error: {code: "batch_cancelled"|"batch_expired"}`."""
    return (not_run_line(cid, code) for cid in ids if cid not in have)


def served_names(model: str, others: str) -> set[str]:
    """The names a request may give the served model: its path or id, its last path
    component, and the configured others."""
    names = {model, Path(model).name, *(n.strip() for n in others.split(",") if n.strip())}
    return {n for n in names if n}
