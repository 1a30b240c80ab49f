"""The batch service's pure logic: reading a batch input file into rows (with the
checks a hosted batch API makes), the Batch object's states and counters, and the error
lines of requests that never got a result. No I/O but the local files given.

States (OpenAI's): `validating` -> `in_progress` -> `finalizing` -> `completed`; `failed`
when no request line can run (its `errors` name the bad lines); `cancelling` ->
`cancelled` and `expired` (after `completion_window`) keep the results written, and every
request without one gets an error line (`batch_cancelled`, `batch_expired`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixflow.client.openai_batch import BadLine, _custom_id_of, parse_line
from prefixflow.shared.openai_batch import EMBED_URL, URLS, error_line
from prefixflow.shared.wire.messages import LORA_FIELD

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
MAX_LISTED_ERRORS = 100
"""Bad lines named in a failed batch's `errors`."""


class Invalid(ValueError):
    """The create request cannot become a batch (HTTP 400)."""


def window_seconds(window: str) -> int:
    """`completion_window` ("24h", "90m", "3600s") in seconds."""
    m = re.fullmatch(r"\s*(\d+)\s*([hms])\s*", window or "")
    if not m or int(m.group(1)) <= 0:
        raise Invalid(f"completion_window {window!r}: want a duration such as '24h'")
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


def check_endpoint(endpoint: str, task: str) -> None:
    if endpoint not in URLS:
        raise Invalid(f"endpoint {endpoint!r} is not served (want one of {', '.join(URLS)})")
    if (endpoint == EMBED_URL) != (task == "embed"):
        raise Invalid(f"endpoint {endpoint}: this cluster's engines {'embed' if task == 'embed' else 'generate'}")


@dataclass
class Parsed:
    ids: list[str] = field(default_factory=list)
    """custom_id of each good request, in input order."""
    bad: list[dict[str, Any]] = field(default_factory=list)
    """Error lines of the requests that never run."""
    bad_errors: list[dict[str, Any]] = field(default_factory=list)
    """The bad lines as a Batch's `errors.data` entries (the first MAX_LISTED_ERRORS)."""


def parse_file(path: Path, rows_path: Path, endpoint: str, served: set[str], max_requests: int,
               adapters: frozenset[str] = frozenset()) -> Parsed:
    """Read the batch input at `path`; write the good requests as prefixflow rows (JSONL)
    to `rows_path`. A line is bad when it does not parse as a request, names another
    endpoint than the batch's, or a model the cluster does not serve: neither one of the
    base model's names (`served`) nor one of its LoRA `adapters` (its row's `lora`)."""
    out = Parsed()
    seen: set[str] = set()
    task = "embed" if endpoint == EMBED_URL else "generate"
    with path.open("rb") as f, rows_path.open("w") as rows:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                custom_id, url, model, row = parse_line(n, line, seen, task)
                if url != endpoint:
                    raise BadLine(f"url {url} in a batch for {endpoint}")
                if model in served:
                    row.pop(LORA_FIELD, None)  # the base model, by any of its names
                elif model and model not in adapters:
                    also = f" and the LoRA adapters {', '.join(sorted(adapters))}" if adapters else ""
                    raise BadLine(f"model {model!r} is not served here (this cluster serves {sorted(served)[0]!r}{also})")
                if len(out.ids) >= max_requests:
                    raise BadLine(f"more than {max_requests} requests in one batch")
            except BadLine as exc:
                out.bad.append(error_line(_custom_id_of(line), f"line {n}: {exc}"))
                if len(out.bad_errors) < MAX_LISTED_ERRORS:
                    out.bad_errors.append({"code": "invalid_request", "message": str(exc), "line": n, "param": None})
                continue
            out.ids.append(custom_id)
            rows.write(json.dumps(row) + "\n")
    return out


def counts(requests: int, bad: int, rows: int, errors: int) -> dict[str, int]:
    """`request_counts`: every line is counted; a line that never ran is failed."""
    return {"total": requests + bad, "completed": max(rows - errors, 0), "failed": errors + bad}


def missing_lines(ids: list[str], have: set[str], code: str) -> list[dict[str, Any]]:
    """Error lines of the requests without a result (a cancelled or expired batch)."""
    why = "the batch was cancelled" if code == "batch_cancelled" else "the batch expired"
    return [error_line(cid, f"{why} before this request ran", code) for cid in ids if cid not in have]


def served_names(model: str, others: str) -> set[str]:
    """The names a request may give the served model: its path or id, its last path
    component, and the configured others."""
    names = {model, Path(model).name, *(n.strip() for n in others.split(",") if n.strip())}
    return {n for n in names if n}
