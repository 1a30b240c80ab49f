"""No row holds a job (issue 39, item 4), the pure parts: every documented limit is an
error naming it wherever sampling enters (a row's own, the CLI's, a job spec on the
wire), the deadline arithmetic, the echo engine's stall knob against a deadline, the
sink keeping a timed-out row's error row against a late result (also after a restart),
and what `status` says a job waits on. Through the cluster: tests/nats/test_row_limits.py."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.cli.main import parse_args, sampling_from
from prefixflow.client.waiting import waiting_on
from prefixflow.services.engine_worker.engines.echo import STALL, EchoEngine
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.wire import limits
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.sampling import row_sampling


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@given(st.integers(0, 40))
def test_stop_strings_over_the_limit_are_an_error_naming_it(count):
    row = {"sampling": {"stop": [f"s{i}" for i in range(count)]}}
    if count <= limits.MAX_STOP:
        assert row_sampling(m.SamplingSpec(), row).stop == row["sampling"]["stop"]
        return
    with pytest.raises(ValueError, match=f"stop: {count} strings, over the limit of {limits.MAX_STOP} \\(docs/limits.md\\)"):
        row_sampling(m.SamplingSpec(), row)


@pytest.mark.parametrize(("row", "named"), [
    ({"sampling": {"stop": ["x" * (limits.MAX_STOP_CHARS + 1)]}}, f"over the limit of {limits.MAX_STOP_CHARS}"),
    ({"choice": [f"c{i}" for i in range(limits.MAX_CHOICES + 1)]}, f"choice: {limits.MAX_CHOICES + 1} strings"),
    ({"regex": "a" * limits.MAX_STRUCTURED_BYTES}, f"over the limit of {limits.MAX_STRUCTURED_BYTES}"),
    # NOTE: past ~150 levels the schema checker itself raised RecursionError (not a row error).
    ({"json_schema": nested(2000)}, f"levels of nesting \\(or more\\), over the limit of {limits.MAX_SCHEMA_DEPTH}"),
    ({"json_schema": json.dumps(nested(100))}, f"over the limit of {limits.MAX_SCHEMA_DEPTH}"),
])
def test_each_limit_is_a_row_error_naming_it(row, named):
    with pytest.raises(ValueError, match=named):
        row_sampling(m.SamplingSpec(), row)


def test_a_row_just_within_the_limits_passes():
    row = {"sampling": {"stop": ["x" * limits.MAX_STOP_CHARS] * limits.MAX_STOP}}
    spec = row_sampling(m.SamplingSpec(), row)
    assert spec is not None and len(spec.stop) == limits.MAX_STOP
    # Depth counts objects and arrays: a schema level here is two (the schema, its properties).
    assert limits.json_depth(nested(31), limits.MAX_SCHEMA_DEPTH) == 63
    assert limits.json_depth(nested(32), limits.MAX_SCHEMA_DEPTH) == limits.MAX_SCHEMA_DEPTH + 1
    assert limits.structured_error(nested(31), None, 0) is None


def test_the_cli_and_the_wire_refuse_a_job_over_a_limit():
    argv = ["submit", "x.jsonl", "--out", "o", *[a for i in range(5) for a in ("--stop", str(i))]]
    with pytest.raises(SystemExit, match="bad sampling parameters: stop: 5 strings, over the limit of 4"):
        sampling_from(parse_args(argv))
    # A spec written by another client is refused where a service reads it (the job fails with it).
    raw = msgspec.json.encode({"job": "j", "out_dir": "o", "sampling": {"stop": list("abcde")}})
    with pytest.raises(msgspec.ValidationError, match="over the limit of 4"):
        m.job_spec_decoder.decode(raw)


def test_row_timeout_option():
    assert parse_args(["submit", "x.jsonl", "--out", "o"]).row_timeout == limits.ROW_TIMEOUT
    assert parse_args(["run", "x.jsonl", "--out", "o", "--row-timeout", "0"]).row_timeout == 0
    with pytest.raises(SystemExit):
        parse_args(["submit", "x.jsonl", "--out", "o", "--row-timeout", "-1"])


@given(st.floats(0, 1e6), st.floats(0, 1e4), st.floats(0, 1e6))
def test_time_left(admitted, timeout, now):
    left = limits.time_left(admitted, timeout, now)
    if timeout == 0:
        assert left is None  # no deadline
    else:
        assert left == pytest.approx(admitted + timeout - now)
    assert limits.timeout_error(timeout).startswith(limits.TIMED_OUT)
    assert f"--row-timeout {timeout:g}" in limits.timeout_error(timeout)


def test_the_echo_stall_knob_holds_a_row_until_its_deadline():
    engine = EchoEngine(0.001)

    async def main():
        ok = await engine.generate("a", 1, [1, 2, 3], m.SamplingSpec(max_tokens=2))
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                await engine.generate("b", 2, [1, 2, 3], m.SamplingSpec(stop=[STALL]))
        return ok

    assert asyncio.run(main()).output_tokens == 2
    assert engine.running == 0  # the stalled request was let go


def result(pid, error=None) -> m.Result:
    return m.Result(pid, output="" if error else "ok", error=error, finish_reason=m.FinishReason.ERROR if error else m.FinishReason.STOP,
                    prompt_tokens=3, output_tokens=0 if error else 2, replica="r0")


def test_a_late_result_never_replaces_the_timed_out_row_and_is_counted(tmp_path):
    spec = m.JobSpec("j", str(tmp_path))
    out = JobOutput("j", tmp_path)
    timed_out = limits.timeout_error(3)
    assert out.add(result(1)) and out.add(result(2, timed_out)) and out.add(result(3, "other error"))
    out.flush()
    assert not out.add(result(2))  # the late result of the timed-out row: dropped, counted
    assert not out.add(result(3))  # a duplicate of another error row: dropped, not late
    assert not out.add(result(2, timed_out))  # its error row again (a redelivery): not late
    assert (out.late, out.duplicates) == (1, 3)
    summary = out.write_summary(spec)
    assert (summary["rows"], summary["errors"], summary["timed_out_rows"], summary["late_results"]) == (3, 2, 1, 1)
    # A restarted sink knows the timed-out rows from the files.
    again = JobOutput("j", tmp_path)
    assert not again.add(result(2))
    assert again.late == 1 and again.summarize(spec)["timed_out_rows"] == 1
    import pyarrow.parquet as pq

    rows = {r["id"]: r["error"] for r in pq.read_table(tmp_path).to_pylist()}
    assert rows == {1: None, 2: timed_out, 3: "other error"}


def test_status_names_the_rows_a_job_waits_on():
    statuses = [
        m.EngineStatus("r0", 0.0, oldest=[m.InEngine("j", 1, [13], 100.0), m.InEngine("other", 4, [1, 2], 50.0)]),
        m.EngineStatus("r1", 0.0, oldest=[m.InEngine("j", 1, ["x"], 90.0)]),
    ]
    waiting = waiting_on("j", 28, 30, statuses, now=112.0)
    assert (waiting.rows, waiting.in_engines, waiting.ids, waiting.replica) == (2, 2, ["x", 13], "r1")
    assert waiting.oldest_seconds == 22.0 and waiting.stuck()
    assert waiting.line("j") == "j: waiting on 2 rows: 2 in engines (ids 'x', 13), the oldest admitted 0:22 ago on replica r1"
    none = waiting_on("k", 0, 1000, statuses, now=112.0)
    assert none.in_engines == 0 and not none.stuck()
    assert "none in an engine" in none.line("k")
    far = waiting_on("other", 0, 1000, statuses, now=112.0)
    assert far.stuck() and far.line("other").endswith("; 996 not in an engine yet")  # 62 s in an engine
