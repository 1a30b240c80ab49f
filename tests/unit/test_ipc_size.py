"""The sink's cap on what an input-columns blob takes once read (issue 40, item 5):
`ipc_size.decompressed_bytes` reads only message headers, and must say what a read
really takes, compressed or not; `inputs.refusal` refuses a blob that inflates past the
cap, or is not Arrow IPC, before anything is decompressed; `InputCache.fetch` then treats
it as missing (null input columns, logged), so one tenant's blob cannot exhaust the
sink's memory for every job."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.sink import inputs
from prefixflow.shared.wire.ipc_size import NotArrowIpc, decompressed_bytes

pytestmark = pytest.mark.unit


def ipc(table: pa.Table, compression: str | None = None, stream: bool = False) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression=compression)
    make = pa.ipc.new_stream if stream else pa.ipc.new_file
    with make(sink, table.schema, options=opts) as writer:
        for batch in table.to_batches(max_chunksize=max(table.num_rows // 3, 1)):
            writer.write(batch)
    return sink.getvalue()


def read_size(table: pa.Table) -> int:
    """The bytes of every buffer a read of the table holds (a buffer shared by columns,
    such as one dictionary, once)."""
    seen = set()
    for column in table.columns:
        for chunk in column.chunks:
            arrays = [chunk, chunk.dictionary] if pa.types.is_dictionary(chunk.type) else [chunk]
            seen.update((b.address, b.size) for a in arrays for b in a.buffers() if b is not None and b.size)
    return sum(size for _, size in seen)


values = st.one_of(
    st.lists(st.integers(-(2**63), 2**63 - 1) | st.none(), max_size=300).map(lambda v: pa.array(v, pa.int64())),
    st.lists(st.text(max_size=20) | st.none(), max_size=300).map(lambda v: pa.array(v, pa.string())),
    st.lists(st.lists(st.floats(allow_nan=False, width=32), max_size=4) | st.none(), max_size=200).map(
        lambda v: pa.array(v, pa.list_(pa.float32()))),
    st.lists(st.sampled_from(["a", "bb", "ccc"]), max_size=300).map(lambda v: pa.array(v).dictionary_encode()),
)


@given(st.lists(values, min_size=1, max_size=4), st.sampled_from([None, "lz4", "zstd"]), st.booleans())
def test_the_headers_say_what_a_read_takes(columns, compression, stream):
    n = min(len(c) for c in columns)
    table = pa.table({f"c{i}": c.slice(0, n) for i, c in enumerate(columns)})
    blob = ipc(table, compression, stream)
    got = decompressed_bytes(blob)
    assert got == decompressed_bytes(ipc(table, None, stream)), "compressed or not, the same size once read"
    reader = pa.ipc.open_stream(blob) if stream else pa.ipc.open_file(blob)
    read = read_size(reader.read_all())
    assert abs(got - read) <= 64 * (len(table.columns) + 1) * max(len(table.to_batches()), 1), (got, read)


def test_a_small_compressed_blob_that_claims_gigabytes_is_refused_unread():
    zeros = pa.table({"z": pa.array([0] * 20_000_000, pa.int64())})
    blob = ipc(zeros, "zstd")
    assert blob.size < 200_000 and decompressed_bytes(blob) == 160_000_000
    assert "past the sink's cap" in inputs.refusal(blob.to_pybytes())
    plain = ipc(pa.table({"k": pa.array(range(100_000))}))
    assert inputs.refusal(plain.to_pybytes()) is None, "uncompressed: memory-mapped, whatever its size"
    assert inputs.refusal(ipc(pa.table({"k": pa.array(range(100_000))}), "lz4").to_pybytes()) is None
    assert "not an Arrow IPC file" in inputs.refusal(b"ARROW1\x00\x00" + b"\xff" * 64)
    with pytest.raises(NotArrowIpc):
        decompressed_bytes(b"not arrow at all, just some bytes")


@given(st.binary(max_size=400))
def test_garbage_is_refused_never_crashes(junk):
    assert inputs.refusal(junk) is None or "not an Arrow IPC file" in inputs.refusal(junk)


def test_a_refused_blob_is_missing_and_never_reaches_the_cache(tmp_path, monkeypatch):
    blobs = {"in-0": ipc(pa.table({"z": pa.array([0] * 20_000_000, pa.int64())}), "zstd").to_pybytes(),
             "in-1": ipc(pa.table({"k": pa.array([1, 2, 3])})).to_pybytes()}

    async def get_blob(js, job, name):
        return blobs[name]

    monkeypatch.setattr(inputs, "get_blob", get_blob)
    cache = inputs.InputCache(tmp_path)
    asyncio.run(cache.fetch(None, "job-a", {0, 1}))
    assert ("job-a", 0) in cache.missing and not cache.path("job-a", 0).exists()
    assert cache.table("job-a", 0) is None
    assert cache.table("job-a", 1).column("k").to_pylist() == [1, 2, 3]
