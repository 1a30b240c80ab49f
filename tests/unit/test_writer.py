"""prefixflow.services.sink.writer: dedupe by id, Parquet parts, restart, summary, input columns
named like generated ones; and the sink service's settling of messages (ack, term, nak)
against its part writes, and its bound on finished jobs, with fake NATS objects."""

from __future__ import annotations

import asyncio
import errno
import json
import types

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.errors import KeyNotFoundError

from prefixflow.services.sink import service as sink_service
from tests.unit import fakes
from prefixflow.services.sink.writer import OUTPUT_TYPES, JobOutput, input_column
from prefixflow.shared.bus.jobs import JobLookup
from prefixflow.shared.bus.poison import PRIOR_DELIVERIES
from prefixflow.shared.process.config import SinkConfig
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.messages import FinishReason, JobSpec, Result

OUTPUT_COLUMNS = tuple(OUTPUT_TYPES)

pytestmark = pytest.mark.unit


KEPT: dict[int, pa.Table] = {}
"""Input columns kept aside (as the client keeps them in blobs), by blob number."""


def keep(**columns) -> dict[str, int]:
    """Keep one row's input columns; the (src, row) reference a result carries."""
    src = len(KEPT)
    KEPT[src] = pa.Table.from_pylist([columns])
    return {"src": src, "row": 0}


def ok(rid, prompt_tokens=10, cached=0, output=5, replica="r0", **columns):
    return Result(
        rid,
        output=f"out{rid}",
        finish_reason=FinishReason.LENGTH,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        output_tokens=output,
        replica=replica,
        **keep(prompt=f"p{rid}", **columns),
    )


def ok_with(rid, inputs: dict) -> Result:
    """`ok(rid)` with these input columns (any names, also those of ok's own arguments)."""
    return msgspec.structs.replace(ok(rid), **keep(prompt=f"p{rid}", **inputs))


def err(rid, msg="boom", replica="", prompt_tokens=0, cached=0):
    return Result(
        rid,
        output="partial",
        finish_reason=FinishReason.ERROR,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        replica=replica,
        error=msg,
        **keep(prompt=f"p{rid}"),
    )


def read_dir(path):
    return pq.read_table(path).to_pylist()


@given(st.lists(st.sampled_from(["input_", "x", "_", "in"]), max_size=4), st.sampled_from([*OUTPUT_TYPES, "id", "prompt", "foo"]))
def test_input_column_is_one_to_one_and_never_a_generated_name(parts, tail):
    names = {"".join(parts[:i]) + tail for i in range(len(parts) + 1)} | {"input_" * k + tail for k in range(4)}
    renamed = {input_column(n) for n in names}
    assert len(renamed) == len(names)  # no two input columns meet
    assert not renamed & OUTPUT_TYPES.keys()  # none lands on a generated column


def test_renamed_input_columns_written_with_their_own_types(tmp_path):
    # A row without the `output` input column does not shift the others: every input
    # column lands in the same output column in every row and part, also after a restart.
    out = JobOutput("j", tmp_path)
    out.add(ok_with(1, {"output": "ref1", "prompt_tokens": "lots", "input_output": "io1"}))
    out.add(ok_with(2, {"input_output": "io2"}))
    out.flush(KEPT.get)
    again = JobOutput("j", tmp_path)
    again.add(ok_with(3, {"output": "ref3", "prompt_tokens": "few"}))
    again.flush(KEPT.get)
    rows = {r["id"]: r for r in read_dir(tmp_path)}
    assert [rows[i]["input_output"] for i in (1, 2, 3)] == ["ref1", None, "ref3"]
    assert [rows[i]["input_input_output"] for i in (1, 2, 3)] == ["io1", "io2", None]
    assert [rows[i]["input_prompt_tokens"] for i in (1, 2, 3)] == ["lots", None, "few"]
    assert [rows[i]["output"] for i in (1, 2, 3)] == ["out1", "out2", "out3"]
    assert [rows[i]["prompt_tokens"] for i in (1, 2, 3)] == [10, 10, 10]
    schema = pq.read_schema(again.parts()[1])
    assert schema.field("prompt_tokens").type == OUTPUT_TYPES["prompt_tokens"]
    assert str(schema.field("input_prompt_tokens").type) == "string"


# --- JobOutput ---------------------------------------------------------------------------


def test_duplicates_dropped_and_flush_writes_part(tmp_path):
    out = JobOutput("j", tmp_path / "o")
    assert out.add(ok(1)) is True
    assert out.add(ok(2)) is True
    assert out.add(ok(1)) is False
    assert out.add(err(2)) is False
    assert len(out.pending) == 2
    assert out.flush(KEPT.get) == 2
    assert out.flush(KEPT.get) == 0  # nothing pending: no empty part
    assert [p.name for p in out.parts()] == ["part-000000.parquet"]
    assert not list((tmp_path / "o").glob("*.tmp"))
    rows = read_dir(tmp_path / "o")
    assert sorted(r["id"] for r in rows) == [1, 2]
    assert (out.rows, out.errors, out.next_part) == (2, 0, 1)
    assert out.add(ok(2)) is False  # still deduped after the flush


def test_ids_keep_their_type_also_after_a_restart(tmp_path):
    # 1 and "1" are two prompt ids (issue 39): two rows, and a restart that reads back the
    # text id column still knows which was the integer.
    out = JobOutput("j", tmp_path)
    assert out.add(ok(1)) is True
    assert out.add(ok("1")) is True
    assert out.add(ok("2")) is True
    assert out.add(ok(1)) is False and out.add(ok("1")) is False
    assert out.seen == {1, "1", "2"}
    out.flush(KEPT.get)
    again = JobOutput("j", tmp_path)
    assert again.seen == {1, "1", "2"} and "2" in again.seen and 2 not in again.seen
    assert again.add(ok(1)) is False and again.add(ok("1")) is False and again.add(ok(2)) is True
    assert sorted(r["id"] for r in read_dir(tmp_path)) == ["1", "1", "2"]


def test_rows_have_input_and_output_columns(tmp_path):
    out = JobOutput("j", tmp_path)
    out.add(ok(1, lang="en"))
    out.add(ok(2, topic="x"))
    out.add(err(3, "nope", replica="r1"))
    assert out.flush(KEPT.get) == 3
    rows = {r["id"]: r for r in read_dir(tmp_path)}
    assert rows[1]["lang"] == "en" and rows[1]["topic"] is None and rows[1]["prompt"] == "p1"
    assert rows[2]["topic"] == "x" and rows[2]["lang"] is None
    assert rows[1]["output"] == "out1" and rows[1]["error"] is None and rows[1]["finish_reason"] == "length"
    assert rows[3]["output"] is None and rows[3]["error"] == "nope" and rows[3]["replica"] == "r1"
    assert out.errors == 1 and out.rows == 3
    names = pq.read_schema(out.parts()[0]).names
    assert names[0] == "id" and set(OUTPUT_COLUMNS) | {"prompt", "lang", "topic"} == set(names) - {"id"}


def test_restart_loads_seen_rows_errors_and_continues_numbering(tmp_path):
    d = tmp_path / "job"
    a = JobOutput("j", d)
    for i in range(1, 4):
        a.add(ok(i))
    a.add(err(4, replica="r0"))
    assert a.flush(KEPT.get) == 4
    a.add(ok(5))
    a.add(err(6, replica="r1"))
    assert a.flush(KEPT.get) == 2
    a.add(ok(7))  # pending when the sink dies: never written
    del a

    b = JobOutput("j", d)
    assert b.seen == {1, 2, 3, 4, 5, 6}
    assert (b.rows, b.errors, b.next_part) == (6, 2, 2)
    assert b.pending == []
    assert b.add(ok(3)) is False  # redelivered
    assert b.add(err(6)) is False
    assert b.add(ok(7)) is True
    assert b.add(err(8, replica="r2")) is True
    assert b.flush(KEPT.get) == 2
    assert [p.name for p in b.parts()] == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]
    assert (b.rows, b.errors) == (8, 3)
    # the restarted writer keeps the established column order
    assert pq.read_schema(b.parts()[2]).names == pq.read_schema(b.parts()[0]).names

    c = JobOutput("j", d)
    assert (c.rows, c.errors, c.next_part, len(c.seen)) == (8, 3, 3, 8)
    ids = [r["id"] for r in read_dir(d)]
    assert sorted(ids) == list(range(1, 9))  # every id exactly once


def test_numbering_continues_after_gap(tmp_path):
    a = JobOutput("j", tmp_path)
    a.add(ok(1))
    a.flush(KEPT.get)
    (tmp_path / "part-000000.parquet").rename(tmp_path / "part-000041.parquet")
    b = JobOutput("j", tmp_path)
    assert b.next_part == 42
    b.add(ok(2))
    b.flush(KEPT.get)
    assert (tmp_path / "part-000042.parquet").exists()


def test_summary_totals(tmp_path):
    d = tmp_path / "out"
    o = JobOutput("j", d)
    o.add(ok(1, prompt_tokens=100, cached=50, output=10, replica="r0"))
    o.add(ok(2, prompt_tokens=200, cached=0, output=20, replica="r1"))
    o.add(err(4, "too long", replica="", prompt_tokens=300))
    o.flush(KEPT.get)
    o.add(ok(3, prompt_tokens=100, cached=100, output=5, replica="r0"))
    o.add(err(5, "engine died", replica="r1", prompt_tokens=40, cached=40))
    o.add(ok(1, prompt_tokens=9999, cached=9999, output=9999, replica="r9"))  # duplicate: dropped
    o.flush(KEPT.get)

    spec = JobSpec("j", str(d), created_at=1000.0)
    s = o.write_summary(spec, finished_at=1010.0)
    assert s["job"] == "j"
    assert s["rows"] == 5 and s["errors"] == 2
    # token totals and the hit rate count only non-error rows
    assert (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (400, 150, 35)
    assert s["prefix_cache_hit_rate"] == 0.375
    assert s["wall_seconds"] == 10.0
    assert s["output_tokens_per_second"] == 3.5
    assert s["total_tokens_per_second"] == 43.5
    assert set(s["replicas"]) == {"r0", "r1"}
    r0, r1 = s["replicas"]["r0"], s["replicas"]["r1"]
    assert (r0["rows"], r0["errors"], r0["prompt_tokens"], r0["cached_tokens"], r0["output_tokens"]) == (2, 0, 200, 150, 15)
    assert r0["prefix_cache_hit_rate"] == 0.75
    assert r0["output_tokens_per_second"] == 1.5
    assert (r1["rows"], r1["errors"], r1["prompt_tokens"], r1["cached_tokens"], r1["output_tokens"]) == (2, 1, 200, 0, 20)
    assert r1["prefix_cache_hit_rate"] == 0.0
    assert json.loads((d / "_summary.json").read_text()) == s
    assert not (d / "_summary.json.tmp").exists()

    # the whole directory reads back as one table with every id once
    ids = sorted(r["id"] for r in read_dir(d))  # _summary.json is skipped
    assert ids == [1, 2, 3, 4, 5]

    # a restarted writer summarizes the same
    assert JobOutput("j", d).summarize(spec, finished_at=1010.0) == s


def test_summary_empty_and_without_created_at(tmp_path):
    o = JobOutput("j", tmp_path)
    s = o.summarize(JobSpec("j", str(tmp_path)))
    assert (s["rows"], s["errors"], s["prompt_tokens"], s["prefix_cache_hit_rate"]) == (0, 0, 0, 0.0)
    assert s["replicas"] == {} and s["wall_seconds"] is None
    o.add(err(1))
    o.flush(KEPT.get)
    s = o.summarize(JobSpec("j", str(tmp_path)))
    assert (s["rows"], s["errors"], s["prompt_tokens"], s["prefix_cache_hit_rate"]) == (1, 1, 0, 0.0)
    assert "output_tokens_per_second" not in s and s["replicas"] == {}


def test_read_dir_every_id_once_many_parts(tmp_path):
    o = JobOutput("j", tmp_path)
    expected = []
    for part in range(5):
        for i in range(part * 10, part * 10 + 10):
            # each part mixes ok and error rows so column types agree across parts
            o.add(ok(i) if i % 3 else err(i, replica="r0"))
            o.add(ok(i))  # duplicate
            expected.append(i)
        o.flush(KEPT.get)
    assert len(o.parts()) == 5
    ids = [r["id"] for r in read_dir(tmp_path)]
    assert sorted(ids) == expected
    assert len(ids) == len(set(ids)) == 50


def test_read_dir_when_errors_only_in_a_later_part(tmp_path):
    # part 0 has no error (error all null), part 1 only errors (output, replica all null):
    # every part still carries the real column types, so the directory reads as one table
    o = JobOutput("j", tmp_path)
    o.add(ok(1))
    o.flush(KEPT.get)
    o.add(err(2))
    o.flush(KEPT.get)
    for part in o.parts():
        schema = pq.read_schema(part)
        for name, typ in OUTPUT_TYPES.items():
            assert schema.field(name).type == typ, (part.name, name)
    rows = {r["id"]: r for r in read_dir(tmp_path)}
    assert rows[1]["output"] == "out1" and rows[1]["error"] is None
    assert rows[2]["output"] is None and rows[2]["error"] == "boom"


def test_schema_grows_also_after_restart(tmp_path):
    """A job's schema grows, it never loses (issue 39): a column null so far takes a later
    part's strings, int + float widens to float64, across a restart (the schema read back
    from the parts); once complete every file has the final schema."""
    o = JobOutput("j", tmp_path)
    o.add(ok(1, note=None, score=1))
    o.flush(KEPT.get)
    o2 = JobOutput("j", tmp_path)  # restart: the schema is read back from the part
    o2.add(ok(2, note="hello", score=2.5))
    o2.flush(KEPT.get)
    assert pq.read_schema(tmp_path / "_common_metadata").field("score").type == pa.float64()
    assert o2.rewrite_narrower() == 1  # what finishing the job does
    assert pq.read_schema(o2.parts()[0]) == pq.read_schema(o2.parts()[1]) == o2.schema
    rows = {r["id"]: r for r in read_dir(tmp_path)}
    assert rows[1]["note"] is None and rows[2]["note"] == "hello"
    assert (rows[1]["score"], rows[2]["score"]) == (1.0, 2.5)


def test_mixed_int_and_str_ids_in_one_job(tmp_path):
    # A user error (ids of two types in one job) must not leave rows stuck: the part is
    # written with that column as strings.
    o = JobOutput("j", tmp_path)
    assert o.add(ok(1)) and o.add(ok("a"))
    assert o.flush(KEPT.get) == 2 and not o.pending
    assert {r["id"] for r in read_dir(tmp_path)} == {"1", "a"}


def test_mixed_ids_still_deduped_after_restart(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(ok(1))
    o.add(ok("a"))
    o.flush(KEPT.get)
    o2 = JobOutput("j", tmp_path)  # sink restart
    assert o2.add(ok(1)) is False and o2.add(ok("a")) is False  # redelivered: already written
    assert o2.add(ok("1")) is True  # another id
    o2.flush(KEPT.get)
    assert sorted(r["id"] for r in read_dir(tmp_path)) == ["1", "1", "a"]


def test_read_dir_when_id_type_changes_between_parts(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(ok(1))
    o.flush(KEPT.get)
    o.add(ok("a"))
    o.flush(KEPT.get)
    o.rewrite_narrower()  # the job complete: the int64 part rewritten with text ids
    assert sorted(r["id"] for r in read_dir(tmp_path)) == ["1", "a"]
    assert JobOutput("j", tmp_path).seen == {1, "a"}


def test_done_until_a_new_row_is_queued(tmp_path):
    o = JobOutput("j", tmp_path)
    assert o.done is False
    o.add(ok(1))
    o.flush(KEPT.get)
    o.write_summary(JobSpec("j", str(tmp_path), total=1))
    assert o.done is True
    assert o.add(ok(1)) is False and o.done is True  # a duplicate changes nothing
    assert o.add(ok(2)) is True and o.done is False  # a new row: the summary is stale


# --- Sink: settling messages against part writes (fake NATS) -------------------------------


class Recorder:
    """What happened, in order: settles of messages with the ids on disk at that moment."""

    def __init__(self, out_dir) -> None:
        self.out_dir = out_dir
        self.events: list[tuple[str, str, set]] = []

    def on_disk(self) -> set:
        parts = sorted(self.out_dir.glob("part-*.parquet"))
        return {i for p in parts for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()}

    def settled(self, name: str) -> dict[str, set]:
        return {what: disk for what, who, disk in self.events if who == name}


class FakeMsg:
    def __init__(self, rec: Recorder, name: str, job: str, results: list[Result], prior_deliveries: int = 0) -> None:
        self.rec, self.name = rec, name
        self.subject = subjects.results(subjects.ORIGIN_INGESTOR, job)  # a service's rows: no grant (provenance: test_provenance.py)
        self.data = m.encode(m.ResultBatch(job, results))
        self.headers = {PRIOR_DELIVERIES: str(prior_deliveries)} if prior_deliveries else None
        self.metadata = fakes.meta(1, 1, "PFX_RESULTS")

    async def _settle(self, what: str) -> None:
        self.rec.events.append((what, self.name, self.rec.on_disk()))

    async def ack(self) -> None:
        await self._settle("ack")

    async def term(self) -> None:
        await self._settle("term")

    async def nak(self, delay: float | None = None) -> None:
        await self._settle("nak")


class FakeJS:
    def __init__(self) -> None:
        self.published: list[tuple[str, dict | None]] = []

    async def publish(self, subject, payload, timeout=None, headers=None) -> None:
        self.published.append((subject, headers))


class FakeJobs:
    def __init__(self, specs: dict[str, JobSpec]) -> None:
        self.specs = specs

    async def get(self, job: str, *, fresh: bool = False) -> JobLookup:
        return JobLookup(self.specs.get(job))


class FakeKV:
    def __init__(self) -> None:
        self.puts: list[m.JobStatus] = []

    async def put(self, key: str, value: bytes) -> None:
        self.puts.append(m.job_status_decoder.decode(value))

    async def get(self, key: str):
        for status in reversed(self.puts):
            if status.job == key:
                return types.SimpleNamespace(value=m.encode_json(status))
        raise KeyNotFoundError


def fake_sink(specs: dict[str, JobSpec]) -> sink_service.Sink:
    # Output is confined to out_root: here, the root of every spec's out_dir.
    sink = sink_service.Sink(SinkConfig(out_root="/"))
    sink.js, sink.jobs, sink.status_kv = FakeJS(), FakeJobs(specs), FakeKV()
    sink.pauses.connect(sink.js, sink.status_kv)
    sink.inputs = FakeInputs()
    return sink


class FakeInputs:
    """The sink's input-column cache over the test's kept columns (no blob store)."""

    async def fetch(self, js, job, srcs) -> None:
        pass

    def table(self, job, src):
        return KEPT.get(src)

    def drop(self, job) -> None:
        pass


def test_sink_terms_a_poison_message_only_once_its_error_rows_are_on_disk(tmp_path):
    out_dir = tmp_path / "out"
    rec = Recorder(out_dir)
    sink = fake_sink({"j": JobSpec("j", str(out_dir), total=4)})
    poison = FakeMsg(rec, "poison", "j", [ok(1, replica="r1"), ok(2)], prior_deliveries=10)
    normal = FakeMsg(rec, "normal", "j", [ok(3), ok(4)])

    async def go() -> None:
        await sink.take(poison)
        await sink.take(normal)
        assert rec.events == [], "nothing settled before the part is written"
        assert [s for s, _ in sink.js.published] == [subjects.dead(poison.subject)], "dead-lettered at once"
        await sink.flush()

    asyncio.run(go())
    assert rec.settled("poison") == {"term": {1, 2, 3, 4}}, rec.events
    assert rec.settled("normal") == {"ack": {1, 2, 3, 4}}, rec.events
    rows = {r["id"]: r for r in read_dir(out_dir)}
    assert all("poison" in rows[i]["error"] for i in (1, 2)) and rows[1]["replica"] == "r1"
    assert rows[3]["error"] is None and rows[3]["output"] == "out3"
    assert sink.held == {} and sink.status_kv.puts[-1].done


def test_sink_parks_a_poison_message_whose_part_write_fails(tmp_path, monkeypatch):
    """A full disk is not the job's fault: the job pauses and its error rows are parked
    (kept in JetStream with the deliveries that were their own), never dropped (a fault
    of the job's own fails it instead: tests/unit/test_sink_boundary.py)."""
    out_dir = tmp_path / "out"
    rec = Recorder(out_dir)
    sink = fake_sink({"j": JobSpec("j", str(out_dir), total=2)})
    poison = FakeMsg(rec, "poison", "j", [ok(1), ok(2)], prior_deliveries=10)

    def broken_flush(self, *args):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def go() -> None:
        await sink.take(poison)
        monkeypatch.setattr(JobOutput, "flush", broken_flush)
        await sink.flush()

    asyncio.run(go())
    assert rec.settled("poison") == {"ack": set()}, rec.events  # parked, not lost
    [(subject, headers)] = [p for p in sink.js.published if p[0] == subjects.parked("j")]
    assert headers[PRIOR_DELIVERIES] == "10", "the full disk's delivery is not counted, the earlier ones are"
    assert "j" in sink.pauses and "No space left" in sink.status_kv.puts[-1].paused
    out = sink.outputs["j"]
    assert out.pending == [] and out.seen == set(), "its rows are taken again on redelivery"


def test_sink_keeps_no_state_per_finished_job_and_summarises_each_once(tmp_path, monkeypatch):
    limit = 4
    monkeypatch.setattr(sink_service, "MAX_OPEN_JOBS", limit)
    summaries = []
    write_summary = JobOutput.write_summary

    def counting(self, spec, finished_at=None):
        summaries.append(self.job)
        return write_summary(self, spec, finished_at)

    monkeypatch.setattr(JobOutput, "write_summary", counting)
    jobs = [f"job{i}" for i in range(5 * limit)]
    sink = fake_sink({j: JobSpec(j, str(tmp_path / j), total=1) for j in jobs})
    rec = Recorder(tmp_path)

    def per_job_state() -> dict[str, int]:
        return {k: len(v) for k, v in vars(sink).items() if isinstance(v, dict | set | list)}

    async def go() -> None:
        for job in jobs:
            await sink.take(FakeMsg(rec, job, job, [ok(1)]))
            await sink.flush()  # writes the part, completes the job
            for _ in range(3):
                await sink.check_jobs()  # a finished job is not summarised again
            assert all(n <= limit for n in per_job_state().values()), per_job_state()

    asyncio.run(go())
    assert summaries == jobs, "each job summarised exactly once"
    assert sum(st.done for st in sink.status_kv.puts) == len(jobs)
