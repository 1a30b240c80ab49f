"""Outputs where fleets keep them (issue 41 item 2): `--out s3://bucket/prefix/` written by
the sink into a real S3 API server (moto's server mode, `s3_server`), with the sink's own
credentials (none in the job's spec), on the session's shared echo cluster whose sink is
swapped, for these tests, for one with the server's credentials and the bucket's prefix
among its output roots (`PFX_OUT_ROOT`).

- 4 Parquet shards in S3 -> s3://.../out/: every id once, input columns byte-exact, a
  plain `pyarrow.dataset` read of the prefix sees each row once, only committed objects
  there; the same command again: exit 0, "already done";
- the sink and the client SIGKILLed mid-job, then the command again: it completes, every
  id once, no multipart upload left open, only final objects under the prefix;
- a bucket that does not exist, wrong credentials, a prefix outside the sink's roots:
  each a clear error, nothing written, and the sink goes on with the next job."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import time

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from prefixflow.launch.processes import Process
from prefixflow.shared.outcomes import Exit
from tests.conftest import REPO, VENV_BIN
from tests.nats.test_inputs import settle, shard_tables, submit

pytestmark = [pytest.mark.timeout(300)]

FINAL = {"_job.json", "_summary.json", "_common_metadata", "_manifest.json"}
"""The objects beside the data files of a finished job's output."""
NO_BUCKET = "s3://no-such-bucket-pfx/out"
FILES = "s3://pfx-data/batch-files"
"""The batch service's files (`--files-uri`), for the API and the sink of this module."""


class S3Sink:
    """The shared cluster's sink swapped for one that may write to the S3 server."""

    def __init__(self, cluster, s3_server, root) -> None:
        self.cluster, self.s3 = cluster, s3_server
        self.original = next(p for p in cluster.procs if p.name == "sink")
        roots = f"{root},{s3_server.uri('out')},{NO_BUCKET}"
        self.s3_sink = dataclasses.replace(self.original, env={**self.original.env, **s3_server.env,
                                                                "PFX_OUT_ROOT": roots, "PFX_FILES_URI": FILES})

    def start(self, proc: Process | None = None, *, kill: bool = False) -> None:
        """Stop the running sink (SIGKILL with `kill`), start `proc` (the S3 one)."""
        import asyncio

        running = self.cluster.running["sink"]
        running.kill() if kill else running.terminate()
        running.wait(15)
        self.cluster.start_one(proc or self.s3_sink)
        asyncio.run(self.cluster.wait_started(["sink"], timeout=60))

    def restore(self) -> None:
        self.start(self.original)


@pytest.fixture(scope="module")
def s3_sink(clusters, s3_server, sink_out_root):
    """Swapped once for this module's tests (a sink start is seconds), restored after."""
    cluster = clusters.get(replicas=1)
    sink = S3Sink(cluster, s3_server, sink_out_root)
    sink.start()
    try:
        yield sink
    finally:
        sink.restore()


def run_s3(data: str, out: str, env: dict[str, str], workdir) -> subprocess.Popen:
    """`prefixflow run` (echo engine) with `env` (the run's sink: its credentials); it
    writes its report too (into the bucket, under `_report/`)."""
    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "run", data, "--out", out, "--engine", "echo", "--replicas", "1",
         "--workdir", str(workdir / "run-work"), "--no-progress", "--max-tokens", "2"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
    )


def objects(s3_server, prefix: str) -> dict[str, int]:
    """Object name below `prefix` -> size (every depth)."""
    import pyarrow.fs as pafs

    fs = s3_server.filesystem()
    infos = fs.get_file_info(pafs.FileSelector(f"{s3_server.bucket}/{prefix}", recursive=True, allow_not_found=True))
    base = f"{s3_server.bucket}/{prefix}/"
    return {i.path[len(base):]: i.size for i in infos if i.type == pafs.FileType.File}


def open_uploads(s3_server) -> list[str]:
    import boto3

    client = boto3.client("s3", endpoint_url=s3_server.endpoint, region_name="us-east-1",
                          aws_access_key_id=s3_server.key, aws_secret_access_key=s3_server.secret)
    return [u["Key"] for u in client.list_multipart_uploads(Bucket=s3_server.bucket).get("Uploads", [])]


def read_out(s3_server, prefix: str) -> pa.Table:
    """A plain pyarrow.dataset read of the prefix, sorted by id."""
    table = ds.dataset(f"{s3_server.bucket}/{prefix}", filesystem=s3_server.filesystem(), format="parquet").to_table()
    return table.take(pc.sort_indices(table, [("id", "ascending")]))


def assert_final(s3_server, prefix: str) -> list[str]:
    """Only the manifest's data files and the job's small files under the prefix (and the
    report's files, under `_report/`)."""
    names = {n for n in objects(s3_server, prefix) if not n.startswith("_report/")}
    manifest = json.loads(s3_server.filesystem().open_input_stream(f"{s3_server.bucket}/{prefix}/_manifest.json").read())
    assert set(names) == FINAL | set(manifest["files"]), names
    assert not open_uploads(s3_server), "no multipart upload left open"
    return manifest["files"]


def pid_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper has ended)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def counted_prompts(tmp_path, n: int):
    """A Parquet file of `n` prompts and an int32 column `k` = the row number."""
    data = tmp_path / "prompts.parquet"
    pq.write_table(pa.table({"prompt": [f"count to {i}" for i in range(n)], "k": pa.array(range(n), pa.int32())}), data)
    return data


def kill_once_a_part_is_in(proc: subprocess.Popen, s3_server, prefix: str) -> None:
    """SIGKILL `proc` (a `submit` or `run`) once a part is in the bucket, mid-job (the
    job's summary not written yet)."""
    try:
        deadline = time.monotonic() + 120
        while not any(name.startswith("part-") for name in objects(s3_server, prefix)):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no part written"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.communicate()
    assert "_summary.json" not in objects(s3_server, prefix), "the kill landed after the job's end"


def test_s3_shards_to_an_s3_out_through_submit_then_again(s3_sink, s3_server, tmp_path):
    cluster, fs = s3_sink.cluster, s3_server.filesystem()
    tables = shard_tables()
    for i, table in enumerate(tables):
        pq.write_table(table, f"{s3_server.bucket}/in-shards/part-{i:02d}.parquet", filesystem=fs)
    out = s3_server.uri("out/shards/")
    t0 = time.monotonic()
    (code, text), = settle({"s3": submit(cluster.url, s3_server.uri("in-shards/"), out, "s3-out", s3_server.env)}).values()
    print(f"\nsubmit of 4 S3 shards to an S3 out: {time.monotonic() - t0:.1f} s")
    assert code == 0, text
    files = assert_final(s3_server, "out/shards")
    got, want = read_out(s3_server, "out/shards"), pa.concat_tables(tables)
    assert got.column("id").to_pylist() == list(range(want.num_rows)), "every id once"
    for name in want.column_names:
        assert got.column(name).equals(want.column(name)), name  # type and bytes as they went in
    assert pq.read_table(f"{s3_server.bucket}/out/shards/{files[0]}", filesystem=fs).num_rows > 0
    summary = json.loads(fs.open_input_stream(f"{s3_server.bucket}/out/shards/_summary.json").read())
    assert summary["rows"] == want.num_rows
    job = json.loads(fs.open_input_stream(f"{s3_server.bucket}/out/shards/_job.json").read())
    assert job["job"] == "s3-out" and "fingerprint" in job

    before = objects(s3_server, "out/shards")
    (code, text), = settle({"again": submit(cluster.url, s3_server.uri("in-shards/"), out, "s3-out", s3_server.env)}).values()
    assert code == 0 and "already done" in text, text
    assert objects(s3_server, "out/shards") == before and assert_final(s3_server, "out/shards") == files

    # `prefixflow report` reads it by its manifest, into a local --dest.
    report = subprocess.run([str(VENV_BIN / "prefixflow"), "report", out, "--dest", str(tmp_path / "report"), "--no-groups"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, **s3_server.env})
    assert report.returncode == 0 and (tmp_path / "report" / "index.html").exists(), report.stdout + report.stderr


def test_s3_shards_to_an_s3_out_through_run_then_again(s3_server, tmp_path):
    """`run`'s own cluster and sink (its sink allowed exactly this --out)."""
    fs = s3_server.filesystem()
    tables = shard_tables()
    for i, table in enumerate(tables):
        pq.write_table(table, f"{s3_server.bucket}/run-shards/part-{i:02d}.parquet", filesystem=fs)
    out = s3_server.uri("out/run/")
    (code, text), = settle({"run": run_s3(s3_server.uri("run-shards/"), out, s3_server.env, tmp_path)}).values()
    assert code == 0, text
    assert_final(s3_server, "out/run")
    report = {n for n in objects(s3_server, "out/run") if n.startswith("_report/")}
    assert {"_report/index.html", "_report/bucket_sizes.png"} <= report, (report, text)
    assert f"report: {out}_report/index.html" in text, text
    got, want = read_out(s3_server, "out/run"), pa.concat_tables(tables)
    assert got.column("id").to_pylist() == list(range(want.num_rows))
    for name in want.column_names:
        assert got.column(name).equals(want.column(name)), name
    (code, text), = settle({"again": run_s3(s3_server.uri("run-shards/"), out, s3_server.env, tmp_path)}).values()
    assert code == 0 and "already done" in text and "starting local cluster" not in text, text


def test_sigkilled_mid_job_then_again_completes_once(s3_sink, s3_server, tmp_path):
    cluster = s3_sink.cluster
    n = 5_000
    data = counted_prompts(tmp_path, n)
    out = s3_server.uri("out/killed")
    kill_once_a_part_is_in(submit(cluster.url, data, out, "s3-killed", s3_server.env), s3_server, "out/killed")
    s3_sink.start(kill=True)  # the sink too: SIGKILL, then a new one (recovers from the bucket)
    before = objects(s3_server, "out/killed")
    (code, text), = settle({"again": submit(cluster.url, data, out, "s3-killed", s3_server.env)}, timeout=240).values()
    assert code == 0, text
    print(f"\nkilled with {sum(n.startswith('part-') for n in before)} parts in the bucket; then: {text.splitlines()[-3:]}")
    assert_final(s3_server, "out/killed")
    got = read_out(s3_server, "out/killed")
    assert got.column("id").to_pylist() == list(range(n)), "every id once"
    assert got.column("k").equals(pa.chunked_array([pa.array(range(n), pa.int32())]))


def test_bad_outputs_are_clear_errors_and_the_sink_goes_on(s3_sink, s3_server, tmp_path):
    cluster = s3_sink.cluster
    data = tmp_path / "few.parquet"
    pq.write_table(pa.table({"prompt": [f"p{i}" for i in range(5)]}), data)
    cases = {
        "no-bucket": (f"{NO_BUCKET}/j", "does not exist"),
        "outside": (s3_server.uri("elsewhere/j"), "outside the sink's allowed output URIs"),
    }
    # `run` checks the bucket with its own sink's credentials before it starts anything.
    wrong_env = {**s3_server.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"}
    runs = {"run-no-bucket": (f"{NO_BUCKET}/run", s3_server.env, "does not exist"),
            "run-wrong-key": (s3_server.uri("out/run-denied"), wrong_env, "access denied: check the credentials")}
    procs = {job: submit(cluster.url, data, out, f"s3-bad-{job}", s3_server.env) for job, (out, _) in cases.items()}
    procs |= {n: run_s3(str(data), out, env, tmp_path / n) for n, (out, env, _) in runs.items()}
    for job, (code, text) in settle(procs).items():
        if job in runs:
            assert code == Exit.USAGE and runs[job][2] in text and "starting local cluster" not in text, (job, text)
        else:
            assert code == Exit.FAILED and cases[job][1] in text and "Traceback" not in text, (job, text)
    # Wrong credentials at the sink (the job's spec carries none): its own fault, told.
    wrong = dataclasses.replace(s3_sink.s3_sink, env={**s3_sink.s3_sink.env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    s3_sink.start(wrong)
    (code, text), = settle({"denied": submit(cluster.url, data, s3_server.uri("out/denied"), "s3-bad-key")}).values()
    assert code == Exit.FAILED and "refused the sink's credentials" in text, text
    s3_sink.start()
    assert objects(s3_server, "elsewhere") == {} and objects(s3_server, "out/denied") == {}, "nothing written"
    assert objects(s3_server, "out/run-denied") == {}
    # The sink is alive and writes the next job.
    (code, text), = settle({"next": submit(cluster.url, data, s3_server.uri("out/next"), "s3-next")}).values()
    assert code == 0, text
    assert read_out(s3_server, "out/next").column("id").to_pylist() == list(range(5))


def test_python_api_reads_an_s3_out_by_its_manifest(s3_sink, s3_server, monkeypatch):
    """`Client.submit(table, out="s3://...")`: the handle keeps the URI, and `to_arrow`
    reads the committed files with this process's credentials."""
    import prefixflow

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    n = 300
    table = pa.table({"prompt": [f"say {i}" for i in range(n)], "k": pa.array(range(n), pa.int16())})
    out = s3_server.uri("out/pyapi/")
    with prefixflow.Client(s3_sink.cluster.url) as client:
        job = client.submit(table, out=out, max_tokens=2)
        result = job.wait(120)
    assert job.out == out and result.out == out and (result.rows, result.errors) == (n, 0)
    got = result.to_arrow().sort_by("id")
    assert got.column("id").to_pylist() == list(range(n))
    assert got.column("k").combine_chunks().equals(table.column("k").combine_chunks())
    assert result.dataset().count_rows() == n
    assert_final(s3_server, "out/pyapi")


def test_batch_api_files_in_s3(s3_sink, s3_server, tiny_model, tmp_path):
    """`serve api --files-uri s3://...` with a sink given the same: the upload, the parsed
    input and the results live in the bucket (none in the NATS object store); the batch
    completes and its output file downloads, every request answered once."""
    import asyncio

    from nats.js.errors import NotFoundError

    from prefixflow.shared.bus.connection import close, connect
    from prefixflow.shared.wire import subjects
    from tests.nats.test_batch_api import ApiProcess, chat_line, lines_of, wait_for, write_batch

    api = ApiProcess(s3_sink.cluster.url, tiny_model, tmp_path)
    api.env.update({**s3_server.env, "PFX_FILES_URI": FILES})
    api.start()
    try:
        alice = api.client("key-a")
        path = write_batch(tmp_path / "batch.jsonl", [chat_line(i) for i in range(40)])
        f = alice.files.create(file=path.open("rb"), purpose="batch")
        assert objects(s3_server, "batch-files")[f.id] == path.stat().st_size
        assert alice.files.content(f.id).content == path.read_bytes()
        batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(alice, batch.id, {"completed", "failed", "cancelled", "expired"})
        assert done.status == "completed" and done.request_counts.completed == 40, done
        out = lines_of(alice, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(40))
        names = objects(s3_server, "batch-files")
        assert f"{subjects.api_job(batch.id)}/output.jsonl" in names, names  # the sink's export, in the bucket

        async def in_nats(name: str) -> bool:
            nc = await connect(s3_sink.cluster.url, "check")
            try:
                await (await nc.jetstream().object_store(subjects.FILES_OBJ)).get_info(name)
                return True
            except NotFoundError:
                return False
            finally:
                await close(nc)

        assert not asyncio.run(in_nats(f.id)) and not asyncio.run(in_nats(f"{subjects.api_job(batch.id)}/output.jsonl"))
        alice.files.delete(f.id)
        assert f.id not in objects(s3_server, "batch-files")
    finally:
        api.stop()


def test_run_sigkilled_mid_job_then_again_completes_once(s3_server, tmp_path):
    """`prefixflow run` itself SIGKILLed once a part is in the bucket (its cluster gets
    SIGKILL from the kernel: the parent-death signal), then the same command: it resumes
    from what the bucket holds, every id once, nothing left open. The dead run's cluster
    writes nothing after its death: had it drained (as it did on SIGTERM), its sink's
    last flush could land after the next run listed what is done, and those rows came out
    twice (seen in CI: 2,337 of 6,000)."""
    n = 6_000
    data = counted_prompts(tmp_path, n)
    out = s3_server.uri("out/run-killed/")
    slow = {**s3_server.env, "PFX_ECHO_DELAY": "0.01"}  # a job of seconds: the kill lands mid-job
    kill_once_a_part_is_in(run_s3(str(data), out, slow, tmp_path), s3_server, "out/run-killed")
    at_death = objects(s3_server, "out/run-killed")
    pids = [p["pid"] for p in json.loads((tmp_path / "run-work" / "pids.json").read_text())["processes"].values()]
    deadline = time.monotonic() + 3  # killed by the kernel: at once (a drain took 5 s)
    while (alive := [pid for pid in pids if pid_alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"processes of the killed run still alive: {alive}"
    time.sleep(1.0)  # anything a drain would still write
    assert objects(s3_server, "out/run-killed") == at_death, "the killed run's cluster wrote after its death"
    before = sum(name.startswith("part-") for name in at_death)
    (code, text), = settle({"again": run_s3(str(data), out, s3_server.env, tmp_path)}, timeout=240).values()
    assert code == 0, text
    print(f"\nrun SIGKILLed with {before} parts in the bucket; then: {text.splitlines()[-3:]}")
    assert_final(s3_server, "out/run-killed")
    got = read_out(s3_server, "out/run-killed")
    assert got.column("id").to_pylist() == list(range(n)), "every id once"
    assert got.column("k").equals(pa.chunked_array([pa.array(range(n), pa.int32())]))
