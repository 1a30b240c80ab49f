"""Every input column keeps its Arrow type and values through `prefixflow run` (issue #22):
only model inputs travel the pipeline, the rest is kept once by the client and joined back by
the sink. One Parquet input with a column of each kind users bring (unsigned 64-bit values
>= 2^63, decimals, timestamps with a time zone, dates, binary, large strings, dictionary,
nested lists and structs, all-null, a name that collides with a generated column) and one
row with a 3 MiB document beside its prompt. Through `run` on the echo engine over two
replicas; on real vLLM through `submit` to the shared two-replica cluster
(tests/e2e/test_input_types_vllm.py: the join does not depend on the engine).
"""

from __future__ import annotations

import datetime
import decimal
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(500)]

N = 300


def input_table() -> pa.Table:
    tz = datetime.timezone.utc
    doc = "lorem ipsum " * (3 * 1024 * 1024 // 12)  # ~3 MiB in one value
    return pa.table({
        "id": pa.array(range(N), pa.int32()),
        "prompt": pa.array([f"tell me about item {i} and its neighbours" for i in range(N)]),
        "u64": pa.array([2**64 - 1 - i for i in range(N)], pa.uint64()),
        "u8": pa.array([i % 256 for i in range(N)], pa.uint8()),
        "i16": pa.array([-i for i in range(N)], pa.int16()),
        "dec": pa.array([decimal.Decimal(i) / 100 for i in range(N)], pa.decimal128(12, 2)),
        "ts": pa.array([datetime.datetime(2024, 1, 1, tzinfo=tz) + datetime.timedelta(seconds=i) for i in range(N)],
                       pa.timestamp("us", tz="Asia/Tokyo")),
        "day": pa.array([datetime.date(2020, 1, 1) + datetime.timedelta(days=i) for i in range(N)], pa.date32()),
        "raw": pa.array([bytes([i % 256]) * 3 for i in range(N)], pa.binary()),
        "big_text": pa.array([doc if i == 7 else f"t{i}" for i in range(N)], pa.large_string()),
        "cat": pa.array([["a", "b", "c"][i % 3] for i in range(N)]).dictionary_encode(),
        "tags": pa.array([[i, i + 1] if i % 2 else [] for i in range(N)], pa.list_(pa.int64())),
        "meta": pa.array([{"src": f"s{i}", "page": i} for i in range(N)]),
        "nothing": pa.nulls(N),
        "output": pa.array([f"reference {i}" for i in range(N)]),
    })


def check_every_column(data, out) -> None:
    """`out` holds every row of `data` generated, each input column with its type and values."""
    table = input_table()
    got = pq.read_table(out)
    schema_in = pq.read_schema(data)
    assert got.num_rows == N and got.column("error").null_count == N, "every row generated"
    got = got.sort_by("id")
    for f in schema_in:
        name = "input_output" if f.name == "output" else f.name
        assert got.schema.field(name).type == f.type, name
        assert got.column(name).to_pylist() == table.column(f.name).to_pylist(), name
    assert got.column("output").null_count == 0  # the generated column is the engine's


@pytest.mark.parametrize("engine", ["echo"])
def test_every_input_type_comes_out_as_it_went_in(engine, tmp_path):
    data, out, workdir = tmp_path / "in.parquet", tmp_path / "out", tmp_path / "cluster"
    pq.write_table(input_table(), data, row_group_size=128)
    res = run_cli("run", str(data), "--out", str(out), "--engine", engine, "--replicas", "2", "--workdir", str(workdir),
                  "--job", "types", "--no-progress", "--timeout", "400", "--max-tokens", "4", timeout=480)
    assert res.returncode == 0, res.stdout + res.stderr
    restarts = {n: p["restarts"] for n, p in json.loads((workdir / "pids.json").read_text())["processes"].items()}
    assert all(n == 0 for n in restarts.values()), restarts
    check_every_column(data, out)
