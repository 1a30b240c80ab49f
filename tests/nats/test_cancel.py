"""Cancelling a job through the commands users type (issue #24), on a slow echo engine:
`prefixflow submit` of a large job, `prefixflow cancel` half way: the cluster stops
feeding it within seconds, the rows written stay (each id once), the status and the
summary say cancelled, `submit` exits 1 saying so, `prefixflow jobs` lists it as
cancelled; a job running beside it is unaffected; cancelling again, or an unknown job,
and resubmitting the cancelled id, each get a clear answer."""

from __future__ import annotations

import asyncio
import getpass
import json
import subprocess
import time
from pathlib import Path

import nats
import pyarrow.parquet as pq
import pytest

from prefixflow.client.submit import Submitter
from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, SLOW_ECHO, VENV_BIN, run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

BIG, SMALL = 6000, 200


@pytest.fixture
def cluster(clusters):
    # ~400 prompts/s: the big job takes ~15 s alone.
    return clusters.get(engine_args=SLOW_ECHO)


def dataset(path: Path, model: Path, n: int, seed: int) -> Path:
    write_prefix_repetition(path, tokenizer_dir=model, num_prompts=n, prefix_len=32, suffix_len=8, num_prefixes=8,
                            output_len=4, seed=seed)
    return path


def status(url: str, job: str) -> m.JobStatus | None:
    async def get():
        async with Submitter(url) as client:
            return await client.status(job)
    return asyncio.run(get())


def test_cancel_stops_a_job_and_keeps_its_rows(cluster, tiny_model, tmp_path):
    url = cluster.url
    big = dataset(tmp_path / "big.parquet", tiny_model, BIG, 1)
    small = dataset(tmp_path / "small.parquet", tiny_model, SMALL, 2)
    out, other_out = tmp_path / "out", tmp_path / "other"
    submit = subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(big), "--out", str(out), "--nats", url, "--job", "big",
         "--no-progress", "--max-tokens", "4"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (st := status(url, "big")) is None or st.rows < 500:
            assert time.monotonic() < deadline and submit.poll() is None, st
            time.sleep(0.2)
        other = subprocess.Popen(
            [str(VENV_BIN / "prefixflow"), "submit", str(small), "--out", str(other_out), "--nats", url, "--job",
             "beside", "--no-progress", "--max-tokens", "4"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        res = run_cli("cancel", "big", "--nats", url, timeout=90)  # settles or the test fails here
        assert res.returncode == 0, res.stdout + res.stderr
        assert "job big cancelled:" in res.stdout, res.stdout
        out_s, err_s = submit.communicate(timeout=60)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 1, out_s + err_s
    assert "job big cancelled" in err_s, err_s
    st = status(url, "big")
    assert st.done and st.cancelled and 500 <= st.rows < BIG, st
    time.sleep(2)  # nothing more lands after the cancel settled
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == st.rows == status(url, "big").rows
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["cancelled"] is True and summary["expired"] is False and summary["rows"] == st.rows
    assert summary["cancelled_by"] == f"local:{getpass.getuser()}", summary  # who cancelled (no auth: the OS user)

    # The job beside it was not touched.
    out_o, err_o = other.communicate(timeout=120)
    assert other.returncode == 0, out_o + err_o
    assert sorted(pq.read_table(other_out).column("id").to_pylist()) == list(range(SMALL))

    listed = run_cli("jobs", "--nats", url, "--json")
    assert listed.returncode == 0, listed.stderr
    states = {v["job"]: v["state"] for v in json.loads(listed.stdout)}
    assert states["big"] == "cancelled" and states["beside"] == "done", states

    again = run_cli("cancel", "big", "--nats", url)
    assert again.returncode == 0 and "already cancelled" in again.stdout, again.stdout
    unknown = run_cli("cancel", "no-such-job", "--nats", url)
    assert unknown.returncode == 2 and "no job 'no-such-job'" in unknown.stderr, unknown.stdout + unknown.stderr
    resubmit = run_cli("submit", str(big), "--out", str(out), "--nats", url, "--job", "big", "--no-progress",
                       "--max-tokens", "4", timeout=60)  # the same job (another spec would be exit code 2)
    assert resubmit.returncode == 1 and "submit under a new --job id" in resubmit.stderr, resubmit.stderr


def test_a_job_past_its_deadline_expires_with_its_rows(cluster, tiny_model, tmp_path):
    """`prefixflow submit --expires-in 4` of a job that needs ~15 s: the sink cancels it
    as expired at its deadline; submit exits 1 saying so; the rows written stay, once."""
    big = dataset(tmp_path / "big.parquet", tiny_model, BIG, 3)
    out = tmp_path / "out"
    res = run_cli("submit", str(big), "--out", str(out), "--nats", cluster.url, "--job", "late", "--no-progress",
                  "--max-tokens", "4", "--expires-in", "4", timeout=120)
    assert res.returncode == 1 and "job late expired" in res.stderr, res.stdout + res.stderr
    st = status(cluster.url, "late")
    assert st.done and st.cancelled and 0 < st.rows < BIG, st
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["expired"] is True and summary["rows"] == st.rows
    ids = pq.read_table(out).column("id").to_pylist()
    assert len(ids) == len(set(ids)) == st.rows


SPOOFED = 1500


async def spoof_cancels(url: str, job: str, submit: subprocess.Popen) -> int:
    """Until `submit` exits, send every kind of false cancel notice of `job` a user who
    may publish can send (no auth here): the old job-id-in-the-body notice on the old
    subject (which stalled the submission for good), a notice on the job's own subject
    its spec does not confirm, one naming another job, one that does not decode. Returns
    the rounds sent while the job was publishing (its status not yet done)."""
    nc = await nats.connect(url)
    try:
        kv = await nc.jetstream().key_value(subjects.JOBS_KV)
        status_kv = await nc.jetstream().key_value(subjects.JOB_STATUS_KV)
        rounds = 0
        while submit.poll() is None:
            await nc.publish("pfx.jobs.cancelled", job.encode())
            await nc.publish(subjects.job_cancelled(job), m.encode(m.CancelNotice(job, "mallory", time.time())))
            await nc.publish(subjects.job_cancelled(job), m.encode(m.CancelNotice("other", "mallory")))
            await nc.publish(subjects.job_cancelled(job), b"not a notice")
            await nc.flush()
            try:
                st = m.job_status_decoder.decode((await status_kv.get(job)).value)
            except nats.js.errors.KeyNotFoundError:
                st = None
            rounds += st is None or not st.done
            await asyncio.sleep(0.05)
        spec = m.job_spec_decoder.decode((await kv.get(job)).value)
        assert spec.cancelled_at == 0 and spec.cancelled_by == "", spec
        return rounds
    finally:
        await nc.close()


def test_a_spoofed_cancel_is_ignored(cluster, tiny_model, tmp_path):
    """Issue 40: one notice naming a job stopped its `submit` from publishing, so the job
    was never sealed and waited forever. Now a notice is only believed when the job's
    spec says cancelled: the job under a stream of false notices completes with every row."""
    data = dataset(tmp_path / "spoofed.parquet", tiny_model, SPOOFED, 4)
    out = tmp_path / "out"
    t0 = time.monotonic()
    submit = subprocess.Popen(
        [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--nats", cluster.url, "--job",
         "spoofed", "--no-progress", "--max-tokens", "4", "--max-in-flight", "256", "--timeout", "120"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        rounds = asyncio.run(spoof_cancels(cluster.url, "spoofed", submit))
        out_s, err_s = submit.communicate(timeout=30)
    finally:
        if submit.poll() is None:
            submit.kill()
    assert submit.returncode == 0, out_s + err_s
    assert rounds >= 10, f"the false notices came while the job ran ({rounds} rounds)"
    assert "ignored a cancel notice" in err_s and "mallory" in err_s, err_s  # seen, and said so
    assert err_s.count("ignored a cancel notice") <= time.monotonic() - t0 + 1, "at most a line a second"
    st = status(cluster.url, "spoofed")
    assert st.done and not st.cancelled and st.rows == SPOOFED, st
    assert sorted(pq.read_table(out).column("id").to_pylist()) == list(range(SPOOFED))
    assert not json.loads((out / "_summary.json").read_text()).get("cancelled")
