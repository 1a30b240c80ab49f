"""prefixflow.shared.process.metrics and what feeds it: the Grafana dashboard names only exported
metrics, error texts map to reason labels, the engine collector reads the status, the
bucketer's releases carry their reason, the router's decisions their match length, and
the sink's parts their token counts."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from pathlib import Path

import msgspec
import pytest
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from prefixflow.services.bucketer.buffer import RELEASE_REASONS, Item, PrefixBuffer
from prefixflow.services.ingestor.plan import Incoming, Model, plan_batch
from prefixflow.services.ingestor.validate import length_error
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import make_policy
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.bus.poison import error_rows
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes
from prefixflow.shared.process import metrics
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "prefixflow-dashboard.json"
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
}


def fake_status(**kw) -> m.EngineStatus:
    return m.EngineStatus(replica="r7", ts=1.0, ready=True, inflight=3, window=8, outstanding_tokens=99, completed=12,
                          prompt_tokens=400, cached_tokens=100, output_tokens=50, idle_seconds=2.5, **kw)


def service_registry(service: str) -> CollectorRegistry:
    """A registry holding what `metrics.serve(service, ...)` registers (and the process
    collector prometheus-client registers by default)."""
    registry = CollectorRegistry()
    collectors = [metrics.EngineCollector(fake_status, lambda: 2)] if service == "engine-worker" else []
    for c in [*metrics.COMMON, *metrics.SERVICE_METRICS[service], *collectors]:
        registry.register(c)
    ProcessCollector(registry=registry)
    return registry


def exported_names() -> set[str]:
    """Every sample name the five services expose (labelled metrics without children
    included: their families are declared on the page)."""
    names = set()
    for service in metrics.SERVICE_METRICS:
        for family in text_string_to_metric_families(generate_latest(service_registry(service)).decode()):
            names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES.get(family.type, ("",)))
    return names


def vllm_names() -> set[str]:
    """The metrics vLLM's PrometheusStatLogger registers (read from its source, without
    importing vLLM), as exposed sample names."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vLLM is not installed")
    source = (Path(next(iter(spec.submodule_search_locations))) / "v1" / "metrics" / "loggers.py").read_text()
    names = set()
    for kind, name in re.findall(r"_(counter|gauge|histogram)_cls\(\s*name=\"(vllm:[\w:]+)\"", source):
        names.update(name + suffix for suffix in SAMPLE_SUFFIXES[kind])
    assert "vllm:num_requests_running" in names and "vllm:prefix_cache_hits_total" in names
    return names


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        exprs += [t["expr"] for t in panel["targets"]]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    return exprs


def test_dashboard_names_only_exported_metrics():
    named = {n for e in dashboard_exprs() for n in re.findall(r"\b(?:pfx_\w+|process_\w+)\b|vllm:[\w:]+", e)}
    exported = exported_names() | vllm_names()
    assert named, "the dashboard names metrics"
    assert named - exported == set(), "the dashboard names metrics nobody exports"
    # It shows every service and the list: flow, errors, queues, buckets, routing,
    # engines (vLLM's own), hit rate, tokens/s, restarts and redeliveries.
    for must in ("pfx_prompts_in_total", "pfx_prompts_out_total", "pfx_error_rows_total", "pfx_consumer_pending",
                 "pfx_bucketer_buffered_prompts", "pfx_bucketer_bucket_size_bucket", "pfx_bucketer_releases_total",
                 "pfx_router_decisions_total", "pfx_router_match_blocks_bucket", "pfx_router_outstanding_tokens",
                 "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "pfx_sink_cached_tokens_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "process_start_time_seconds", "pfx_consumer_redelivered_total", "pfx_engine_rebuilds_total"):
        assert must in named, must


def test_every_metric_is_named_once_and_prefixed():
    names = [n for group in (metrics.COMMON, *metrics.SERVICE_METRICS.values()) for c in group for n in [c._name]]
    names += [*metrics.ENGINE_GAUGES, *metrics.ENGINE_COUNTERS, metrics.ENGINE_REBUILDS]
    assert len(names) == len(set(names))
    assert all(n.startswith("pfx_") and "vllm" not in n for n in names)  # vLLM unregisters names with "vllm"


def test_engine_collector_reads_the_status():
    page = {s.name: (s.labels, s.value) for f in text_string_to_metric_families(generate_latest(service_registry("engine-worker")).decode())
            for s in f.samples}
    assert page["pfx_engine_inflight"] == ({"replica": "r7"}, 3.0)
    assert page["pfx_engine_window"][1] == 8 and page["pfx_engine_ready"][1] == 1
    assert page["pfx_engine_completed_total"][1] == 12 and page["pfx_engine_cached_tokens_total"][1] == 100
    assert page["pfx_engine_output_tokens_total"][1] == 50 and page["pfx_engine_idle_seconds_total"][1] == 2.5
    assert page["pfx_engine_rebuilds_total"][1] == 2


def test_serve_with_port_zero_registers_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(metrics, "start_http_server", lambda *a, **k: calls.append(a))
    metrics.serve("sink", 0)
    assert calls == []


# --- error reasons -----------------------------------------------------------------------


def plan_errors(raw: list[bytes], vocab: int = 100) -> list[str]:
    model = Model(encode_batch=lambda texts: [[1, 2, 3] for _ in texts], vocab_size=vocab, max_model_len=16, hash_block_size=4)
    spec = m.JobSpec("j", "/o", m.SamplingSpec(max_tokens=8))
    plan = plan_batch([Incoming("pfx.ingest.j", d, {"Pfx-Id": "7"}) for d in raw], {"j": m.JobLookup(spec)}, model, lambda k: "n0")
    return [r.error for r in plan.errors["j"]]


def test_error_reason_names_every_error_the_stages_write():
    enc = msgspec.json.encode
    seen = {
        "invalid_utf8": plan_errors([b'{"id": 1, "prompt": "\xff\xfe"}']),
        "malformed": plan_errors([b"{not json", enc({"id": 1, "prompt_token_ids": "x"}), enc({"id": 1})]),
        "empty_prompt": plan_errors([enc({"id": 1, "prompt": ""}), enc({"id": 1, "prompt_token_ids": []})]),
        "too_long": [length_error(20, 8, 16)],
        "bad_token": plan_errors([enc({"id": 1, "prompt_token_ids": [1, 500]})]),
        "poison": [r.error for _, r in error_rows([m.Prompt("j", 1, tk.pack([1]))], "poison message")]
        + ["poison message: result could not be written after 6 deliveries"],
        "sampling": ["bad sampling parameters: max_tokens must be > 0"],
    }

    class NoKv:
        async def get(self, key):
            from nats.js.errors import KeyNotFoundError

            raise KeyNotFoundError

    seen["job"] = [asyncio.run(JobCache(NoKv()).get("nope")).error, "invalid job spec: Expected `str`"]
    for reason, errors in seen.items():
        assert errors and all(errors), reason
        for text in errors:
            assert metrics.error_reason(text) == reason, (reason, text)
    assert metrics.error_reason("prompt is too long for vLLM's own check") == "engine"


def test_stream_of_subject():
    assert metrics.stream_of("pfx.results.job7") == "results"
    assert metrics.stream_of("pfx.dead.pfx.work.r0") == "dead"


# --- what feeds the metrics --------------------------------------------------------------


def items(prefix: int, n: int, at: float = 0.0) -> list[Item]:
    return [Item(tk.pack([prefix] * 8 + [i]), at, payload=None, weight=10) for i in range(n)]


def test_released_buckets_say_why():
    buf = PrefixBuffer(max_prompts=10, min_bucket=4, max_wait=5.0, block_size=4, pool_size=4)
    for it in items(1, 3, at=0.0) + items(2, 6, at=4.0):
        buf.insert(it)
    out = buf.pop(5.5)  # prefix 1 waited 5.5 s: its bucket (3 prompts, pooled) goes
    assert [r for b in out for r in b.released] == [(3, "max_wait")]
    for it in items(3, 6, at=5.0):  # 12 > 10 prompts: the largest bucket goes
        buf.insert(it)
    out = buf.pop(5.5)
    assert [r for b in out for r in b.released] == [(6, "size")]
    out = buf.pop(5.6, budget=1)  # the replicas have room: the largest goes
    assert [r for b in out for r in b.released] == [(6, "eager")]
    buf.insert(items(4, 1, at=5.6)[0])
    out = buf.pop(5.7, flush=True)
    assert [r for b in out for r in b.released] == [(1, "flush")]
    assert {r for b in out for _, r in b.released} <= set(RELEASE_REASONS)
    assert len(buf) == 0


def test_router_records_the_match_of_each_routed_part():
    fleet = Fleet(dead_after=5, cap_tokens=10_000)
    for name in ("a", "b"):
        fleet.observe(name, 1.0, ready=True, outstanding=0, done_tokens=0)
    policy = make_policy("prefix-aware")
    key = block_hashes(tk.pack(list(range(12))), 4)
    first = policy.route(fleet, 1.0, 1, 10, key)
    assert policy.last_matches == [0]  # nobody held it
    assert policy.route(fleet, 1.0, 1, 10, key) == first and policy.last_matches == [3]
    policy.route_parts(fleet, 1.0, [(1, 10, key[:2]), (1, 10, [])])
    assert policy.last_matches == [2]  # keyless parts have no match to record
    assert make_policy("round-robin").route(fleet, 1.0, 1, 10, []) and make_policy("round-robin").last_matches == []


def test_part_stats_count_tokens_and_errors_by_text(tmp_path):
    out = JobOutput("j", tmp_path)
    out.add(m.Result(1, prompt_tokens=10, cached_tokens=4, output_tokens=2, replica="r0"), finished_at=5.0)
    out.add(m.Result(2, prompt_tokens=20, cached_tokens=0, output_tokens=3, replica="r1", finished_at=7.5, started_at=6.0, bucket="b1"))
    out.add(m.error_result(3, "empty prompt"))
    out.add(m.error_result(4, "empty prompt"))
    assert out.flush() == 4
    stats = out.last_part
    assert stats.ok == 2 and stats.errors == {"empty prompt": 2}
    assert stats.replicas == {"r0": [10, 4, 2], "r1": [20, 0, 3]}
    assert out.tokens == [30, 4, 5]
    again = JobOutput("j", tmp_path)  # a restart reads the totals back
    assert (again.rows, again.errors, again.tokens) == (4, 2, [30, 4, 5])
    import pyarrow.parquet as pq

    rows = {r["id"]: r for r in pq.read_table(tmp_path).to_pylist()}
    assert rows[1]["finished_at"] == 5.0 and rows[1]["started_at"] is None and rows[1]["bucket"] is None
    assert (rows[2]["finished_at"], rows[2]["started_at"], rows[2]["bucket"]) == (7.5, 6.0, "b1")


def test_job_status_hit_rate_and_eta():
    st = m.JobStatus("j", rows=100, total=400, rate=50.0, prompt_tokens=1000, cached_tokens=250)
    assert st.hit_rate == 0.25 and st.eta_seconds() == 6.0
    assert m.JobStatus("j", rows=5, rate=1.0).eta_seconds() is None  # not sealed: no total yet
    assert m.JobStatus("j", rows=5, total=9).eta_seconds() is None  # nothing written lately
    assert m.JobStatus("j", rows=9, total=9, done=True).eta_seconds() == 0.0
    assert m.JobStatus("j").hit_rate == 0.0
    raw = m.encode_json(st)
    assert m.job_status_decoder.decode(raw) == st
