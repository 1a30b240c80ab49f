"""`prefixflow bench pipeline` helpers: the extra input columns and the wiretap's counting."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.bench.pipeline import Wiretap, extra_columns, family_of, header_bytes, write_input


def test_extra_columns_cover_the_mixed_types():
    cols = extra_columns(8, 50, seed=3)
    assert list(cols) == ["doc_hash", "score", "label", "text", "flag", "created_at", "tag_ids", "meta"]
    types = {name: arr.type for name, arr in cols.items()}
    assert types["doc_hash"] == pa.int64() and types["score"] == pa.float64() and types["flag"] == pa.bool_()
    assert types["label"] == pa.string() and types["text"] == pa.string()
    assert types["created_at"] == pa.timestamp("us", tz="UTC")
    assert pa.types.is_list(types["tag_ids"]) and pa.types.is_struct(types["meta"])
    assert all(len(arr) == 50 for arr in cols.values())
    assert all(150 <= len(t) <= 200 for t in cols["text"].to_pylist())
    assert extra_columns(0, 50) == {}
    assert list(extra_columns(10, 5))[8:] == ["doc_hash_1", "score_1"]  # cycled past 8
    assert extra_columns(8, 20, seed=3)["text"].to_pylist() == extra_columns(8, 20, seed=3)["text"].to_pylist()


def test_input_file_reads_back_as_rows_with_every_column(tmp_path):
    base = {"id": pa.array(range(4), type=pa.int64()), "prompt_token_ids": pa.array([[1, 2], [3], [4, 5], [6]])}
    path = write_input(tmp_path / "in.parquet", base, extra_columns(8, 4))
    row = pq.read_table(path).to_pylist()[0]
    assert row["prompt_token_ids"] == [1, 2] and {"meta", "created_at", "tag_ids"} <= set(row)


def test_family_and_header_size():
    assert family_of("pfx.work.r0") == "work"
    assert family_of("pfx.blob.job.key.0") == "blob"
    assert family_of("pfx.route") == "route"
    assert family_of("_INBOX.x") == "other"
    assert header_bytes(None) == 0
    assert header_bytes({"Nats-Msg-Id": "j:1"}) == len("NATS/1.0\r\n") + len("Nats-Msg-Id: j:1\r\n") + 2


class _Msg:
    def __init__(self, subject: str, data: bytes, headers=None) -> None:
        self.subject, self.data, self.headers = subject, data, headers


def test_wiretap_report_per_family_and_hot_path():
    tap = Wiretap()
    tap.counting = True
    for subject, size in [("pfx.ingest.j", 1000), ("pfx.bucket.n", 300), ("pfx.work.r0", 200),
                          ("pfx.work.r1", 200), ("pfx.results.j", 100), ("pfx.status.r0", 50)]:
        asyncio.run(tap._on_msg(_Msg(subject, b"x" * size)))
    rep = tap.report(num_prompts=10)
    assert rep["bytes_per_prompt"]["ingest"] == 100.0
    assert rep["bytes_per_prompt"]["work"] == 40.0
    assert rep["bytes_per_prompt"]["blob"] == 0.0  # always listed
    assert rep["hot_path_bytes_per_prompt"] == (300 + 400 + 100) / 10
    assert list(rep["bytes_per_prompt"])[:5] == ["ingest", "bucket", "work", "results", "blob"]
    assert rep["subjects"]["work"]["messages"] == 2
