"""Every Prometheus metric of prefixflow, named in one place.

Each service process serves its metrics on `--metrics-port` (`PFX_METRICS_PORT`; 0, the
default, serves nothing): `serve(name, port)` registers the metrics every process has
plus the service's own in prometheus-client's default registry and starts the HTTP
server. The engine-worker's registry also holds vLLM's own `vllm:*` metrics (its
`PrometheusStatLogger` registers there when the engine starts with stats on), which are
served as they are, never recomputed: running and waiting requests, KV-cache usage,
prefix-cache queries and hits, prompt and generation tokens.

Services update these per batch (a fetch, a released bucket, a route decision, a part
written), never per prompt; state that already lives in a service (buffer depth, the
router's view of the fleet, the worker's status) is read when Prometheus scrapes.
Counters are exposed with a `_total` suffix (`pfx_prompts_in` -> `pfx_prompts_in_total`);
restarts are `process_start_time_seconds` changing (prometheus-client's process
collector), redeliveries `pfx_consumer_redelivered_total`. `deploy/grafana/` has a
dashboard over these names (a unit test checks it names only exported metrics).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# NOTE: created with registry=None: a process registers only its own service's metrics
# (`serve`), so an ingestor does not export the sink's counters as zeros.


def _counter(name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
    return Counter(name, doc, tuple(labels), registry=None)


def _gauge(name: str, doc: str, labels: Iterable[str] = ()) -> Gauge:
    return Gauge(name, doc, tuple(labels), registry=None)


def _histogram(name: str, doc: str, labels: Iterable[str] = (), buckets: Iterable[float] = ()) -> Histogram:
    return Histogram(name, doc, tuple(labels), registry=None, buckets=tuple(buckets))


SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
"""Prompts per bucket."""
BLOCK_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
"""Matched prefix blocks."""
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)

# --- every process (prefixflow/shared/bus) -------------------------------------------

CONSUMER_PENDING = _gauge(
    "pfx_consumer_pending", "Messages waiting in a durable consumer (as of its last fetch): the queue depth", ["consumer"]
)
CONSUMER_FETCHED = _counter("pfx_consumer_fetched", "Messages fetched from a durable consumer", ["consumer"])
CONSUMER_REDELIVERED = _counter(
    "pfx_consumer_redelivered", "Fetched messages delivered more than once (a holder crashed, a nak, failover)", ["consumer"]
)
DEAD_LETTERS = _counter("pfx_dead_letters", "Messages copied to the PFX_DEAD stream, by the stream they came from", ["stream"])
PUBLISH_WAITS = _counter(
    "pfx_publish_waits", "Publish retries while a stream was full or the server away (backpressure), by stream", ["stream"]
)

# --- ingestor ------------------------------------------------------------------------

PROMPTS_IN = _counter(
    "pfx_prompts_in", "Prompts ingested: ok (sent to a bucketer) or error (an error row at once)", ["outcome"]
)
INGEST_BATCH_SECONDS = _histogram(
    "pfx_ingest_batch_seconds", "Seconds to plan (parse, tokenize, shard) and publish one fetched batch", buckets=SECONDS_BUCKETS
)
TAKEOVER_MOVED = _counter(
    "pfx_ingestor_takeover_moved", "Bucket messages moved off bucketer nodes gone for good (no heartbeat for --bucketer-gone-after) to live nodes"
)

# --- bucketer ------------------------------------------------------------------------

BUCKETER_PROMPTS_IN = _counter("pfx_bucketer_prompts_in", "Prompts taken into the buffer", ["node"])
BUCKETER_BUFFERED = _gauge("pfx_bucketer_buffered_prompts", "Prompts in the buffer", ["node"])
BUCKETER_HELD = _gauge("pfx_bucketer_held_messages", "Input messages held until their prompts are published", ["node"])
BUCKET_SIZE = _histogram(
    "pfx_bucketer_bucket_size", "Prompts per released bucket (a pooled batch counts each small bucket in it)", ["node"], SIZE_BUCKETS
)
RELEASES = _counter(
    "pfx_bucketer_releases", "Buckets released, by why: size (buffer over its bound), max_wait, eager (replicas had room), flush (end of input, shutdown)",
    ["node", "reason"],
)
RELEASED_PROMPTS = _counter(
    "pfx_bucketer_released_prompts",
    "Prompts released, by why (as pfx_bucketer_releases); a prompt the router kept back (pfx_router_kept_prompts) is released again",
    ["node", "reason"],
)
ROUTE_RETRIES = _counter("pfx_bucketer_route_retries", "Route requests answered retry-after (every open replica at its cap) or unanswered", ["node"])

# --- router --------------------------------------------------------------------------

ROUTER_DECISIONS = _counter(
    "pfx_router_decisions", "Route decisions by outcome: routed (one replica), split (several), retry_after, error, repeated (a request asked again: its first answer)", ["policy", "outcome"]
)
ROUTER_MATCH_BLOCKS = _histogram(
    "pfx_router_match_blocks", "Prefix blocks of a routed (part of a) bucket already in the chosen replica's history", ["policy"], BLOCK_BUCKETS
)
ROUTER_ROUTED_PROMPTS = _counter("pfx_router_routed_prompts", "Prompts routed to each replica", ["replica"])
ROUTER_KEPT_PROMPTS = _counter(
    "pfx_router_kept_prompts", "Prompts of routed buckets handed back to their bucketer: past the chosen replicas' room (bounded lead)"
)
ROUTER_OUTSTANDING = _gauge("pfx_router_outstanding_tokens", "Engine cost charged to a replica and not completed, in prompt tokens (the router's load measure)", ["replica"])
ROUTER_LIVE = _gauge("pfx_router_replica_live", "1 while the replica reports ready within --dead-after", ["replica"])
FAILOVER_MOVED = _counter("pfx_router_failover_moved", "Work batches moved off replicas that stopped reporting")

# --- sink ----------------------------------------------------------------------------

PROMPTS_OUT = _counter("pfx_prompts_out", "Rows written to Parquet (every prompt exactly once): ok or error", ["outcome"])
ERROR_ROWS = _counter("pfx_error_rows", "Error rows written, by reason (see error_reason)", ["reason"])
SINK_DUPLICATES = _counter("pfx_sink_duplicates", "Result rows dropped as duplicates (redelivered work)")
SINK_RESULTS_REFUSED = _counter(
    "pfx_sink_results_refused", "Result rows not written: their origin holds no assignment of them (provenance.py)")
SINK_PROMPT_TOKENS = _counter("pfx_sink_prompt_tokens", "Prompt tokens of the ok rows written, by replica", ["replica"])
SINK_CACHED_TOKENS = _counter("pfx_sink_cached_tokens", "Prefix-cache hit tokens (vLLM num_cached_tokens) of the ok rows written, by replica", ["replica"])
SINK_DEDUPLICATED_ROWS = _counter(
    "pfx_deduplicated_rows", "Rows written whose output is a copy of an identical deterministic row's (generated once)"
)
SINK_MERGED_ROWS = _counter(
    "pfx_merged_rows", "Rows written whose completion came from a request merged (n) with identical sampled rows"
)
SINK_OUTPUT_TOKENS = _counter("pfx_sink_output_tokens", "Generated tokens of the ok rows written, by replica", ["replica"])
SINK_PENDING_ROWS = _gauge("pfx_sink_pending_rows", "Rows queued for the next Parquet part")
SINK_OPEN_JOBS = _gauge("pfx_sink_open_jobs", "Jobs with an open output")
SINK_JOBS_DONE = _counter("pfx_sink_jobs_done", "Jobs completed (summary written)")
SINK_PART_SECONDS = _histogram("pfx_sink_part_write_seconds", "Seconds to write and fsync one Parquet part", buckets=SECONDS_BUCKETS)

# --- engine-worker (read from its status when scraped) -------------------------------

ENGINE_GAUGES: dict[str, tuple[str, Callable[[Any], float]]] = {
    "pfx_engine_ready": ("1 while the engine takes work", lambda s: float(s.ready)),
    "pfx_engine_inflight": ("Prompts submitted to the engine and not finished", lambda s: s.inflight),
    "pfx_engine_window": ("Most prompts the worker keeps in flight now", lambda s: s.window),
    "pfx_engine_outstanding_tokens": ("Work tokens (prompt + max_tokens) of the prompts in flight", lambda s: s.outstanding_tokens),
}
ENGINE_COUNTERS: dict[str, tuple[str, Callable[[Any], float]]] = {
    "pfx_engine_completed": ("Prompts finished (ok or error), since the worker started", lambda s: s.completed),
    "pfx_engine_prompt_tokens": ("Prompt tokens of finished prompts", lambda s: s.prompt_tokens),
    "pfx_engine_cached_tokens": ("Prefix-cache hit tokens of finished prompts (num_cached_tokens)", lambda s: s.cached_tokens),
    "pfx_engine_output_tokens": ("Generated tokens of finished prompts", lambda s: getattr(s, "output_tokens", 0)),
    "pfx_engine_idle_seconds": ("Seconds with no prompt in the engine", lambda s: s.idle_seconds),
    "pfx_engine_deduplicated_rows": ("Rows given a copy of an identical deterministic request's completion (not generated again)",
                                     lambda s: getattr(s, "deduplicated", 0)),
    "pfx_engine_merged_rows": ("Rows that took one completion of an identical sampled request merged with theirs (n)",
                               lambda s: getattr(s, "merged", 0)),
}
ENGINE_REBUILDS = "pfx_engine_rebuilds"


class EngineCollector(Collector):
    """The engine-worker's metrics, read from its `EngineStatus` (the same numbers the
    router gets) when Prometheus scrapes: nothing is counted twice."""

    def __init__(self, status: Callable[[], Any], rebuilds: Callable[[], int] = lambda: 0) -> None:
        self.status = status
        self.rebuilds = rebuilds

    def collect(self):
        s = self.status()
        labels = [s.replica]
        for name, (doc, value) in ENGINE_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=["replica"])
            g.add_metric(labels, float(value(s)))
            yield g
        for name, (doc, value) in ENGINE_COUNTERS.items():
            c = CounterMetricFamily(name, doc, labels=["replica"])
            c.add_metric(labels, float(value(s)))
            yield c
        c = CounterMetricFamily(ENGINE_REBUILDS, "Engines rebuilt in place after their core died", labels=["replica"])
        c.add_metric(labels, float(self.rebuilds()))
        yield c


# --- which process exports what -------------------------------------------------------

COMMON = [CONSUMER_PENDING, CONSUMER_FETCHED, CONSUMER_REDELIVERED, DEAD_LETTERS, PUBLISH_WAITS]
SERVICE_METRICS: dict[str, list] = {
    "ingestor": [PROMPTS_IN, INGEST_BATCH_SECONDS, TAKEOVER_MOVED],
    "bucketer": [BUCKETER_PROMPTS_IN, BUCKETER_BUFFERED, BUCKETER_HELD, BUCKET_SIZE, RELEASES, RELEASED_PROMPTS, ROUTE_RETRIES],
    "router": [ROUTER_DECISIONS, ROUTER_MATCH_BLOCKS, ROUTER_ROUTED_PROMPTS, ROUTER_KEPT_PROMPTS, ROUTER_OUTSTANDING, ROUTER_LIVE, FAILOVER_MOVED],
    "engine-worker": [],  # EngineCollector, plus vLLM's own
    "sink": [
        PROMPTS_OUT, ERROR_ROWS, SINK_DUPLICATES, SINK_RESULTS_REFUSED, SINK_PROMPT_TOKENS, SINK_CACHED_TOKENS, SINK_OUTPUT_TOKENS,
        SINK_DEDUPLICATED_ROWS, SINK_MERGED_ROWS,
        SINK_PENDING_ROWS, SINK_OPEN_JOBS, SINK_JOBS_DONE, SINK_PART_SECONDS,
    ],
}

_lock = threading.Lock()
_registered: set[int] = set()


def register(metrics: Iterable[Any], registry=REGISTRY) -> None:
    """Register metrics or collectors once (idempotent per object)."""
    with _lock:
        for metric in metrics:
            if id(metric) not in _registered:
                registry.register(metric)
                _registered.add(id(metric))


def serve(service: str, port: int, collectors: Iterable[Collector] = (), addr: str = "127.0.0.1") -> None:
    """Register `service`'s metrics (and `collectors`) and serve them on `port` (0: no
    server; the metrics still count, cheaply, in memory)."""
    if not port:
        return
    register([*COMMON, *SERVICE_METRICS[service], *collectors])
    start_http_server(port, addr=addr)


# --- helpers ---------------------------------------------------------------------------


def stream_of(subject: str) -> str:
    """The stream kind of a subject (`pfx.results.job7` -> `results`): a label with a
    bounded set of values (jobs, nodes and replicas are not labels here)."""
    parts = subject.split(".")
    return parts[1] if len(parts) > 1 else subject


ERROR_REASONS: tuple[tuple[str, str], ...] = (
    ("invalid UTF-8", "invalid_utf8"),
    ("malformed message", "malformed"),
    ("missing or invalid 'id'", "malformed"),
    ("invalid 'prompt_token_ids'", "malformed"),
    ("missing 'prompt'", "malformed"),
    ("empty prompt", "empty_prompt"),
    ("prompt has no tokens", "empty_prompt"),
    ("prompt too long", "too_long"),
    ("token id ", "bad_token"),
    ("poison message", "poison"),
    ("unknown job", "job"),
    ("invalid job spec", "job"),
    ("bad sampling parameters", "sampling"),
)
"""Leading words of the error texts the stages write -> a reason label (few values)."""


def error_reason(error: str) -> str:
    """The reason label of an error row's text; `engine` for anything else (the engine
    refused or failed the request)."""
    for prefix, reason in ERROR_REASONS:
        if error.startswith(prefix):
            return reason
    return "engine"
