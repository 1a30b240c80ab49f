"""Nested input columns whose shape changes between rows or parts (chat `messages` with
string or list-of-parts content, per-row `sampling` objects with different keys, a
`messages` that is not even a list in an error row) are written, as JSON text where Arrow
cannot hold them as one type, and the directory still reads as one table; `outputs`,
`logprobs` and `embedding` columns of real jobs."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.client import columns
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def run_jsonl(tmp_path, rows: list[dict], parts: list[list[int]], extra: dict | None = None) -> dict:
    """Rows through the client's split (`prefixflow/client/columns.py`) and the sink's join, written
    in `parts` (lists of row indexes); returns the output rows by id."""
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (chunk,) = list(columns.chunks(path))
    kept = columns.read_ipc(chunk.kept)
    o = JobOutput("j", tmp_path / "out")
    for part in parts:
        for i in part:
            r = chunk.rows[i]
            o.add(m.Result(r["id"], b"", "out", src=r[columns.SRC_KEY], row=r[columns.ROW_KEY], **(extra or {}).get(i, {})))
        o.flush(lambda src: kept)
    return {r["id"]: r for r in pq.read_table(tmp_path / "out").to_pylist()}


def test_shape_changes_between_rows_and_parts(tmp_path):
    rows = [
        {"id": 1, "messages": [{"role": "user", "content": "a"}], "sampling": {"temperature": 1}},
        {"id": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": "b"}]}], "sampling": {"n": 2}},
        {"id": 3, "messages": "not a list", "sampling": {"max_tokens": 3, "stop": ["x"]}},
        {"id": 4, "prompt": "p"},
    ]
    logprobs = [{"token": "x", "logprob": -0.5, "top": [{"token": "x", "logprob": -0.5}]}]
    out = run_jsonl(tmp_path, rows, [[0], [1, 2], [3]], {3: {"outputs": ["x", "y"], "logprobs": logprobs}})
    assert len(out) == 4
    msgs = {i: r["messages"] if isinstance(r["messages"], list) or r["messages"] is None else json.loads(r["messages"])
            if r["messages"].startswith("[") else r["messages"] for i, r in out.items()}
    assert msgs[1] == [{"role": "user", "content": "a"}]
    assert msgs[2] == [{"role": "user", "content": [{"type": "text", "text": "b"}]}]
    assert msgs[3] == "not a list"
    assert out[4]["outputs"] == ["x", "y"] and out[4]["logprobs"][0]["logprob"] == -0.5
    assert out[1]["outputs"] is None and out[1]["logprobs"] is None


def test_embedding_column_is_fixed_size_float32(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(m.Result(1, b"", embedding=[0.5, 0.25, -1.0]))
    o.add(m.Result(2, b"", embedding=[0.0, 1.0, 2.0]))
    o.flush()
    t = pq.read_table(tmp_path)
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    assert t.column("embedding").to_pylist()[0] == [0.5, 0.25, -1.0]


def test_a_column_first_seen_in_a_later_part_reads_back(tmp_path):
    """A JSONL file's schema covers every line (the client's first pass), so a column only
    later rows have is in the first part too."""
    rows = [{"id": 1, "prompt": "x"}, {"id": 2, "messages": [{"role": "user", "content": "hi"}], "choice": ["a", "b"]},
            {"id": 3, "prompt": "y"}]
    out = run_jsonl(tmp_path, rows, [[0], [1], [2]])
    assert out[2]["messages"] == [{"role": "user", "content": "hi"}] and out[2]["choice"] == ["a", "b"]
    assert out[1]["messages"] is None and out[3]["choice"] is None
