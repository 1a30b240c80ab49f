"""Seeing a job: every service's Prometheus metrics during a real job, `prefixflow top`
in a real terminal (tmux), `prefixflow status`, and `prefixflow report` on the finished
job's output.

The cluster is the real one (nats-server and every service as an OS process, as
`prefixflow run` starts them) with `echo` engines slowed down so a job lasts a few
seconds; each service serves its metrics on its own port (`PFX_METRICS_PORT`).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.launch.local_cluster import LocalCluster, free_port, processes
from prefixflow.client.submit import submit
from prefixflow.shared.wire import messages as m
from tests.conftest import VENV_BIN, run_cli, wait_replicas_ready

pytestmark = [pytest.mark.nats, pytest.mark.timeout(180)]

SERVICES = ("ingestor", "bucketer", "router", "engine0", "engine1", "sink")
PREFIXES = 12
BAD_ROWS = 5


ECHO_DELAY, ECHO_TOKEN_DELAY = 0.04, 0.0005


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    """Two slowed echo replicas (~100 prompts/s each: 40 ms a prompt and 0.5 ms an output
    token); every service serves metrics."""
    procs = processes(2, engine="echo", extra_engine_args=["--echo-delay", str(ECHO_DELAY), "--echo-token-delay",
                                                           str(ECHO_TOKEN_DELAY), "--window", "4"])
    ports = {}
    for p in procs:
        if p.name != "nats":
            ports[p.name] = free_port()
            p.env["PFX_METRICS_PORT"] = str(ports[p.name])
    workdir = tmp_path_factory.mktemp("observability")
    c = LocalCluster(procs, workdir=workdir / "cluster", env={"PFX_MODEL": str(tiny_model), "PFX_MAX_BATCH": "16"})
    c.start()
    try:
        asyncio.run(wait_replicas_ready(c.url, ["r0", "r1"], 60, c.check_alive))
        c.metrics_ports = ports  # type: ignore[attr-defined]
        yield c
    finally:
        c.stop()


def write_input(path: Path, tiny_model, n: int, *, bad: int = 0) -> Path:
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=n, prefix_len=256, suffix_len=32, num_prefixes=PREFIXES, seed=3)
    rows = [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]
    rows += [{"id": n + i, "prompt": ""} for i in range(bad)]  # error rows: empty prompt
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def scrape(port: int) -> dict[str, dict[tuple, float]]:
    """Sample name -> {sorted labels: value} of one /metrics page."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, dict[tuple, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name][tuple(sorted(s.labels.items()))] = s.value
    return out


def total(page: dict, name: str, **labels: str) -> float:
    """Sum of a sample over the label sets that match `labels`."""
    want = set(labels.items())
    return sum(v for k, v in page.get(name, {}).items() if want <= set(k))


def run_job(cluster, data: Path, job: str, out: Path, during=None) -> m.JobStatus:
    """Submit and wait; `during()` (sync, in a thread) runs until the job is done."""

    async def main() -> m.JobStatus:
        task = asyncio.create_task(submit(data, nats_url=cluster.url, job=job, out_dir=out,
                                          sampling=m.SamplingSpec(max_tokens=8), progress=False, timeout=120))
        if during is not None:
            while not task.done():
                await asyncio.to_thread(during)
                await asyncio.sleep(0.2)
        return await task

    return asyncio.run(main())


# Counters each service must show growing during a job, and where.
GROWING = {
    "ingestor": ("pfx_prompts_in_total", {"outcome": "ok"}),
    # Its intake can take a whole small job in one pull (nothing bounds it below the lane's
    # share); its releases follow the router's bounded lead, so they grow with the job.
    "bucketer": ("pfx_bucketer_released_prompts_total", {}),
    "router": ("pfx_router_decisions_total", {}),
    "engine0": ("pfx_engine_completed_total", {}),
    "engine1": ("pfx_engine_completed_total", {}),
    "sink": ("pfx_prompts_out_total", {"outcome": "ok"}),
}


def test_every_service_exports_its_metrics_during_a_job(cluster, tmp_path, tiny_model):
    n = 1200
    data = write_input(tmp_path / "in.parquet", tiny_model, n, bad=BAD_ROWS)
    out = tmp_path / "out"
    pages: list[dict[str, dict]] = []  # one {service: page} per round

    def scrape_all() -> None:
        pages.append({name: scrape(port) for name, port in cluster.metrics_ports.items()})

    status = run_job(cluster, data, "metrics", out, during=scrape_all)
    time.sleep(1.0)  # the last statuses and parts reach every counter
    scrape_all()
    assert status.done and status.rows == n + BAD_ROWS and status.errors == BAD_ROWS
    summary = json.loads((out / "_summary.json").read_text())
    final = pages[-1]

    # 1. Every service answers, with its own metrics and the common ones.
    for name in SERVICES:
        assert "process_start_time_seconds" in final[name], name  # restarts: it changes
    for name in ("ingestor", "bucketer", "engine0", "engine1", "sink"):
        assert total(final[name], "pfx_consumer_fetched_total") > 0, name
        assert "pfx_consumer_pending" in final[name], name

    # 2. Counters only grow, and grew during the job: some round saw the job half done.
    for name, (metric, labels) in GROWING.items():
        seen = [total(p[name], metric, **labels) for p in pages]
        assert seen == sorted(seen), (name, metric, seen)
        assert any(0 < v < seen[-1] for v in seen), f"{name}: {metric} never seen mid-job: {seen}"
    mid_job = [p for p in pages if 0 < total(p["sink"], "pfx_prompts_out_total") < n]
    assert mid_job, "no scrape landed mid-job"

    # 3. Sane values at the end.
    ing, buck, router, sink = final["ingestor"], final["bucketer"], final["router"], final["sink"]
    assert total(ing, "pfx_prompts_in_total", outcome="ok") == n
    assert total(ing, "pfx_prompts_in_total", outcome="error") == BAD_ROWS
    assert total(ing, "pfx_ingest_batch_seconds_count") > 0
    assert total(buck, "pfx_bucketer_prompts_in_total") == n
    assert total(buck, "pfx_bucketer_buffered_prompts") == 0  # all released
    released = total(buck, "pfx_bucketer_released_prompts_total")
    kept = total(router, "pfx_router_kept_prompts_total")  # back in the buffer (bounded lead): released again
    assert released == n + kept == total(buck, "pfx_bucketer_bucket_size_sum")
    assert total(buck, "pfx_bucketer_bucket_size_count") == total(buck, "pfx_bucketer_releases_total") > 0
    reasons = {dict(k)["reason"] for k in buck["pfx_bucketer_releases_total"]}
    assert reasons <= {"size", "max_wait", "eager", "flush"} and reasons
    decisions = {dict(k)["outcome"]: v for k, v in router["pfx_router_decisions_total"].items()}
    assert decisions.get("routed", 0) + decisions.get("split", 0) > 0
    assert total(router, "pfx_router_routed_prompts_total") >= n
    assert {dict(k)["replica"] for k in router["pfx_router_replica_live"]} == {"r0", "r1"}
    assert total(router, "pfx_router_replica_live") == 2
    assert "pfx_router_outstanding_tokens" in router
    assert total(router, "pfx_router_match_blocks_count") > 0
    for name, replica in (("engine0", "r0"), ("engine1", "r1")):
        page = final[name]
        assert total(page, "pfx_engine_ready", replica=replica) == 1
        assert total(page, "pfx_engine_window", replica=replica) == 4
        assert total(page, "pfx_engine_inflight") == 0  # drained
        assert total(page, "pfx_engine_completed_total") > 0
        assert "pfx_engine_output_tokens_total" in page, name  # `total` reads a missing metric as 0
        assert total(page, "pfx_engine_output_tokens_total") > 0, name
    assert sum(total(final[e], "pfx_engine_completed_total") for e in ("engine0", "engine1")) >= n
    assert total(sink, "pfx_prompts_out_total", outcome="ok") == n
    assert total(sink, "pfx_prompts_out_total", outcome="error") == BAD_ROWS
    assert total(sink, "pfx_error_rows_total", reason="empty_prompt") == BAD_ROWS
    assert total(sink, "pfx_sink_jobs_done_total") >= 1
    assert total(sink, "pfx_sink_part_write_seconds_count") > 0

    # 4. The hit rate from the metrics matches the summary's (within a point): from the
    # rows written (sink) and from the engines' own counts. (Echo engines report no
    # cached tokens: both are 0 here; tests/e2e has real vLLM.)
    prompt = total(sink, "pfx_sink_prompt_tokens_total")
    assert prompt == summary["prompt_tokens"] and total(sink, "pfx_sink_output_tokens_total") == summary["output_tokens"]
    assert abs(total(sink, "pfx_sink_cached_tokens_total") / prompt - summary["prefix_cache_hit_rate"]) <= 0.01
    engine_prompt = sum(total(final[e], "pfx_engine_prompt_tokens_total") for e in ("engine0", "engine1"))
    engine_cached = sum(total(final[e], "pfx_engine_cached_tokens_total") for e in ("engine0", "engine1"))
    assert engine_prompt >= prompt
    engine_output = sum(total(final[e], "pfx_engine_output_tokens_total") for e in ("engine0", "engine1"))
    assert engine_output >= summary["output_tokens"] > 0  # redeliveries may generate a row twice, never less
    assert abs(engine_cached / engine_prompt - summary["prefix_cache_hit_rate"]) <= 0.01
    for replica, s in summary["replicas"].items():
        assert total(sink, "pfx_sink_prompt_tokens_total", replica=replica) == s["prompt_tokens"]


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], capture_output=True, text=True, timeout=10).stdout


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux): top is tested in a real terminal")
def test_top_in_a_terminal_shows_replicas_and_progress_with_eta(cluster, tmp_path, tiny_model):
    data = write_input(tmp_path / "in.parquet", tiny_model, 2400)
    session = f"pfx-top-{int(time.time() * 1000) % 10**8}"
    # NOTE: pytest sets COLUMNS=80 and LINES=24, which the tmux server and then rich
    # would take over the pane's real size.
    cmd = f"env -u COLUMNS -u LINES {VENV_BIN / 'prefixflow'} top --nats {cluster.url} --interval 0.5"
    tmux("new-session", "-d", "-s", session, "-x", "180", "-y", "40", cmd)
    screens: list[str] = []
    eta_line = re.compile(r"top-job\s.*\d[\d,]*/2,400.*ETA \d+:\d\d")

    def look() -> None:
        screens.append(tmux("capture-pane", "-p", "-t", session))

    try:
        # `top` is up (its first screen lists the replicas) before the job starts: on a busy
        # machine its start-up took longer than the whole job, which left no screen mid-job.
        deadline = time.monotonic() + 60
        while not re.search(r"^\s*r1\s+live\s", tmux("capture-pane", "-p", "-t", session), re.M):
            assert time.monotonic() < deadline, tmux("capture-pane", "-p", "-t", session)
            time.sleep(0.2)
        status = run_job(cluster, data, "top-job", tmp_path / "out", during=look)
        assert status.done
        during = [s for s in screens if eta_line.search(s)]
        assert during, "no screen showed the job with an ETA:\n" + (screens[-1] if screens else "(none)")
        screen = during[len(during) // 2]
        print("\n" + screen)
        assert re.search(r"^\s*r0\s+live\s", screen, re.M) and re.search(r"^\s*r1\s+live\s", screen, re.M), screen
        assert re.search(r"^\s*node0\s+live\s+\d", screen, re.M), screen
        # `top` redraws every 0.5 s, later on a loaded machine (it once showed the job
        # 1.5 s stale): its screen comes to show the job done.
        deadline = time.monotonic() + 30
        look()
        while not re.search(r"top-job\s.*2,400/2,400.*done", screens[-1]):
            assert time.monotonic() < deadline, screens[-1]
            time.sleep(0.3)
            look()
    finally:
        tmux("kill-session", "-t", session)

    # The status carries what an output token cost the engines, in prompt tokens (the ETA's
    # weight of the remaining output): for the echo engine, what its delays make it.
    prompt = pq.read_table(tmp_path / "out", columns=["prompt_tokens"]).column("prompt_tokens").to_pylist()
    want = ECHO_TOKEN_DELAY / (ECHO_DELAY / (sum(prompt) / len(prompt)))
    assert status.decode_cost == pytest.approx(want, rel=0.15), (status.decode_cost, want)

    # `prefixflow status` reads the same job from the job-status bucket.
    res = run_cli("status", "--nats", cluster.url, "top-job", timeout=60)
    assert res.returncode == 0, res.stderr
    assert re.search(r"top-job\s+done\s+2400\s+2400\s+0\s", res.stdout), res.stdout
    res = run_cli("status", "--nats", cluster.url, "--json", timeout=60)
    jobs = {j["job"]: j for j in json.loads(res.stdout)}
    assert jobs["top-job"]["state"] == "done" and jobs["top-job"]["rows"] == 2400


def test_report_on_a_finished_job_writes_the_plots(cluster, tmp_path, tiny_model):
    n = 600
    data = write_input(tmp_path / "in.parquet", tiny_model, n, bad=BAD_ROWS)
    out = tmp_path / "out"
    assert run_job(cluster, data, "report-job", out).done
    res = run_cli("report", str(out), "--model", str(tiny_model), timeout=120)
    assert res.returncode == 0, res.stderr + res.stdout
    report = out / "_report"
    for name in ("throughput.png", "hit_rate.png", "idle.png", "bucket_sizes.png"):
        png = (report / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    index = (report / "index.html").read_text()
    assert all(f"src='{p}'" in index for p in ("throughput.png", "hit_rate.png", "idle.png", "bucket_sizes.png"))
    groups = (report / "groups.csv").read_text().splitlines()
    assert len(groups) == 1 + PREFIXES  # header + one line per prefix group
    assert sum(int(line.split(",")[2]) for line in groups[1:]) == n  # every ok row in a group
    # The output still reads as one table (the report's directory starts with '_').
    assert pq.read_table(out).num_rows == n + BAD_ROWS
