"""Nested input columns whose shape changes between rows or parts (chat `messages` with
string or list-of-parts content, per-row `sampling` objects with different keys, a
`messages` that is not even a list in an error row) are written, as JSON text where Arrow
cannot hold them as one type, and the directory still reads as one table; `outputs`,
`logprobs` and `embedding` columns of real jobs."""

from __future__ import annotations

import json

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.sink.writer import JobOutput
from shared.wire import messages as m

pytestmark = pytest.mark.unit


def result(i, columns, **kw):
    return m.Result(i, msgspec.msgpack.encode(columns), "out", **kw)


def test_shape_changes_between_rows_and_parts(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(result(1, {"messages": [{"role": "user", "content": "a"}], "sampling": {"temperature": 1}}))
    o.flush()  # part 0: messages list<struct<..., content: string>>, sampling struct<temperature>
    o.add(result(2, {"messages": [{"role": "user", "content": [{"type": "text", "text": "b"}]}], "sampling": {"n": 2}}))
    o.add(result(3, {"messages": "not a list", "sampling": {"max_tokens": 3, "stop": ["x"]}}))
    o.flush()
    o.add(result(4, {"prompt": "p"}, outputs=["x", "y"], logprobs=[{"token": "x", "logprob": -0.5, "top": [{"token": "x", "logprob": -0.5}]}]))
    o.flush()
    rows = {r["id"]: r for r in pq.read_table(tmp_path).to_pylist()}
    assert len(rows) == 4
    msgs = {i: r["messages"] if isinstance(r["messages"], list) or r["messages"] is None else json.loads(r["messages"])
            if r["messages"].startswith("[") else r["messages"] for i, r in rows.items()}
    assert msgs[1] == [{"role": "user", "content": "a"}]
    assert msgs[2] == [{"role": "user", "content": [{"type": "text", "text": "b"}]}]
    assert msgs[3] == "not a list"
    assert rows[4]["outputs"] == ["x", "y"] and rows[4]["logprobs"][0]["logprob"] == -0.5
    assert rows[1]["outputs"] is None and rows[1]["logprobs"] is None


def test_embedding_column_is_fixed_size_float32(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(m.Result(1, b"", embedding=[0.5, 0.25, -1.0]))
    o.add(m.Result(2, b"", embedding=[0.0, 1.0, 2.0]))
    o.flush()
    t = pq.read_table(tmp_path)
    assert t.schema.field("embedding").type == pa.list_(pa.float32(), 3)
    assert t.column("embedding").to_pylist()[0] == [0.5, 0.25, -1.0]


def test_a_column_first_seen_in_a_later_part_reads_back(tmp_path):
    o = JobOutput("j", tmp_path)
    o.add(m.error_result(1, "bad sampling", msgspec.msgpack.encode({"prompt": "x"})))
    o.flush()  # a part of error rows first (the ingestor's), no `messages`
    o.add(result(2, {"messages": [{"role": "user", "content": "hi"}], "choice": ["a", "b"]}))
    o.flush()
    o.add(result(3, {"prompt": "y"}))
    o.flush()
    rows = {r["id"]: r for r in pq.read_table(tmp_path).to_pylist()}
    assert rows[2]["messages"] == [{"role": "user", "content": "hi"}] and rows[2]["choice"] == ["a", "b"]
    assert rows[1]["messages"] is None and rows[3]["choice"] is None
