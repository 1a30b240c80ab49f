"""prefixflow.client.status: the job lines of `prefixflow status` and the screen of `prefixflow top`,
fed with messages as NATS would deliver them (tests/nats/test_observability.py runs
both against a real cluster, `top` in tmux)."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from prefixflow.client.status import JobView, Top, fmt_duration, status_table
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def screen(renderable, width: int = 160) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_fmt_duration():
    assert fmt_duration(None) == "?" and fmt_duration(float("inf")) == "?"
    assert fmt_duration(7.4) == "0:07" and fmt_duration(65) == "1:05" and fmt_duration(3725) == "1:02:05"


def test_job_views():
    running = JobView.of("a", m.JobStatus("a", rows=100, total=400, rate=50.0, updated_at=5.0, prompt_tokens=10, cached_tokens=4), None)
    assert (running.state, running.eta, running.hit_rate) == ("running", 6.0, 0.4)
    done = JobView.of("b", m.JobStatus("b", rows=9, total=9, done=True, summary={"wall_seconds": 3.0, "prefix_cache_hit_rate": 0.5},
                                       updated_at=time.time(), expires_at=time.time() + 3 * 3600 + 30), None)
    assert (done.state, done.rate, done.hit_rate, done.eta) == ("done", 3.0, 0.5, 0.0)
    failed = JobView.of("c", m.JobStatus("c", failed=True, error="bad spec"), None)
    assert failed.state == "failed" and failed.error == "bad spec"
    queued = JobView.of("d", None, m.JobSpec("d", "/o", total=7, created_at=1.0))
    assert queued.state == "queued" and queued.total == 7
    text = screen(status_table([running, done, failed, queued]))
    lines = {line.split()[0]: line for line in text.splitlines()[1:] if line.strip()}
    assert lines["a"].split()[:5] == ["a", "running", "100", "400", "0"]
    assert "0:06" in lines["a"] and "40.0%" in lines["a"]
    assert "done" in lines["b"] and "50.0%" in lines["b"]
    assert lines["b"].split()[-1] == "3:00:30" or lines["b"].split()[-1] == "3:00:29", "when the cluster forgets it"
    assert lines["a"].split()[-1] == "-", "unknown expiry"
    assert "failed" in lines["c"] and "queued" in lines["d"]


def status(replica: str, **kw) -> m.EngineStatus:
    base = dict(ts=time.time(), ready=True, inflight=4, window=8, outstanding_tokens=1234, running=3, waiting=1, kv_usage=0.42)
    return m.EngineStatus(replica, **{**base, **kw})


def test_top_shows_replicas_bucketers_and_job_progress_with_eta():
    top = Top("nats://x:4222")
    now = 1000.0
    # r0: 2 s of history: 2000 prompt tokens (1000 cached) and 400 generated
    top.on_status(status("r0", prompt_tokens=1000, cached_tokens=0, output_tokens=100, completed=10), now - 2)
    top.on_status(status("r0", prompt_tokens=3000, cached_tokens=1000, output_tokens=500, completed=30), now)
    top.on_status(status("r1", ready=False), now - 1)
    top.on_status(status("r2"), now - 30)  # silent
    top.on_heartbeat(m.BucketerHeartbeat("node0", time.time(), buffered=321), now)
    top.on_job(m.JobStatus("job7", rows=250, total=1000, rate=25.0, updated_at=time.time(), prompt_tokens=100, cached_tokens=30))
    top.on_job(m.JobStatus("old", rows=5, total=5, done=True, updated_at=time.time() - 3600))
    text = screen(top.render(now))
    lines = {line.split()[0]: line for line in text.splitlines() if line.strip()}
    r0 = lines["r0"].split()
    assert r0[1] == "live" and "4/8" in r0 and "1,234" in r0 and "42%" in r0
    assert "1,000" in r0 and "200" in r0  # prompt and generated tokens per second
    assert "50.0%" in r0  # hit rate over the last seconds (1000 cached of 2000)
    assert "not ready" in lines["r1"] and "down" in lines["r2"]
    assert "live" in lines["node0"] and "321" in lines["node0"]
    assert "250/1,000" in lines["job7"] and "ETA 0:30" in lines["job7"] and "30.0%" in lines["job7"]
    assert "old" not in lines  # done an hour ago


def test_top_before_anything_reports():
    text = screen(Top("nats://x:4222").render(0.0))
    assert "no engine status yet" in text and "no heartbeat yet" in text and "no job in progress" in text


def test_top_restarted_worker_starts_its_rates_over():
    top = Top("u")
    top.on_status(status("r0", prompt_tokens=5000, completed=50), 10.0)
    top.on_status(status("r0", prompt_tokens=100, completed=1), 11.0)  # restarted: counts from 0
    top.on_status(status("r0", prompt_tokens=300, completed=3), 12.0)
    p_rate, _, _ = top.replicas["r0"].rates(12.0)
    assert p_rate == 200.0


def test_a_cancelled_job_reads_cancelling_until_the_sink_settles_it_then_cancelled():
    spec = m.JobSpec("j", "/o", created_at=10.0, cancelled_at=20.0)
    assert JobView.of("j", None, spec).state == "cancelling"
    running = m.JobStatus("j", rows=5, updated_at=21.0, created_at=10.0)
    view = JobView.of("j", running, spec)
    assert view.state == "cancelling" and view.created_at == 10.0
    done = m.JobStatus("j", rows=5, done=True, cancelled=True, updated_at=24.0, created_at=10.0)
    assert JobView.of("j", done, spec).state == "cancelled"
    assert JobView.of("j", m.JobStatus("j", rows=5, done=True), None).state == "done"
