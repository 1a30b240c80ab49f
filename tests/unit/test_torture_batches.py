"""The torture harness's `batch` entry point, its pure parts: a batch round's draw is its
seed's alone (the file, the faults, an API restart among them, never a full disk), and
its checks pass what the OpenAI Batch API promises and catch each way of breaking it
(a request lost, doubled or in the wrong file, counts or a status that lie, an output
body that is not a ChatCompletion)."""

from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.torture import batches
from prefixflow.torture.api import SERVED_NAME
from prefixflow.torture.batches import BatchResult, BatchSet
from prefixflow.torture.rounds import plan_round
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit

seeds = st.integers(0, 2**32)


def body(ds: BatchSet, cid: str) -> dict:
    common = {"id": f"x-{cid}", "created": 0, "model": SERVED_NAME,
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    if ds.endpoint == batches.CHAT:
        return {**common, "object": "chat.completion", "choices": [
            {"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "x"}}]}
    return {**common, "object": "text_completion", "choices": [{"index": 0, "finish_reason": "length", "text": "x"}]}


def faithful(ds: BatchSet) -> BatchResult:
    """What the API promises for `ds`."""
    out, errors = [], []
    for cid, e in zip(ds.custom_ids, ds.expect, strict=True):
        if e in ("bad", "noid") or (e == "error" and not ds.fails):
            errors.append({"custom_id": cid, "response": {"status_code": 400, "body": {"error": {}}}})
        elif e == "ok" and not ds.fails:
            out.append({"custom_id": cid, "response": {"status_code": 200, "body": body(ds, cid)}})
    total = len(ds.lines)
    counts = SimpleNamespace(total=total, completed=len(out), failed=total - len(out) if not ds.fails else ds.invalid)
    batch = SimpleNamespace(status="failed" if ds.fails else "completed", request_counts=counts,
                            errors=SimpleNamespace(data=[{"line": 1}]) if ds.fails else None)
    return BatchResult(batch, out, errors, seen=["validating", batch.status] if ds.fails else
                       ["validating", "in_progress", "finalizing", "completed"])


def violations(ds: BatchSet, res: BatchResult) -> list:
    return [v for found in batches.check(ds, res).values() for v in found]


def drawn(seed: int) -> BatchSet:
    return batches.draw(random.Random(seed), max_rows=40)


@settings(COSTLY)
@given(seeds, st.integers(0, 10**6))
def test_a_batch_round_is_its_seed_alone_with_an_api_restart_and_no_full_disk(seed, r):
    a, b = (plan_round(seed, r, ("batch",), disk=True, max_rows=20) for _ in range(2))
    assert a.entry == "batch" and isinstance(a.dataset, BatchSet)
    assert a.describe() == b.describe() and a.dataset.lines == b.dataset.lines
    assert all(f.kind != "disk_full" for f in a.faults) and a.second is None
    assert all(f.target in ("sigterm", "sigkill") for f in a.faults if f.kind == "api_restart")


def test_many_rounds_draw_api_restarts_bad_lines_and_failing_batches():
    plans = [plan_round(11, r, ("batch",), disk=False, max_rows=40) for r in range(60)]
    assert sum(any(f.kind == "api_restart" for f in p.faults) for p in plans) >= 15
    features = {f for p in plans for f in p.dataset.features}
    assert set(batches.BAD_LINES) <= features and "duplicate custom_id" in features
    assert any(p.dataset.fails for p in plans) and any(not p.dataset.fails for p in plans)


@settings(COSTLY)
@given(seeds)
def test_a_faithful_batch_passes_and_every_line_is_what_it_says(seed):
    ds = drawn(seed)
    assert violations(ds, faithful(ds)) == []
    n = len(ds.lines) - ds.duplicates
    assert all(line in ds.lines[:n] and e == "bad" for line, e in zip(ds.lines[n:], ds.expect[n:]))  # a line again
    for line, e in zip(ds.lines[:n], ds.expect[:n], strict=True):
        try:
            req = json.loads(line)
        except ValueError:
            assert e == "noid"
            continue
        assert e != "noid" and (e == "ok") == bool(req.get("custom_id") and req.get("body", {}).get("model") == SERVED_NAME
                                               and req["url"] == ds.endpoint
                                               and req["body"].get("temperature", 0) >= 0
                                               and len(json.dumps(req["body"].get("messages") or req["body"].get("prompt")))
                                               < 10_000)


@settings(COSTLY)
@given(seeds, st.data())
def test_a_lost_doubled_or_misfiled_request_and_lying_counts_are_caught(seed, data):
    ds = drawn(seed)
    res = faithful(ds)
    broken = []
    if res.output:
        i = data.draw(st.integers(0, len(res.output) - 1))
        line = res.output[i]
        broken += [
            BatchResult(res.batch, res.output[:i] + res.output[i + 1 :], res.errors),  # lost
            BatchResult(res.batch, res.output + [line], res.errors),  # doubled
            BatchResult(res.batch, res.output[:i] + res.output[i + 1 :], res.errors + [line]),  # in the errors
            BatchResult(res.batch, res.output[:i] + [{**line, "response": {"status_code": 200, "body": {}}}]
                        + res.output[i + 1 :], res.errors),  # not a ChatCompletion
        ]
    if res.errors:
        broken.append(BatchResult(res.batch, res.output, res.errors[1:]))
    c = res.batch.request_counts
    for lie in (dict(completed=c.completed + 1), dict(failed=c.failed + 1), dict(total=c.total - 1)):
        broken.append(BatchResult(SimpleNamespace(**{**vars(res.batch), "request_counts": SimpleNamespace(
            **{**vars(c), **lie})}), res.output, res.errors))
    other = "completed" if ds.fails else "failed"
    broken.append(BatchResult(SimpleNamespace(**{**vars(res.batch), "status": other}), res.output, res.errors))
    broken.append(BatchResult(problem="batch b still in_progress after 180 s"))
    broken.append(BatchResult(res.batch, res.output, res.errors, seen=["in_progress", "validating", res.batch.status]))
    for res_ in broken:
        assert violations(ds, res_), (ds.features, res_)
