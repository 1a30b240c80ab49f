"""A job's schema grows, it never loses (issue 39, must-show 1), through the raw ingest
subject (`pfx.ingest.<job>`, README "Publishing prompts yourself") on the shared echo
cluster. Rows go in waves, each written (a part of its own) before the next is published,
so every widening happens across the job's part files:

- the first message malformed (an error row): every good row after it keeps its prompt
  and its other fields (the old sink dropped every column the first part lacked);
- int ids, then string ids (one of them "5", beside the int 5): every id as given, two
  rows for 5 and "5", the job done (the old sink nulled whole parts' ids and never ended);
- a field whose type changes between rows: int -> float64 while exact; int + float +
  string + nested -> text, each value its canonical text (`prefixflow/shared/widening.py`).

After the job a plain read of OUT/ (and of its merged file) gets every row, widest types;
`_summary.json` lists the final columns."""

from __future__ import annotations

import asyncio
import json
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

BIG = 2**60 + 1
"""Past 2^53: not exact in float64, so a column holding it and a float is text."""


async def publish_waves(url: str, job: str, out: str, waves: list[list[bytes | dict]]) -> m.JobStatus:
    """Create `job`, publish each wave raw (one message per row, its id in `Pfx-Id`),
    waiting until the sink has written it before the next; seal; wait for done."""
    async with Submitter(url) as client:
        await client.create(m.JobSpec(job=job, out_dir=out, sampling=m.SamplingSpec(max_tokens=2)))
        written = 0
        for wave in waves:
            for row in wave:
                data = row if isinstance(row, bytes) else json.dumps(row).encode()
                rid = 0 if isinstance(row, bytes) else row["id"]
                await client.js.publish(subjects.ingest(job), data, headers={"Pfx-Id": json.dumps(rid)})
            written += len(wave)
            deadline = time.monotonic() + 60
            while (st := await client.status(job)) is None or st.rows < written:
                assert time.monotonic() < deadline, f"{job}: the sink did not write wave {len(waves)} ({st})"
                await asyncio.sleep(0.1)
        await client.create(m.JobSpec(job=job, out_dir=out, sampling=m.SamplingSpec(max_tokens=2), total=written))
        return await client.wait(job, written, progress=False, timeout=60)


def read_out(out) -> pa.Table:
    """OUT/ as a reader gets it after the job: a plain read of the directory; each file
    (one merged file here) has the same, final schema."""
    table = pq.read_table(out)
    files = sorted(out.glob("part-*.parquet"))
    assert len({str(pq.read_schema(f)) for f in files}) == 1, [pq.read_schema(f) for f in files]
    assert ds.dataset(files[0]).schema.equals(table.schema)
    return table


async def all_jobs(url: str, tmp_path) -> dict[str, m.JobStatus]:
    prompt = "hello world number {}".format
    malformed = [[b'{"id": 0, "prompt": "broken'],
                 [{"id": i, "prompt": prompt(i), "tag": f"t{i}", "n": i} for i in range(1, 11)]]
    ids = [[{"id": i, "prompt": f"int {i}"} for i in range(8)],
           [{"id": s, "prompt": f"str {s}"} for s in ("a", "b", "5")]]
    types = [[{"id": 0, "prompt": prompt(0), "score": 1, "f": 3}, {"id": 1, "prompt": prompt(1), "score": 2, "f": 4}],
             [{"id": 2, "prompt": prompt(2), "score": 2.5, "f": 0.5}],
             [{"id": 3, "prompt": prompt(3), "score": "n/a", "big": BIG}],
             [{"id": 4, "prompt": prompt(4), "score": {"x": [1, 2]}, "big": 1.5}]]
    jobs = {"grow-malformed": malformed, "grow-ids": ids, "grow-types": types}
    done = await asyncio.gather(*(publish_waves(url, job, str(tmp_path / job), waves) for job, waves in jobs.items()))
    return dict(zip(jobs, done))


def test_raw_rows_widen_the_schema_and_lose_nothing(clusters, tmp_path):
    cluster = clusters.get(replicas=1)
    t0 = time.monotonic()
    status = asyncio.run(all_jobs(cluster.url, tmp_path))
    print(f"\nthree raw jobs in waves: {time.monotonic() - t0:.1f} s")
    assert all(st.done for st in status.values()), status

    # 1. The first message malformed: its error row, and every good row whole.
    rows = {r["id"]: r for r in read_out(tmp_path / "grow-malformed").to_pylist()}
    assert sorted(rows) == list(range(11))
    assert rows[0]["error"].startswith("malformed message") and rows[0]["prompt"] is None
    for i in range(1, 11):
        assert (rows[i]["prompt"], rows[i]["tag"], rows[i]["n"], rows[i]["error"]) == (
            f"hello world number {i}", f"t{i}", i, None), rows[i]

    # 2. Int ids then string ids: every id as given; 5 and "5" two rows; text ids.
    table = read_out(tmp_path / "grow-ids")
    assert table.schema.field("id").type == pa.string()
    got = sorted((r["id"], r["prompt"]) for r in table.to_pylist())
    want = sorted([(str(i), f"int {i}") for i in range(8)] + [(s, f"str {s}") for s in ("a", "b", "5")])
    assert got == want and all(r["error"] is None for r in table.to_pylist())
    assert status["grow-ids"].rows == 11

    # 3. A field whose type changes between rows: widened, every value kept.
    table = read_out(tmp_path / "grow-types")
    assert table.schema.field("f").type == pa.float64()  # int + float, every int exact
    assert table.schema.field("score").type == pa.string()
    assert table.schema.field("big").type == pa.string()  # 2^60 + 1 is not exact in float64
    rows = {r["id"]: r for r in table.to_pylist()}
    assert [rows[i]["score"] for i in range(5)] == ["1", "2", "2.5", "n/a", '{"x": [1, 2]}']
    assert [rows[i]["f"] for i in range(3)] == [3.0, 4.0, 0.5]
    assert (rows[3]["big"], rows[4]["big"]) == (str(BIG), "1.5")
    summary = json.loads((tmp_path / "grow-types" / "_summary.json").read_text())
    assert summary["columns"]["score"] == "string" and summary["columns"]["f"] == "double"
    assert pq.read_schema(tmp_path / "grow-types" / "_common_metadata").equals(table.schema)


def test_a_jsonl_file_whose_field_types_change_between_lines_widens_by_the_same_rules(clusters, tmp_path):
    """Issue 39: JSONL lines whose field types change (int then string in one column; a
    nested value beside a scalar; an int past 2^53 beside a float) through `prefixflow
    submit`: the job done, every value its canonical text (docs/schema-growth.md), the
    same column the same values published raw give (`widening.column_of`)."""
    from prefixflow.shared.widening import column_of
    from tests.conftest import run_cli

    cluster = clusters.get(replicas=1)
    lines = [{"id": 0, "prompt": "mixed 0", "n": 1, "x": {"k": [1, 2]}, "f": 3.0, "big": BIG, "ok": 1},
             {"id": 1, "prompt": "mixed 1", "n": "two", "x": 5, "f": "s", "big": 0.5, "ok": 2.5},
             {"id": "1", "prompt": "mixed 2", "n": 2**60, "x": [True], "f": None, "ok": 3}]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "out-mixed"
    res = run_cli("submit", str(path), "--out", str(out), "--nats", cluster.url, "--job", "jsonl-mixed",
                  "--max-tokens", "2", "--no-progress", timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    table = read_out(out)
    assert table.num_rows == 3 and all(e is None for e in table.column("error").to_pylist())
    rows = sorted(table.to_pylist(), key=lambda r: r["prompt"])
    assert [r["prompt"] for r in rows] == ["mixed 0", "mixed 1", "mixed 2"]
    want = {"n": ["1", "two", str(2**60)], "x": ['{"k": [1, 2]}', "5", "[true]"], "f": ["3", "s", None],
            "big": [str(BIG), "0.5", None], "ok": [1.0, 2.5, 3.0]}
    for name, values in want.items():
        assert [r[name] for r in rows] == values, name
        raw = column_of([x.get(name) for x in lines])  # what the raw path makes of the same values
        assert table.schema.field(name).type == raw.type and raw.to_pylist() == values, name
