"""The torture harness's `batch` entry point: an OpenAI Batch input file drawn from the
round's seed (pure), driven through `prefixflow serve api` with the `openai` client as a
user would (upload, create, poll, download; retried while the API is restarted under
it), and checked on what came out (pure):

- `batch-ids`: each request's `custom_id` exactly once in the output file or the error
  file (a good request in the output, a bad one in the errors), no other id; a line
  that is not JSON (no custom_id) an error line of its own;
- `batch-counts`: `request_counts` equal what the files hold and what was sent;
- `batch-status`: the status the input calls for (`completed`; `failed` for a batch
  with no good request or a duplicate custom_id, its `errors` naming the lines), reached
  without going back (validating, in_progress, finalizing, the end, as the polls saw it);
- `batch-bodies`: every output line's body a ChatCompletion / Completion by the
  `openai` package's own types;
- `batch-model`: the body's `model` the name the request asked for (a known failure:
  `prefixflow/torture/known.py`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixflow.torture.api import SERVED_NAME, ApiProcess
from prefixflow.torture.checkers import Violation
from prefixflow.torture.datasets import LONG_PROMPT_WORDS, huge_text, words

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
BAD_LINES = ("not_json", "unserved_model", "other_url", "no_body", "empty_id", "bad_sampling", "long_prompt")
"""Lines that never run (an error line each): the first five at validation, the last two
(a temperature below 0, a prompt past the model's positions) as the job's error rows."""
HUGE_BYTES = 32 * 1024
"""A huge value in a request: in its `metadata` (a field without effect on the result)."""
TERMINAL = ("completed", "failed", "cancelled", "expired")
STAGES = {"validating": 0, "in_progress": 1, "finalizing": 2, "completed": 3, "failed": 3}
"""The order a batch nobody cancels goes through (a status never goes back)."""
POLL_SECONDS = 0.3


@dataclass
class BatchSet:
    """A batch input file's lines and what each must become."""

    endpoint: str
    lines: list[bytes]
    expect: list[str]
    """Per line: `ok` (an output line), `error` (an error line from its job: it passed
    validation), `bad` (an error line from validation) or `noid` (one without a
    custom_id: the line was cut before it)."""
    custom_ids: list[str | None]
    duplicates: int = 0
    """Lines repeating an earlier custom_id (the batch fails at validation)."""
    features: list[str] = field(default_factory=list)
    kind: str = "jsonl"
    """The input file's format (an OpenAI Batch file is JSON lines)."""

    def ids(self) -> list[Any]:
        return list(range(len(self.lines)))

    @property
    def good(self) -> int:
        return self.expect.count("ok")

    @property
    def invalid(self) -> int:
        """Lines validation refuses (error lines even of a failed batch)."""
        return self.expect.count("bad") + self.expect.count("noid")

    @property
    def fails(self) -> bool:
        """OpenAI fails it at validation: no line that can run, or a custom_id twice."""
        return self.duplicates > 0 or self.invalid == len(self.lines)

    def write(self, path: Path) -> None:
        path.write_bytes(b"".join(line + b"\n" for line in self.lines))


def custom_id(rng: random.Random, i: int) -> str:
    return rng.choice(["req-", "é-", " ", "x" * 200, "日本-", "5"]) + str(i)


def request(rng: random.Random, endpoint: str, cid: str, huge: bool) -> dict[str, Any]:
    text = words(rng, rng.randrange(1, 30))
    body: dict[str, Any] = {"model": SERVED_NAME, "max_tokens": 4}
    if huge:
        body["metadata"] = {"blob": huge_text(rng, HUGE_BYTES)}
    if endpoint == CHAT:
        msgs = [{"role": "user", "content": text}]
        if rng.random() < 0.3:  # a shared system prompt: a shared prefix
            msgs.insert(0, {"role": "system", "content": "You are terse."})
        body["messages"] = msgs
    else:
        body["prompt"] = text
    if rng.random() < 0.2:
        body["temperature"] = round(rng.uniform(0, 1.5), 2)
    return {"custom_id": cid, "method": "POST", "url": endpoint, "body": body}


def make_bad(rng: random.Random, req: dict[str, Any], kind: str, endpoint: str) -> tuple[bytes, str]:
    """A bad line of `kind` made from `req`: (the line, what it must become)."""
    req = json.loads(json.dumps(req))
    if kind == "not_json":  # cut before its custom_id ends: an error line without one
        return json.dumps(req).encode()[: rng.randrange(1, len('{"custom_id": "'))], "noid"
    if kind == "unserved_model":
        req["body"]["model"] = "gpt-4o"
    elif kind == "other_url":
        req["url"] = COMPLETIONS if endpoint == CHAT else CHAT
    elif kind == "no_body":
        del req["body"]
    elif kind == "empty_id":
        req["custom_id"] = ""  # its error line names it as given
    elif kind in ("bad_sampling", "long_prompt"):  # valid as a line: the job's error row
        if kind == "bad_sampling":
            req["body"]["temperature"] = -1.0 - rng.random()
        else:
            text = words(rng, LONG_PROMPT_WORDS)
            req["body"].update({"messages": [{"role": "user", "content": text}]} if endpoint == CHAT else {"prompt": text})
        return json.dumps(req).encode(), "error"
    return json.dumps(req).encode(), "bad"


def draw(rng: random.Random, *, max_rows: int = 200) -> BatchSet:
    pick = rng.random()
    n = rng.randrange(1, 3) if pick < 0.1 else rng.randrange(3, 30) if pick < 0.5 else rng.randrange(30, max(31, max_rows + 1))
    endpoint = rng.choice((CHAT, CHAT, COMPLETIONS))
    huge_at = rng.randrange(n) if rng.random() < 0.2 else -1
    ids = [custom_id(rng, i) for i in range(n)]
    reqs = [request(rng, endpoint, cid, i == huge_at) for i, cid in enumerate(ids)]
    ds = BatchSet(endpoint, [json.dumps(r).encode() for r in reqs], ["ok"] * n, list(ids),
                  features=["chat" if endpoint == CHAT else "completions"] + (["huge values"] if huge_at >= 0 else []))
    if rng.random() < 0.5:
        for j in rng.sample(range(n), rng.randrange(1, min(n, 5) + 1)):
            kind = rng.choice(BAD_LINES)
            ds.lines[j], ds.expect[j] = make_bad(rng, reqs[j], kind, endpoint)
            ds.custom_ids[j] = None if ds.expect[j] == "noid" else "" if kind == "empty_id" else ids[j]
            ds.features.append(kind)
    good = [j for j, e in enumerate(ds.expect) if e == "ok"]
    if rng.random() < 0.1 and good:  # a good line's custom_id again: OpenAI fails the batch at validation
        ds.lines.append(ds.lines[rng.choice(good)])
        ds.expect.append("bad")
        ds.custom_ids.append(json.loads(ds.lines[-1])["custom_id"])
        ds.duplicates = 1
        ds.features.append("duplicate custom_id")
    return ds


# -- driving the API -------------------------------------------------------------------------


@dataclass
class BatchResult:
    batch: Any = None
    """The final Batch object (None: the batch never ended in time, or was never created)."""
    output: list[dict[str, Any]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)
    problem: str = ""
    """Why there is no final batch."""
    job: str = ""
    """The batch's job on the cluster (its id is the batch's), once the batch was created."""
    seen: list[str] = field(default_factory=list)
    """The statuses the polls saw, in order (each change once)."""


async def retrying(call, deadline: float, what: str):
    """`call()` until it answers (a restarted API refuses connections for a while)."""
    import openai

    while True:
        try:
            return await call()
        except (openai.APIConnectionError, openai.InternalServerError) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: no answer from the batch API in time ({type(exc).__name__}: {exc})") from None
        await asyncio.sleep(0.5)


async def run_batch(api: ApiProcess, ds: BatchSet, path: Path, timeout: float) -> BatchResult:
    """Upload, create, poll to a final status, download: as a user of the API would."""
    ds.write(path)
    deadline = time.monotonic() + timeout
    client = api.client()
    try:
        async def upload():
            with path.open("rb") as f:
                return await client.files.create(file=f, purpose="batch")

        f = await retrying(upload, deadline, "upload")
        batch = await retrying(lambda: client.batches.create(input_file_id=f.id, endpoint=ds.endpoint,
                                                             completion_window="24h"), deadline, "create")
        seen = [batch.status]
        while batch.status not in TERMINAL:
            if time.monotonic() > deadline:
                counts = batch.request_counts
                return BatchResult(problem=f"batch {batch.id} still {batch.status} after {timeout:.0f} s (counts "
                                           f"{counts.completed if counts else 0} + {counts.failed if counts else 0} "
                                           f"of {counts.total if counts else '?'})", job=batch.id)
            await asyncio.sleep(POLL_SECONDS)
            batch = await retrying(lambda: client.batches.retrieve(batch.id), deadline, "retrieve")
            if batch.status != seen[-1]:
                seen.append(batch.status)
        res = BatchResult(batch, seen=seen)
        for fid, into in ((batch.output_file_id, res.output), (batch.error_file_id, res.errors)):
            if fid:
                content = await retrying(lambda fid=fid: client.files.content(fid), deadline, "download")
                into.extend(json.loads(x) for x in content.text.splitlines() if x.strip())
        return res
    except TimeoutError as exc:
        return BatchResult(problem=str(exc))
    finally:
        await client.close()


# -- the checks --------------------------------------------------------------------------------


def check(ds: BatchSet, res: BatchResult) -> dict[str, list[Violation]]:
    """Each invariant's violations (empty: it holds)."""
    if res.batch is None:
        return {"batch-status": [Violation("batch-status", res.problem)]}
    b = res.batch
    want = "failed" if ds.fails else "completed"
    status = [] if b.status == want else [Violation("batch-status", f"status {b.status}, want {want} ({ds.good} good "
                                                                    f"lines, {ds.duplicates} duplicates)")]
    if ds.fails and b.status == "failed" and not (b.errors and b.errors.data):
        status.append(Violation("batch-status", "a failed batch whose errors name no line"))
    order = [STAGES.get(x, -1) for x in res.seen]
    if order != sorted(order) or -1 in order:
        status.append(Violation("batch-status", f"the statuses went {' -> '.join(res.seen)}"))
    c = b.request_counts
    got = (c.total, c.completed, c.failed) if c is not None else None
    total = len(ds.lines)
    sent = (total, 0, ds.invalid) if ds.fails else (total, ds.good, total - ds.good)
    files = (total, len(res.output), len(res.errors))
    counts = []
    if got != sent:
        counts.append(Violation("batch-counts", f"request_counts (total, completed, failed) {got}, sent {sent}"))
    if got != files and not ds.fails:
        counts.append(Violation("batch-counts", f"request_counts {got}, the files hold {files}"))
    return {"batch-status": status, "batch-ids": check_ids(ds, res), "batch-counts": counts, **check_bodies(ds, res)}


def check_ids(ds: BatchSet, res: BatchResult) -> list[Violation]:
    """Each custom_id once, where it belongs (a failed batch ran nothing: only the lines
    validation refused have error lines)."""
    out = Counter(x.get("custom_id") for x in res.output)
    err = Counter(x.get("custom_id") for x in res.errors)
    want_out: Counter = Counter()
    want_err: Counter = Counter()
    for cid, e in zip(ds.custom_ids, ds.expect, strict=True):
        if e in ("bad", "noid"):
            want_err[cid] += 1
        elif not ds.fails:
            (want_out if e == "ok" else want_err)[cid] += 1
    found = []
    for name, got, want in (("output", out, want_out), ("error", err, want_err)):
        wrong = [c for c in set(got) | set(want) if got[c] != want[c]]
        if wrong:
            found.append(Violation("batch-ids", f"{len(wrong)} custom_ids with the wrong number of {name} lines: "
                                   + ", ".join(f"{c!r:.60}: {got[c]} (want {want[c]})" for c in wrong[:5])))
    return found


def check_bodies(ds: BatchSet, res: BatchResult) -> dict[str, list[Violation]]:
    """`batch-bodies`: each output line has status 200 and a ChatCompletion / Completion
    body; `batch-model`: the body names the model as the request asked for it (vLLM's
    server answers with the served name the request gave, not the model's path)."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    kind = ChatCompletion if ds.endpoint == CHAT else Completion
    wrong, names = [], Counter()
    for line in res.output:
        resp = line.get("response") or {}
        try:
            body = kind.model_validate(resp.get("body"))
        except Exception as exc:  # noqa: BLE001 - pydantic's ValidationError and friends: a violation, named
            wrong.append(f"{line.get('custom_id')!r:.60}: {type(exc).__name__}")
            continue
        if resp.get("status_code") != 200:
            wrong.append(f"{line.get('custom_id')!r:.60}: status {resp.get('status_code')}")
        names[body.model] += 1
    found = {"batch-bodies": [Violation("batch-bodies", f"{len(wrong)} output lines not valid: {wrong[:5]}")] if wrong
             else []}
    other = {name: n for name, n in names.items() if name != SERVED_NAME}
    found["batch-model"] = [Violation("batch-model", f"bodies name the model {other}, the requests asked for "
                                                     f"{SERVED_NAME!r}")] if other else []
    return found
