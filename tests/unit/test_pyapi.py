"""The Python API's pure parts (issue 41, item 4): in-memory inputs read in fixed batches
with a fingerprint that depends on the rows, not on how they were chunked; job keywords
that are the CLI's options; the event loop thread that lets sync calls run inside a
running loop; `import prefixflow` that loads nothing heavy."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.api.options import job_options, keywords
from prefixflow.api.portal import Portal, in_running_loop
from prefixflow.client import columns
from prefixflow.client.fingerprint import of_source
from prefixflow.client.memory import kind_of, memory_source, rebatched
from prefixflow.client.sources import InputError
from prefixflow.shared.outcomes import Exit, OptionError

pytestmark = pytest.mark.timeout(120)


def table(n: int, start: int = 0) -> pa.Table:
    return pa.table({"prompt": [f"p{i}" for i in range(start, start + n)], "x": list(range(start, start + n)),
                     "note": [None if i % 3 else {"k": i} for i in range(start, start + n)]})


@given(n=st.integers(0, 300), cuts=st.lists(st.integers(1, 120), min_size=1, max_size=8), rows=st.integers(1, 64))
def test_rebatched_cuts_any_chunking_into_the_same_batches(n, cuts, rows):
    t = table(n)
    pieces, at, i = [], 0, 0
    while at < n:  # the table cut at the drawn sizes, in turn
        size = cuts[i % len(cuts)]
        pieces.extend(t.slice(at, size).to_batches())
        at, i = at + size, i + 1
    got = list(rebatched(pieces, rows))
    assert [b.num_rows for b in got] == [min(rows, n - s) for s in range(0, n, rows)]
    assert pa.Table.from_batches(got, t.schema).equals(t) if got else n == 0


def test_an_in_memory_inputs_fingerprint_is_its_rows_however_chunked_or_given():
    t = table(9000)
    as_table = of_source(memory_source(t))
    assert as_table["kind"] == "arrow" and as_table["size"] == 9000
    assert of_source(memory_source(iter(t.to_batches(max_chunksize=777)))) == as_table, "an iterator, spooled"
    assert of_source(memory_source(pa.Table.from_batches(t.to_batches(max_chunksize=1000)))) == as_table
    assert of_source(memory_source(t.to_reader())) == as_table, "a RecordBatchReader"
    changed = t.set_column(1, "x", pa.array([-1] + list(range(1, 9000))))
    assert of_source(memory_source(changed))["digest"] != as_table["digest"], "one value changed"
    assert of_source(memory_source(t.slice(0, 8999)))["digest"] != as_table["digest"]


def test_an_iterator_is_read_once_and_published_from_its_spool():
    consumed = []

    def gen():
        for b in table(5000).to_batches(max_chunksize=600):
            consumed.append(b.num_rows)
            yield b

    source = memory_source(gen(), name="stream")
    assert sum(consumed) == 5000
    chunks = list(columns.chunks(source))
    assert [len(c.rows) for c in chunks] == [4096, 904]
    assert [r["id"] for c in chunks for r in c.rows] == list(range(5000)), "ids: the row number"
    assert list(columns.chunks(source))[1].rows[-1]["prompt"] == "p4999", "read again from the spool"
    assert sum(consumed) == 5000, "the iterator itself once"


def test_batches_of_another_schema_are_kept_apart_and_widened_by_the_sink():
    a = pa.table({"prompt": ["a", "b"], "x": [1, 2]})
    b = pa.table({"prompt": ["c"], "x": ["three"]})
    source = memory_source(iter([*a.to_batches(), *b.to_batches()]))
    chunks = list(columns.chunks(source))
    assert [r["id"] for c in chunks for r in c.rows] == [0, 1, 2]
    assert [columns.read_ipc(c.kept).schema.field("x").type for c in chunks] == [pa.int64(), pa.string()]


def test_bad_in_memory_inputs_are_input_errors():
    with pytest.raises(InputError, match="no rows"):
        memory_source(table(0))
    with pytest.raises(InputError, match="not a pyarrow.RecordBatch"):
        memory_source(iter([{"prompt": "x"}]))
    with pytest.raises(InputError, match="not an input"):
        memory_source(42)
    with pytest.raises(InputError, match="no 'prompt'"):
        memory_source(pa.table({"text": ["x"]}))
    with_id, without = pa.table({"id": [7], "prompt": ["x"]}), pa.table({"prompt": ["y"]})
    with pytest.raises(InputError, match="'id' column in some batches"):
        memory_source(iter([*with_id.to_batches(), *without.to_batches()]))
    assert kind_of("prompts.parquet") is None and kind_of(table(1)) == "table"
    assert InputError("x").code == Exit.USAGE


def test_a_pandas_dataframe_is_read_a_slice_at_a_time():
    pd = pytest.importorskip("pandas", reason="pandas is optional and not installed here")
    df = pd.DataFrame({"prompt": [f"p{i}" for i in range(5000)], "x": range(5000)})
    source = memory_source(df)
    assert kind_of(df) == "pandas"
    assert of_source(source) == of_source(memory_source(pa.Table.from_pandas(df, preserve_index=False)))


def test_job_keywords_are_the_clis_options():
    from prefixflow.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if a.choices and "submit" in a.choices).choices
    for command in ("submit", "run"):
        cli = {a.dest for a in sub[command]._actions} - {"help", "input", "out", "json", "nats"}
        assert set(keywords(command)) == cli, command
    opts = job_options("submit", "<t>", "out", {"max_tokens": 4, "temperature": 0, "stop": "x", "no_dedupe": True,
                                                 "storage_options": {"region": "eu-west-1"}})
    assert (opts.sampling.max_tokens, opts.sampling.temperature, opts.sampling.stop) == (4, 0.0, ["x"])
    assert opts.args.no_dedupe and opts.args.no_progress and opts.storage_options == {"region": "eu-west-1"}


@pytest.mark.parametrize("bad, says", [
    ({"max_token": 3}, "did you mean max_tokens"), ({"max_tokens": "a"}, "invalid literal"),
    ({"max_tokens": 2.5}, "whole number"), ({"priority": 0}, "must be 1..100"), ({"overwrite": 1}, "True or False"),
    ({"task": "x"}, "one of generate, embed"), ({"row_timeout": -1}, "0 (no deadline)"),
    ({"json_schema": "{not json"}, "bad sampling parameters"), ({"temperature": None}, "want a value"),
])
def test_a_bad_keyword_is_an_option_error(bad, says):
    with pytest.raises(OptionError, match=says.replace("(", r"\(").replace(")", r"\)")) as exc:
        job_options("submit", "<t>", "out", bad)
    assert exc.value.code == Exit.USAGE and not isinstance(exc.value, SystemExit)


def test_sync_calls_work_inside_a_running_loop():
    portal = Portal()

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def notebook_cell() -> tuple[int, int, bool]:
        return portal.call(answer()), await portal.call_async(answer()), in_running_loop()

    try:
        assert asyncio.run(notebook_cell()) == (42, 42, True)
        with pytest.raises(TimeoutError):
            portal.call(asyncio.sleep(5), timeout=0.05)
    finally:
        portal.close()
        portal.close()
    with pytest.raises(RuntimeError, match="closed"):
        portal.call(answer())


def test_import_prefixflow_loads_nothing_heavy():
    code = ("import json, sys, prefixflow; prefixflow.__version__; "
            "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & {'nats', 'pyarrow', 'vllm', 'torch'})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == []
    code = "import prefixflow; print(prefixflow.JobFailed.__module__, prefixflow.run.__module__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["prefixflow.client.endings", "prefixflow.api.local"]


def test_run_inside_a_running_loop_refuses_a_bad_input_before_starting_anything(tmp_path):
    import prefixflow

    async def notebook_cell() -> None:
        with pytest.raises(prefixflow.InputError, match="no such file") as exc:
            prefixflow.run(tmp_path / "missing.parquet", out=tmp_path / "out", engine="echo")
        assert exc.value.code == Exit.USAGE
        with pytest.raises(prefixflow.OptionError, match="want one of"):
            await prefixflow.run_async(tmp_path / "missing.parquet", out=tmp_path / "out", engine="nope")

    asyncio.run(notebook_cell())
    assert not (tmp_path / "out").exists()
