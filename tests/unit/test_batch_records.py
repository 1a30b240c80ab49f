"""A batch record's changes: the compare-and-set helper (`store.update_record`) loses no
writer's change whatever the interleaving, and the lifecycle's transitions
(`batchapi/lifecycle.py`) never take a cancelled batch back to `in_progress` or
`completed`, whatever order the runner's steps and the cancel land in."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from prefixflow.batchapi import lifecycle
from prefixflow.batchapi.store import BatchRec, TooManyConflicts, update_record


class FakeKV:
    """A key-value bucket as nats.py's `KeyValue` answers `get` and `update`: a revision
    per write, and `update(last=)` refused when the key was written since. Each call
    yields to the event loop `pauses` times (drawn per call), so concurrent writers
    interleave between their read and their write."""

    def __init__(self, pauses: list[int] | None = None) -> None:
        self.values: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.pauses = list(pauses or [])
        self.conflicts = 0

    async def pause(self) -> None:
        for _ in range(self.pauses.pop(0) if self.pauses else 0):
            await asyncio.sleep(0)

    async def put(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.values[key] = (value, self.revision)
        return self.revision

    async def get(self, key: str) -> KeyValue.Entry:
        await self.pause()
        if key not in self.values:
            raise KeyNotFoundError
        value, rev = self.values[key]
        return KeyValue.Entry("B", key, value, rev, None, None, None)

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        await self.pause()
        if self.values.get(key, (b"", 0))[1] != last:
            self.conflicts += 1
            raise KeyWrongLastSequenceError
        return await self.put(key, value)


def record(status: str = "validating") -> BatchRec:
    return BatchRec("alice", "batch_1", {"id": "batch_1", "status": status, "log": [],
                                          "request_counts": {"total": 0, "completed": 0, "failed": 0}})


def append(token: str):
    def change(rec: BatchRec) -> BatchRec:
        rec.batch["log"].append(token)
        return rec

    return change


@given(writers=st.lists(st.integers(1, 4), min_size=1, max_size=6),
       pauses=st.lists(st.integers(0, 3), max_size=200))
def test_concurrent_writers_lose_no_change(writers, pauses):
    kv = FakeKV(pauses)

    async def writer(w: int, changes: int) -> None:
        for i in range(changes):
            await update_record(kv, "k", BatchRec, append(f"{w}.{i}"))

    async def main() -> BatchRec:
        await kv.put("k", msgspec.json.encode(record()))
        await asyncio.gather(*(writer(w, n) for w, n in enumerate(writers)))
        return msgspec.json.decode(kv.values["k"][0], type=BatchRec)

    log = asyncio.run(main()).batch["log"]
    assert sorted(log) == sorted(f"{w}.{i}" for w, n in enumerate(writers) for i in range(n)), "each change once"
    for w, n in enumerate(writers):  # and each writer's in its order
        assert [t for t in log if t.startswith(f"{w}.")] == [f"{w}.{i}" for i in range(n)]


def test_a_conflict_reapplies_the_change_to_what_the_other_writer_wrote():
    kv = FakeKV()

    async def main() -> BatchRec | None:
        await kv.put("k", msgspec.json.encode(record("in_progress")))
        raced = False

        def runner_step(rec: BatchRec) -> BatchRec | None:
            nonlocal raced
            if not raced:  # the tenant's cancel lands between the runner's read and write
                raced = True
                cancelled = lifecycle.cancel(7)(record("in_progress"))
                kv.values["k"] = (msgspec.json.encode(cancelled), kv.values["k"][1] + 1)
            return lifecycle.ran("")(rec)

        return await update_record(kv, "k", BatchRec, runner_step)

    rec = asyncio.run(main())
    assert kv.conflicts == 1
    assert rec.batch["status"] == "finalizing" and rec.batch["_ended"] == "cancelled"
    assert rec.batch["cancelling_at"] == 7


def test_no_change_no_write_and_a_missing_record_is_none():
    kv = FakeKV()

    async def main():
        assert await update_record(kv, "nope", BatchRec, append("x")) is None
        await kv.put("k", msgspec.json.encode(record("completed")))
        before = kv.revision
        rec = await update_record(kv, "k", BatchRec, lifecycle.cancel(1))
        assert rec.batch["status"] == "completed" and kv.revision == before

    asyncio.run(main())


def test_a_record_that_never_stops_changing_is_an_error(monkeypatch):
    import prefixflow.batchapi.store as store

    monkeypatch.setattr(store, "MAX_CONFLICTS", 5)
    kv = FakeKV()

    def always_raced(rec: BatchRec) -> BatchRec:
        kv.revision += 1
        kv.values["k"] = (kv.values["k"][0], kv.revision)
        return rec

    async def main():
        await kv.put("k", msgspec.json.encode(record()))
        await update_record(kv, "k", BatchRec, always_raced)

    with pytest.raises(TooManyConflicts):
        asyncio.run(main())


RUNNER_STEPS = {
    "validated": lifecycle.validated(50, 2, []),
    "validated-none-good": lifecycle.validated(0, 2, []),
    "counted": lifecycle.counted(10, 1),
    "ran": lifecycle.ran(""),
    "ran-expired": lifecycle.ran("expired"),
    "finished": lifecycle.finished({"output_file_id": "file_x"}),
    "cancel": lifecycle.cancel(5),
}


def apply(rec: BatchRec, change) -> BatchRec:
    new = change(msgspec.json.decode(msgspec.json.encode(rec), type=BatchRec))
    return rec if new is None else new


@given(before=st.lists(st.sampled_from(sorted(RUNNER_STEPS)), max_size=4),
       after=st.lists(st.sampled_from(sorted(RUNNER_STEPS)), max_size=8))
def test_a_cancelled_batch_never_goes_back_to_running_or_completed(before, after):
    rec = record()
    for name in before:
        rec = apply(rec, RUNNER_STEPS[name])
    rec = apply(rec, lifecycle.cancel(9))
    if rec.batch["status"] != "cancelling":
        return  # past cancelling (finalizing or final): the cancel did not apply
    at = rec.batch["cancelling_at"]
    seen = []
    for name in after:
        rec = apply(rec, RUNNER_STEPS[name])
        seen.append(rec.batch["status"])
    assert set(seen) <= {"cancelling", "finalizing", "cancelled", "expired"}, (before, after, seen)
    assert rec.batch["cancelling_at"] == at


def test_the_lifecycle_of_a_batch():
    rec = record()
    rec = apply(rec, lifecycle.validated(3, 1, []))
    assert rec.batch["status"] == "in_progress" and rec.validated and rec.batch["request_counts"]["total"] == 4
    assert "in_progress_at" in rec.batch
    rec = apply(rec, lifecycle.counted(2, 1))
    assert rec.batch["request_counts"] == {"total": 4, "completed": 1, "failed": 2}
    rec = apply(rec, lifecycle.ran(""))
    assert rec.batch["status"] == "finalizing" and rec.batch["_ended"] == ""
    assert apply(rec, lifecycle.counted(3, 0)).batch["request_counts"]["completed"] == 1  # frozen once finalizing
    rec = apply(rec, lifecycle.finished({"output_file_id": "f"}))
    assert rec.batch["status"] == "completed" and "_ended" not in rec.batch and rec.batch["output_file_id"] == "f"
    assert apply(rec, lifecycle.failed("late")).batch["status"] == "completed"

    none_good = apply(record(), lifecycle.validated(0, 2, [{"line": 1}]))
    assert none_good.batch["status"] == "failed" and none_good.batch["errors"]["data"] == [{"line": 1}]
    cancelled_first = apply(apply(record(), lifecycle.cancel(3)), lifecycle.validated(5, 0, []))
    assert cancelled_first.batch["status"] == "cancelling" and cancelled_first.requests == 5
    assert cancelled_first.validated
