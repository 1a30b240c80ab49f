"""The Python API on real processes (issue 41, item 4 and must-show 3): `prefixflow.run`
on a pyarrow Table (its own local cluster of echo engines), and `prefixflow.Client` on
the session's shared echo cluster: `submit` of a Table (`status`, `wait`, the results as
a Table: every id once, input columns equal; the same again is already done, another
table into the same output refused), of a DataFrame, `cancel`, calls from inside a
running event loop (sync and async), and typed exceptions for bad input, bad options
and an unreachable cluster: nothing written, never a `SystemExit`."""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections import Counter

import pyarrow as pa
import pytest

import prefixflow
from prefixflow.shared.outcomes import JobState

pytestmark = pytest.mark.timeout(240)

ROWS = 500
JOB = {"max_tokens": 4, "temperature": 0.0}


def prompts(n: int, start: int = 0) -> pa.Table:
    """`n` prompts with columns of several Arrow types beside them (kept byte-exact)."""
    ids = range(start, start + n)
    return pa.table({
        "prompt": [f"question {i % 17}: what follows {i}?" for i in ids],
        "score": pa.array([i / 7 for i in ids], pa.float32()),
        "meta": [{"k": i, "tags": ["a"] * (i % 3)} for i in ids],
        "when": pa.array([dt.datetime(2026, 1, 1) + dt.timedelta(seconds=i) for i in ids], pa.timestamp("ms")),
    })


def check_output(got: pa.Table, given: pa.Table) -> None:
    """Every id once (the row number), each row's input columns as given."""
    ids = got.column("id").to_pylist()
    assert Counter(ids) == Counter(range(given.num_rows)), "every id exactly once"
    got = got.sort_by("id")
    for name in given.column_names:
        assert got.column(name).type == given.column(name).type, name
        assert got.column(name).combine_chunks().equals(given.column(name).combine_chunks()), name
    assert got.column("error").null_count == got.num_rows, "no error rows"


def test_run_on_a_table_starts_a_local_cluster(tmp_path, tiny_model):
    table = prompts(ROWS)
    out = tmp_path / "out"
    cluster = {"engine": "echo", "replicas": 1, "model": str(tiny_model), "no_report": True}
    result = prefixflow.run(table, out=out, **cluster, **JOB)
    assert (result.rows, result.errors, result.already_done) == (ROWS, 0, False)
    assert result.summary["rows"] == ROWS
    check_output(result.to_arrow(), table)
    again = prefixflow.run(table, out=out, **cluster, **JOB)  # OUT's manifest: done, nothing started
    assert (again.already_done, again.job, again.rows) == (True, result.job, ROWS)
    with pytest.raises(prefixflow.OutputConflict, match="asked something else"):
        prefixflow.run(prompts(ROWS, start=1), out=out, **cluster, **JOB)


@pytest.fixture
def client(clusters):
    with prefixflow.Client(clusters.get().url) as c:
        yield c


def test_submit_a_table_wait_and_read_the_results(client, tmp_path):
    table = prompts(ROWS)
    out = tmp_path / "out"
    job = client.submit(table, out=out, **JOB)
    assert job.status().state in (JobState.QUEUED, JobState.RUNNING, JobState.DONE)
    result = job.wait(timeout=120)
    assert (result.job, result.rows, result.errors, result.already_done) == (job.id, ROWS, 0, False)
    check_output(result.to_arrow(), table)
    assert result.dataset().count_rows() == ROWS
    assert job.status().state == JobState.DONE and job.done()

    again = client.submit(table.to_batches(max_chunksize=97), out=out, **JOB)  # the same rows, chunked otherwise
    assert again.id == job.id and again.wait().already_done
    with pytest.raises(prefixflow.OutputConflict, match="input: another input"):
        client.submit(prompts(ROWS, start=1), out=out, **JOB)
    with pytest.raises(prefixflow.OutputConflict, match="sampling.max_tokens 4 -> 5"):
        client.submit(table, out=out, **{**JOB, "max_tokens": 5})


def test_submit_a_dataframe(client, tmp_path):
    table = prompts(ROWS)
    try:
        import pandas

        df = table.to_pandas()
    except ImportError:
        try:
            import polars
        except ImportError:
            pytest.skip("neither pandas nor polars is installed here (both optional)")
        df = polars.from_arrow(table)
    result = client.submit(df, out=tmp_path / "out", **JOB).wait(timeout=120)
    got = result.to_arrow()
    assert Counter(got.column("id").to_pylist()) == Counter(range(ROWS))
    assert got.sort_by("id").column("prompt").to_pylist() == table.column("prompt").to_pylist()


def test_cancel_a_job(client, tmp_path):
    big = prompts(20000)
    job = client.submit(big, out=tmp_path / "out", max_in_flight=64, **JOB)
    deadline = time.monotonic() + 60
    while job.status().rows == 0:  # some rows written first: they must stay
        assert time.monotonic() < deadline, job.status()
        time.sleep(0.05)
    view = job.cancel()
    assert view.state == JobState.CANCELLED, view
    with pytest.raises(prefixflow.JobCancelled, match="cancelled"):
        job.wait(timeout=60)
    got = job.dataset().to_table()
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids)) < big.num_rows, "the rows written stay, each once"


def test_calls_from_inside_a_running_event_loop(client, tmp_path):
    table = prompts(ROWS)

    async def notebook() -> tuple[prefixflow.Result, prefixflow.Result]:
        # A notebook cell: the sync API inside a running loop, and the async one.
        sync = client.submit(table, out=tmp_path / "sync", **JOB).wait(timeout=120)
        job = await client.submit_async(iter(table.to_batches(max_chunksize=100)), out=tmp_path / "async", **JOB)
        assert (await job.status_async()).job == job.id
        return sync, await job.wait_async(timeout=120)

    sync, asynced = asyncio.run(notebook())
    check_output(sync.to_arrow(), table)
    check_output(asynced.to_arrow(), table)


def test_bad_input_options_and_cluster_are_typed_errors(client, tmp_path, tiny_model):
    out = tmp_path / "out"
    cases = [
        (prefixflow.InputError, "no such file", lambda: client.submit(tmp_path / "missing.parquet", out=out)),
        (prefixflow.InputError, "no 'prompt'", lambda: client.submit(pa.table({"text": ["x"]}), out=out)),
        (prefixflow.InputError, "no rows", lambda: client.submit(prompts(0), out=out)),
        (prefixflow.InputError, "not an input", lambda: client.submit(42, out=out)),
        (prefixflow.OptionError, "did you mean max_tokens", lambda: client.submit(prompts(3), out=out, max_token=4)),
        (prefixflow.OptionError, "invalid job id", lambda: client.submit(prompts(3), out=out, job="a b")),
        (prefixflow.InputError, "no such file",
         lambda: prefixflow.run(tmp_path / "missing", out=out, engine="echo", model=str(tiny_model))),
    ]
    for kind, says, call in cases:
        with pytest.raises(kind, match=says) as exc:
            call()
        assert not isinstance(exc.value, SystemExit) and exc.value.code == 2
    assert not out.exists(), "nothing written"
    with prefixflow.Client("nats://127.0.0.1:9", connect_timeout=1) as nowhere:
        with pytest.raises(prefixflow.ClusterError, match="cannot reach NATS"):
            nowhere.submit(prompts(3), out=out)
