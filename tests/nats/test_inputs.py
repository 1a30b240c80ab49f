"""Inputs where fleets keep them (issue 41 item 1): a directory of Parquet shards in a real
S3 API server (moto's server mode, `s3_server`), a local directory of shards of different
formats and schemas, a glob and a CSV file, each through `prefixflow submit` on the
session's shared echo cluster; and bad inputs (a bucket that does not exist, wrong
credentials, a directory with no data files), each a clear error with nothing written,
through `submit` and `run`."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import nats
import pytest
from nats.js.errors import KeyNotFoundError

from prefixflow.shared.outcomes import Exit
from prefixflow.shared.widening import SchemaGrowth
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN

pytestmark = [pytest.mark.timeout(240)]

SHARD_ROWS = (50, 1, 73, 40)


def submit(url: str, data: str | Path, out: Path, job: str, env: dict[str, str] | None = None,
           *extra: str) -> subprocess.Popen:
    import os

    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
         "--no-progress", "--no-report", "--max-tokens", "2", *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )


def settle(procs: dict[str, subprocess.Popen], timeout: float = 120) -> dict[str, tuple[int, str]]:
    out = {}
    try:
        for name, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=timeout)
            out[name] = (proc.returncode, stdout + stderr)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return out


def shard_tables(rows: tuple[int, ...] = SHARD_ROWS) -> list[pa.Table]:
    """Shards without an `id` column (ids: the row number across them), with columns whose
    bytes must come out as they went in."""
    tables, first = [], 0
    for n in rows:
        i = range(first, first + n)
        tables.append(pa.table({
            "prompt": [f"tell me about the number {k}" for k in i],
            "doc": pa.array([bytes([k % 251]) * (k % 7) for k in i], pa.binary()),
            "score": pa.array([k / 3 for k in i], pa.float32()),
        }))
        first += n
    return tables


def output(out: Path) -> pa.Table:
    table = pq.read_table(out)
    return table.take(pc.sort_indices(table, [("id", "ascending")]))


def test_a_directory_of_parquet_shards_in_s3_through_submit(clusters, s3_server, tmp_path):
    cluster = clusters.get(replicas=1)
    fs = s3_server.filesystem()
    tables = shard_tables()
    # Written out of name order; `_SUCCESS` and `.hidden` are skipped like pyarrow.dataset does.
    for i in (2, 0, 3, 1):
        pq.write_table(tables[i], f"{s3_server.bucket}/shards/part-{i:02d}.parquet", filesystem=fs)
    with fs.open_output_stream(f"{s3_server.bucket}/shards/_SUCCESS") as f:
        f.write(b"")
    pq.write_table(tables[0], f"{s3_server.bucket}/shards/.hidden.parquet", filesystem=fs)
    out = tmp_path / "out"
    t0 = time.monotonic()
    (code, text), = settle({"s3": submit(cluster.url, s3_server.uri("shards/"), out, "s3-shards", s3_server.env)}).values()
    print(f"\nsubmit of 4 S3 shards: {time.monotonic() - t0:.1f} s")
    assert code == 0, text
    got = output(out)
    want = pa.concat_tables(tables)
    assert got.column("id").to_pylist() == list(range(want.num_rows)), "every id once, numbered across the shards"
    for name in want.column_names:
        assert got.column(name).equals(want.column(name)), name  # type and bytes as they went in

    # The same command again: done at once, nothing sent.
    t0 = time.monotonic()
    (code, text), = settle({"again": submit(cluster.url, s3_server.uri("shards/"), out, "s3-shards", s3_server.env)}).values()
    print(f"the same submit again: {time.monotonic() - t0:.1f} s")
    assert code == 0 and "already done" in text, text
    assert time.monotonic() - t0 < 30


def test_a_local_directory_a_glob_and_a_csv_file(clusters, tmp_path):
    cluster = clusters.get(replicas=1)
    # A directory of shards of two formats and two schemas: `score` int64 in one, text in
    # the other; `tag` only in the first, `lang` only in the second.
    mixed = tmp_path / "mixed"
    (mixed / "_tmp").mkdir(parents=True)
    first = pa.table({"prompt": ["a", "b", "c"], "score": pa.array([1, 2, 3], pa.int64()), "tag": ["x", "y", "z"]})
    pq.write_table(first, mixed / "a.parquet")
    (mixed / "b.jsonl").write_text('{"prompt": "d", "score": "high", "lang": "en"}\n'
                                   '{"prompt": "e", "score": "low", "lang": "fr"}\n')
    pq.write_table(first, mixed / "_tmp" / "c.parquet")  # skipped: under a `_` folder
    # A glob over Parquet shards beside files it does not match.
    globbed = tmp_path / "globbed"
    globbed.mkdir()
    tables = shard_tables((20, 30, 10))
    for i, t in enumerate(tables):
        pq.write_table(t, globbed / f"day-{i}.parquet")
    pq.write_table(tables[0], globbed / "other.parquet")
    # A CSV file whose `n` column is an integer for more than pyarrow's first block.
    csv = tmp_path / "prompts.csv"
    rows = 3000
    n_values = [str(i) for i in range(rows - 1)] + ["2.5"]
    csv.write_text("id,prompt,n\n" + "".join(f'k{i},"prompt {i} with, a comma",{n}\n' for i, n in enumerate(n_values)))
    procs = {
        "mixed": submit(cluster.url, mixed, tmp_path / "out-mixed", "in-mixed"),
        "glob": submit(cluster.url, f"{globbed}/day-*.parquet", tmp_path / "out-glob", "in-glob"),
        "csv": submit(cluster.url, csv, tmp_path / "out-csv", "in-csv"),
    }
    results = settle(procs)
    for name, (code, text) in results.items():
        assert code == 0, f"{name}: {text}"

    # The shard of another schema: widened by the job's output rules (shared/widening.py).
    got = output(tmp_path / "out-mixed")
    second = pa.table({"prompt": ["d", "e"], "score": ["high", "low"], "lang": ["en", "fr"]})
    growth = SchemaGrowth()
    growth.add_table(first)
    growth.add_table(second)
    want = pa.concat_tables([growth.conform(first), growth.conform(second)])
    assert got.column("id").to_pylist() == [0, 1, 2, 3, 4]
    for name in want.column_names:
        assert got.column(name).combine_chunks().equals(want.column(name).combine_chunks()), name
    assert got.schema.field("score").type == pa.string() and got.column("score").to_pylist() == ["1", "2", "3", "high", "low"]

    got = output(tmp_path / "out-glob")
    want = pa.concat_tables(tables)
    assert got.column("id").to_pylist() == list(range(60))
    for name in want.column_names:
        assert got.column(name).equals(want.column(name)), name

    got = output(tmp_path / "out-csv")
    want = pacsv.read_csv(csv, convert_options=pacsv.ConvertOptions(column_types={"n": pa.float64()}))
    want = want.take(pc.sort_indices(want, [("id", "ascending")]))
    assert got.column("id").to_pylist() == want.column("id").to_pylist()
    assert got.schema.field("n").type == pa.float64(), "int + float in one CSV column: float64"
    assert got.column("prompt").to_pylist() == want.column("prompt").to_pylist()
    assert got.column("n").to_pylist() == want.column("n").to_pylist()


def test_bad_inputs_are_clear_errors_and_write_nothing(clusters, s3_server, tmp_path):
    cluster = clusters.get(replicas=1)
    fs = s3_server.filesystem()
    pq.write_table(shard_tables((5,))[0], f"{s3_server.bucket}/bad/part-0.parquet", filesystem=fs)
    empty = tmp_path / "empty"
    (empty / "_logs").mkdir(parents=True)
    (empty / "_SUCCESS").write_text("")
    (empty / ".part-0.parquet.crc").write_text("")
    (empty / "_logs" / "part-0.parquet").write_text("")
    wrong = {**s3_server.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret", "AWS_ACCESS_KEY_ID": "AKIANOTAKEY"}
    cases = {  # job -> (input, env, what the error says)
        "no-bucket": ("s3://no-such-bucket/shards/", s3_server.env, "bucket 'no-such-bucket' does not exist"),
        "wrong-key": (s3_server.uri("bad/"), wrong, "access denied: check the credentials"),
        "wrong-key-file": (s3_server.uri("bad/part-0.parquet"), wrong, "access denied: check the credentials"),
        "empty-dir": (str(empty), None, "no data files"),
    }
    t0 = time.monotonic()
    procs = {job: submit(cluster.url, data, tmp_path / f"out-{job}", job, env) for job, (data, env, _) in cases.items()}
    # `run` reads its input before it starts a cluster: the same errors, at once.
    runs = ("no-bucket", "empty-dir")
    procs.update({f"run-{job}": run_popen(cases[job][0], tmp_path / f"run-{job}", cases[job][1]) for job in runs})
    results = settle(procs, timeout=60)
    print(f"\nbad submits and runs settled in {time.monotonic() - t0:.1f} s")
    for job, (data, _, why) in cases.items():
        code, text = results[job]
        print(f"{job}: {text.strip().splitlines()[-1]}")
        assert code == Exit.USAGE and "error: " in text and data in text and why in text, f"{job}: {text}"
        assert "Traceback" not in text, text
        assert not (tmp_path / f"out-{job}").exists(), "nothing written"
    assert not asyncio.run(known_jobs(cluster.url, list(cases))), "no job was created"
    for job in runs:
        code, text = results[f"run-{job}"]
        assert code == Exit.USAGE and cases[job][2] in text and "Traceback" not in text, text
        assert "starting local cluster" not in text
        assert not (tmp_path / f"run-{job}").exists() and not (tmp_path / f"run-{job}-work").exists()


def run_popen(data: str, out: Path, env: dict[str, str] | None) -> subprocess.Popen:
    import os

    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "run", data, "--out", str(out), "--engine", "echo", "--replicas", "1",
         "--workdir", f"{out}-work", "--no-progress"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
    )


async def known_jobs(url: str, jobs: list[str]) -> list[str]:
    """Which of `jobs` the cluster's jobs bucket holds a spec of."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.JOBS_KV)
        found = []
        for job in jobs:
            try:
                await kv.get(job)
                found.append(job)
            except KeyNotFoundError:
                pass
        return found
    finally:
        await nc.close()
