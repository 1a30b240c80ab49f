"""A batch record's transitions, each a change for `Store.update_batch` (a compare-and-set
that re-applies the change to the record another writer left): pure functions of the
record as it stands, so each decides from the current status, never from a copy read
earlier. A change that does not apply returns None (the record stays as it is).

    validating --validated--> in_progress --ran--> finalizing --finished--> completed
         |            (none good: failed)                           (cancelled, expired)
         +---cancel---> cancelling --ran--> finalizing
    in_progress --cancel--> cancelling;  any but a final state --failed--> failed

A cancel wins over every runner step that comes after it: `validated` keeps a
`cancelling` batch cancelling, `ran` finalizes it as cancelled, and `counted` only
touches the counters. `cancel` leaves `finalizing` and final batches alone (OpenAI's:
their results are all in).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixflow.batchapi import batches as b
from prefixflow.batchapi.store import BatchRec, now

Change = Callable[[BatchRec], BatchRec | None]

STAMPED = frozenset({"in_progress", "finalizing", "cancelling", *b.TERMINAL})
"""States whose first entry is stamped in the Batch object (`<status>_at`, OpenAI's fields)."""
RUNNING = frozenset({"in_progress", "cancelling"})
"""States in which the batch's job may run."""
FINAL_OF = {"": "completed", "cancelled": "cancelled", "expired": "expired"}
"""How a job ended (`_ended`) -> the batch's final state."""


def enter(rec: BatchRec, status: str, **fields: Any) -> BatchRec:
    rec.batch.update(status=status, **fields)
    if status in STAMPED:
        rec.batch.setdefault(f"{status}_at", now())
    return rec


def cancel(at: int) -> Change:
    """The tenant cancels: `cancelling`, unless the batch is past the point of cancelling."""

    def change(rec: BatchRec) -> BatchRec | None:
        if rec.batch["status"] in b.TERMINAL or rec.batch["status"] in ("cancelling", "finalizing"):
            return None
        return enter(rec, "cancelling", cancelling_at=at)

    return change


def fails_validation(requests: int, duplicates: int) -> bool:
    """A batch whose input has no good request, or a `custom_id` twice (OpenAI fails it
    at validation: the results could not be told apart), fails without running."""
    return not requests or duplicates > 0


def validated(requests: int, bad: int, errors: list[dict[str, Any]], duplicates: int = 0,
              error_file_id: str | None = None) -> Change:
    """The input was read: `requests` good lines, `bad` error lines (`duplicates` of them
    repeat a custom_id). `in_progress`, or `failed` (`fails_validation`: its `errors`
    name the lines, its error file, `error_file_id`, has a line for each bad one); a batch
    cancelled meanwhile stays `cancelling` (with its counts)."""

    def change(rec: BatchRec) -> BatchRec | None:
        status = rec.batch["status"]
        if status not in ("validating", "cancelling") or rec.validated:
            return None
        rec.requests, rec.bad, rec.validated = requests, bad, True
        counts = b.counts(requests, bad, 0, 0)
        if status == "cancelling":
            rec.batch["request_counts"] = counts
            return rec
        if fails_validation(requests, duplicates):
            return enter(rec, "failed", errors={"object": "list", "data": errors}, request_counts=counts,
                         error_file_id=error_file_id)
        return enter(rec, "in_progress", request_counts=counts)

    return change


def counted(rows: int, errors: int) -> Change:
    """The job's progress: the counters of a running batch (its state untouched)."""

    def change(rec: BatchRec) -> BatchRec | None:
        if rec.batch["status"] not in RUNNING:
            return None
        counts = b.counts(rec.requests, rec.bad, rows, errors)
        if rec.batch.get("request_counts") == counts:
            return None
        rec.batch["request_counts"] = counts
        return rec

    return change


def ran(ended: str) -> Change:
    """The batch's job ended ("": every row; "cancelled"; "expired"): `finalizing`. A
    batch cancelled meanwhile ends `cancelled` even if every row made it (then every
    request has its result)."""

    def change(rec: BatchRec) -> BatchRec | None:
        status = rec.batch["status"]
        if status not in RUNNING:
            return None
        return enter(rec, "finalizing", _ended=ended or ("cancelled" if status == "cancelling" else ""))

    return change


def finished(fields: dict[str, Any]) -> Change:
    """The output and error files are written: the final state `_ended` names."""

    def change(rec: BatchRec) -> BatchRec | None:
        if rec.batch["status"] != "finalizing":
            return None
        ended = rec.batch.pop("_ended", "")
        return enter(rec, FINAL_OF[ended], **fields)

    return change


def failed(message: str) -> Change:
    """The batch cannot go on (an internal error, its input gone, its job failed)."""

    def change(rec: BatchRec) -> BatchRec | None:
        if rec.batch["status"] in b.TERMINAL:
            return None
        rec.batch.pop("_ended", None)
        return enter(rec, "failed", errors={"object": "list", "data": [
            {"code": "internal_error", "message": message, "line": None, "param": None}]})

    return change
