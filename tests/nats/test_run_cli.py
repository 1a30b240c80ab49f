"""`prefixflow run` and `prefixflow submit` as a user runs them (subprocesses):

- `run` supervises its cluster: SIGKILL an engine-worker and then the ingestor mid-job,
  the run restarts them, says so, and still writes every id exactly once (exit 0);
- `LocalCluster.supervise` with a small budget drops a replica and then gives up;
- a failed job stops `submit` with "job X failed: <reason>" and exit code 1, whether it
  failed before the submission (nothing is published) or while it is followed.

Echo engines slowed to ~100 prompts/s each (20 ms a prompt, 2-prompt work messages,
2 in flight) so the job lasts ~15 s and the kills land mid-job.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import write_prefix_repetition
from prefixflow.launch.local_cluster import ClusterFailed, LocalCluster, processes
from prefixflow.client.submit import JobFailed, Submitter
from prefixflow.launch.supervisor import RestartPolicy
from prefixflow.services.router.assignments import MIN_CUT_PROMPTS
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, VENV_BIN, run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

N = 3000
SLOW_ECHO = {"PFX_ECHO_DELAY": "0.02", "PFX_WINDOW": "2", "PFX_MAX_BATCH": "2"}


def read_pids(workdir: Path) -> dict | None:
    try:
        return json.loads((workdir / "pids.json").read_text())
    except (OSError, ValueError):
        return None


def processes_of(workdir: Path) -> list[int]:
    """Live processes started for this cluster: their environment names its store."""
    mark = f"PFX_NATS_STORE={workdir / 'nats'}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


async def _job_rows(url: str, job: str) -> int:
    async with Submitter(url) as client:
        st = await client.status(job)
    return st.rows if st else 0


def job_rows(url: str, job: str) -> int:
    """Rows written so far (0 if NATS does not answer within a few seconds)."""
    try:
        return asyncio.run(asyncio.wait_for(_job_rows(url, job), 5))
    except (TimeoutError, OSError):
        return 0


def wait_for(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        assert proc.poll() is None, f"run exited ({proc.returncode}) while waiting for {what}:\n{log.read_text()}"
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()}")


def test_run_restarts_killed_engine_and_ingestor_mid_job(tmp_path, tiny_model):
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(
        data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=128, suffix_len=16, num_prefixes=12, output_len=4, seed=9
    )
    workdir, out, log = tmp_path / "cluster", tmp_path / "out", tmp_path / "run.log"
    argv = [
        str(VENV_BIN / "prefixflow"), "run", str(data), "--out", str(out), "--engine", "echo", "--model", str(tiny_model),
        "--max-tokens", "4", "--workdir", str(workdir), "--job", "cli-kill", "--no-progress", "--timeout", "180",
    ]
    with open(log, "w") as logf:
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, **SLOW_ECHO})
    try:
        pids = wait_for(lambda: read_pids(workdir), 60, "pids.json", proc, log)
        url = pids["url"]
        # Mid-job: a tenth of the rows written.
        wait_for(lambda: job_rows(url, "cli-kill") >= N // 10, 90, "the job under way", proc, log)
        for name in ("engine0", "ingestor"):
            pid = read_pids(workdir)["processes"][name]["pid"]
            os.kill(pid, 9)
            # Back: a new pid in pids.json and the run's "back" line.
            def back(name: str = name, pid: int = pid) -> bool:
                p = read_pids(workdir)
                return bool(p) and p["processes"][name]["pid"] != pid and f"{name} back" in log.read_text()

            wait_for(back, 30, f"{name} back", proc, log)
        assert job_rows(url, "cli-kill") < N, "both kills landed mid-job"
        proc.wait(180)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(30)
    text = log.read_text()
    assert proc.returncode == 0, text
    for name in ("engine0", "ingestor"):
        assert f"{name} down (exit -9), restarting in 1 s" in text, text
        assert f"{name} back (pid " in text, text
    assert "restarts: ingestor 1, engine0 1" in text, text
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == N, "every id exactly once"
    assert table.column("error").null_count == N, "no error rows"
    final = read_pids(workdir)["processes"]
    assert {p["state"] for p in final.values()} == {"stopped"}
    assert not processes_of(workdir), "no process outlives the run"


async def _put_status(url: str, status: m.JobStatus) -> None:
    async with Submitter(url) as client:
        await client.status_kv.put(status.job, m.encode_json(status))


async def _ingested(url: str, job: str) -> int:
    async with Submitter(url) as client:
        info = await client.js.stream_info(subjects.INGEST_STREAM.name, subjects_filter=subjects.ingest(job))
        return sum((info.state.subjects or {}).values())


def test_submit_refuses_a_job_that_already_failed(nats_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": i, "prompt": f"hello {i}"}) + "\n" for i in range(10)))
    asyncio.run(_put_status(nats_server.url, m.JobStatus("doomed", failed=True, error="invalid job spec: boom")))
    res = run_cli("submit", str(data), "--out", str(tmp_path / "out"), "--nats", nats_server.url, "--job", "doomed", "--no-progress", timeout=60)
    assert res.returncode == 1, res
    assert "job doomed failed: invalid job spec: boom" in res.stderr, res.stderr
    assert asyncio.run(_ingested(nats_server.url, "doomed")) == 0, "nothing published for a failed job"


def test_wait_stops_when_the_job_fails(nats_server):
    async def go() -> float:
        async with Submitter(nats_server.url) as client:
            waiting = asyncio.create_task(client.wait("later", 100, progress=False, timeout=60))
            await asyncio.sleep(1.0)
            assert not waiting.done()
            t0 = time.monotonic()
            await client.status_kv.put("later", m.encode_json(m.JobStatus("later", rows=3, failed=True, error="model mismatch")))
            with pytest.raises(JobFailed, match="job later failed: model mismatch"):
                await waiting
            return time.monotonic() - t0

    assert asyncio.run(go()) < 5.0


def test_supervisor_drops_a_replica_out_of_budget_and_gives_up_with_none_left(tmp_path, tiny_model):
    """The process handling behind `run` with a budget of one restart: the first kill of
    each engine is restarted, the second drops it while the other replica remains, and
    gives up once none is left; every process is gone after `stop()`."""
    events: list[str] = []
    cluster = LocalCluster(
        processes(2, engine="echo"), workdir=tmp_path / "cluster", env={"PFX_MODEL": str(tiny_model)},
        policy=RestartPolicy(first_delay=0.2, budget=1), on_event=events.append,
    )
    cluster.start()

    def kill_and_watch(name: str, expect: str, timeout: float = 30) -> None:
        cluster.running[name].kill()
        deadline = time.monotonic() + timeout
        while not any(expect in e for e in events):
            assert time.monotonic() < deadline, events
            cluster.supervise()
            time.sleep(0.05)

    try:
        asyncio.run(cluster.wait_ready(["r0", "r1"], 60))
        kill_and_watch("engine0", "engine0 back")
        assert "engine0 down (exit -9), restarting in 0.2 s" in events
        kill_and_watch("engine0", "carrying on with engine1")
        kill_and_watch("engine1", "engine1 back")
        with pytest.raises(ClusterFailed, match="no engine replica can come back"):
            kill_and_watch("engine1", "never printed")
        assert cluster.restart_counts() == {**{p.name: 0 for p in cluster.procs}, "engine0": 1, "engine1": 1}
        states = json.loads((tmp_path / "cluster" / "pids.json").read_text())["processes"]
        assert states["engine0"]["state"] == "dropped" and states["engine1"]["state"] == "failed"
    finally:
        cluster.stop()
    assert all(p.returncode is not None for p in cluster.running.values())
    assert not processes_of(tmp_path / "cluster")


def run_echo_job(tmp_path: Path, tiny_model, *, n: int, num_prefixes: int, job: str, env: dict[str, str],
                 extra: list[str] | None = None) -> subprocess.CompletedProcess:
    """`prefixflow run` of `n` prompts (4 output tokens each) on echo engines, output in tmp_path/out."""
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=n, prefix_len=128, suffix_len=16,
                            num_prefixes=num_prefixes, output_len=4, seed=3)
    return subprocess.run(
        [str(VENV_BIN / "prefixflow"), "run", str(data), "--out", str(tmp_path / "out"), "--engine", "echo",
         "--model", str(tiny_model), "--max-tokens", "4", "--workdir", str(tmp_path / "cluster"), "--job", job,
         "--timeout", "120", *(extra or [])],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, **env}, timeout=240,
    )


def test_run_shows_work_under_way_before_the_first_row_and_writes_a_report(tmp_path, tiny_model):
    """Prompts that take seconds each (long outputs): the progress line says how many are
    being generated while no row is written yet; at the end the job's report is written
    and the summary says when the first result came."""
    n = 6
    out = tmp_path / "out"
    proc = run_echo_job(tmp_path, tiny_model, n=n, num_prefixes=2, job="slow-rows", env={"PFX_ECHO_DELAY": "4"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # tqdm redraws the line with \r: every state it showed.
    states = [s for s in proc.stderr.replace("\r", "\n").splitlines() if f"/{n} [" in s]
    before_rows = [s for s in states if f" 0/{n} [" in s]
    assert any(re.search(r"(^|[^\d,])[1-9][\d,]* generating", s) for s in before_rows), states
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == n and summary["first_result_seconds"] >= 4
    assert (out / "_report" / "index.html").exists() and (out / "_report" / "throughput.png").exists()
    assert f"report: {out / '_report' / 'index.html'}" in proc.stdout


def test_run_submits_while_the_engines_start_and_the_work_waits_for_them(tmp_path, tiny_model):
    """Engines that take 6 s to start: `run` submits the job as soon as the services that
    take it are up, the bucketer and router hold the work until a replica is ready, each
    replica says when it takes work, and every row is written once."""
    n = 400
    out = tmp_path / "out"
    proc = run_echo_job(tmp_path, tiny_model, n=n, num_prefixes=4, job="early", env={"PFX_ECHO_START_SECONDS": "6"},
                        extra=["--no-progress"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    submitted = float(re.search(r"services ready in ([0-9.]+) s: submitting job early", proc.stdout).group(1))
    ready = {name: float(t) for name, t in re.findall(r"(r\d) ready in ([0-9.]+) s: it takes work now", proc.stdout)}
    assert set(ready) == {"r0", "r1"}, proc.stdout
    assert min(ready.values()) > submitted + 2, proc.stdout  # submitted before any engine was ready
    last = re.search(r"2 replicas ready in ([0-9.]+) s \(the job was submitted at ([0-9.]+) s\)", proc.stdout)
    assert last and float(last.group(2)) == submitted, proc.stdout
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(n))
    assert table.column("error").null_count == n
    summary = json.loads((out / "_summary.json").read_text())
    # The job was created before the engines were ready: its first result waited for one
    # (from the job's creation, at `submitted`, to the first replica ready; 0.5 s for the
    # two clocks: the job's record and `run`'s lines).
    waited = min(ready.values()) - submitted
    assert summary["rows"] == n and summary["first_result_seconds"] >= waited - 0.5, (waited, summary)


@pytest.mark.parametrize("policy", ["prefix-aware", "daft"])
def test_run_cuts_buckets_to_the_room_and_writes_every_row_once(tmp_path, tiny_model, policy):
    """Bounded lead through `run`: 256-prompt buckets of 4 prefixes on two slowed echo
    replicas with small windows. The product's policy places no more of a bucket than a
    replica's room and hands the rest back (the router's debug log says "(kept)"), the
    bucketer sends those prompts again later; the reference's rules (`daft`: no early
    release, whole buckets) cut nothing. Either way every row is written exactly once,
    on both replicas."""
    n = 1024
    out = tmp_path / "out"
    env = {"PFX_ECHO_DELAY": "0.005", "PFX_WINDOW": "8", "PFX_MAX_BUCKET": "256", "PFX_LOG_LEVEL": "debug"}
    proc = run_echo_job(tmp_path, tiny_model, n=n, num_prefixes=4, job="cut", env=env,
                        extra=["--no-progress", "--policy", policy])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [json.loads(line) for line in (tmp_path / "cluster" / "logs" / "router.log").read_text().splitlines()
             if line.startswith("{")]
    routed = [r for r in lines if r.get("event") == "routed"]  # (the 5 s "fleet" line counts "routed" too)
    kept = [r for r in routed if any(name == "(kept)" for name, _ in r["to"])]
    if policy == "daft":
        assert routed and not kept
    else:
        assert kept, f"no bucket was cut in {len(routed)} decisions"
        placed = [sum(k for name, k in r["to"] if name != "(kept)") for r in kept]
        assert min(placed) >= MIN_CUT_PROMPTS, placed  # a cut leaves a piece worth its prefix
    table = pq.read_table(out)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) == n, "every id exactly once"
    assert table.column("error").null_count == n
    assert set(table.column("replica").to_pylist()) == {"r0", "r1"}
