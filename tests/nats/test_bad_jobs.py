"""A bad job fails alone (issue 39, must-show 5), on one shared cluster of echo engines.

Side by side through `prefixflow submit`: a normal job, and three whose `--out` cannot be
a directory (an existing file, a path under that file, a 300-byte name); beside them a
raw publish on `pfx.ingest.bad:job` and a done query on `pfx.sink.done.bad:job`. The
normal job completes with every id once; each bad job fails with its reason (submit exit
1 naming it) and `prefixflow cancel` of it returns at once; the raw message is in the
dead-letter stream with the reason; the done query gets an error reply; no process of the
cluster died or was restarted (the old sink died on each, in a loop under supervision)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path

import nats
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN, run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]

ROWS = 200


def submit(url: str, data: Path, out: Path | str, job: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", url, "--job", job,
         "--no-progress", "--max-tokens", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


async def raw_bad_job(url: str) -> tuple[dict[str, str], m.DoneReply]:
    """Publish one row raw on `pfx.ingest.bad:job` and ask the sink about `bad:job`: the
    dead letter's headers (once it is there) and the done query's reply."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await js.publish("pfx.ingest.bad:job", json.dumps({"id": 0, "prompt": "hello"}).encode())
        reply = await nc.request(subjects.done_query("bad:job"), m.encode(m.DoneQuery([0])), timeout=10)
        done = msgspec_decode(reply.data)
        dead = subjects.dead("pfx.ingest.bad:job")
        deadline = time.monotonic() + 30
        while True:
            try:
                got = await js.get_last_msg(subjects.DEAD_STREAM.name, dead)
                return dict(got.headers or {}), done
            except nats.js.errors.NotFoundError:
                assert time.monotonic() < deadline, "the raw message of an invalid job id was not dead-lettered"
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


def msgspec_decode(data: bytes) -> m.DoneReply:
    import msgspec

    return msgspec.msgpack.decode(data, type=m.DoneReply)


def test_a_bad_job_fails_alone(clusters, tiny_model, tmp_path):
    cluster = clusters.get(replicas=1)
    pids = {name: proc.pid for name, proc in cluster.running.items()}
    restarts = dict(cluster.supervisor.restarts)
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=ROWS, prefix_len=32, suffix_len=8,
                            num_prefixes=4, output_len=4, seed=3)
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    bad = {  # job -> (--out, what its reason says)
        "out-is-a-file": (a_file, "File exists"),
        "out-under-a-file": (a_file / "sub", "Not a directory"),
        "out-name-too-long": (tmp_path / ("x" * 300), "File name too long"),
    }
    t0 = time.monotonic()
    procs = {job: submit(cluster.url, data, out, job) for job, (out, _) in bad.items()}
    procs["normal"] = submit(cluster.url, data, tmp_path / "out", "normal")
    headers, done_reply = asyncio.run(raw_bad_job(cluster.url))
    results = {}
    try:
        for job, proc in procs.items():
            results[job] = proc.communicate(timeout=90)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    print(f"\nfour submits settled in {time.monotonic() - t0:.1f} s")

    # The normal job: every id once.
    out_s, err_s = results["normal"]
    assert procs["normal"].returncode == 0, out_s + err_s
    ids = pq.read_table(tmp_path / "out").column("id").to_pylist()
    assert sorted(ids) == list(range(ROWS))

    # Each bad job: failed with its reason, named by submit (exit 1); cancel returns at once.
    for job, (out, why) in bad.items():
        out_s, err_s = results[job]
        print(f"{job}: {err_s.strip().splitlines()[-1] if err_s.strip() else out_s}")
        assert procs[job].returncode == 1, out_s + err_s
        assert f"job {job} failed: " in err_s and why in err_s, err_s
        res = run_cli("cancel", job, "--nats", cluster.url, timeout=30)
        assert res.returncode == 0 and f"job {job} already failed: " in res.stdout, res.stdout + res.stderr
    assert not a_file.is_dir() and a_file.read_text() == "not a directory\n"

    # The raw job of an invalid id: dead-lettered with the reason; the done query refused.
    assert headers.get("Pfx-Error", "").startswith("invalid job id 'bad:job': it contains ':'"), headers
    assert done_reply.error is not None and done_reply.error.startswith("invalid job id 'bad:job'"), done_reply

    # Nothing died, nothing restarted.
    assert {name: proc.pid for name, proc in cluster.running.items()} == pids
    assert all(proc.poll() is None for proc in cluster.running.values()), {
        name: proc.returncode for name, proc in cluster.running.items()}
    assert dict(cluster.supervisor.restarts) == restarts
