"""Typed configuration for every service, from flags and environment variables.

Each service has a strict `msgspec.Struct`: a field is a flag (`--max-wait`) and an
environment variable (`PFX_MAX_WAIT`); precedence is flag > environment > default. The
description in each field's `Meta` is the flag's `--help` text. Values are validated
(types and ranges) when the service starts, so a bad setting fails at once with a clear
message instead of misbehaving later.
"""

from __future__ import annotations

import argparse
import os
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE

ENV_PREFIX = "PFX_"
DEFAULT_MODEL = ".prefixflow/models/tiny-llama"
"""Where `prefixflow make-model` builds the local random-weight model (the default model)."""
Policy = Literal["prefix-aware", "daft", "least-loaded", "round-robin"]
"""Routing policies (`prefixflow/services/router/policies.py`), the default first."""
POLICIES: tuple[str, ...] = typing.get_args(Policy)
EngineKind = Literal["vllm", "echo"]
"""Engine kinds: vllm (the real engine), echo (no model; tests of the orchestration)."""
ENGINES: tuple[str, ...] = typing.get_args(EngineKind)


def _d(text: str, **constraints: Any) -> Meta:
    return Meta(description=text, **constraints)


ResultKey = Annotated[
    str, _d("secret of the bucketer, the router and the sink (hex, at least 32 digits): each prompt sent to a "
            "replica carries a grant made with it, and the sink writes a replica's result only with the grant "
            "of its assignment (prefixflow/shared/wire/provenance.py); `cluster config` writes it, `run` makes "
            "one; empty: no grants (a local cluster)")
]


class CommonConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    nats_url: Annotated[str, _d("NATS server URL(s), comma separated")] = "nats://127.0.0.1:4222"
    log_format: Annotated[
        Literal["auto", "console", "json"], _d("log renderer; auto: console on a TTY, else JSON")
    ] = "auto"
    log_level: Annotated[Literal["debug", "info", "warning", "error"], _d("log level")] = "info"
    drain_timeout: Annotated[float, _d("seconds to finish in-flight work on SIGTERM", gt=0)] = 4.0
    metrics_port: Annotated[
        int, _d("serve Prometheus metrics on this port (0: off; prefixflow/shared/process/metrics.py)", ge=0, le=65535)
    ] = 0
    metrics_host: Annotated[
        str, _d("address the metrics server listens on (a fleet's nodes: their own address; 0.0.0.0: every "
                "interface, unauthenticated)")
    ] = "127.0.0.1"
    nats_user: Annotated[str, _d("NATS user (`prefixflow cluster config` writes one per role); empty: no authentication")] = ""
    nats_password: Annotated[str, _d("the NATS user's password (keep it in a 0600 env file)")] = ""
    nats_tls_ca: Annotated[str, _d("CA file that signs the NATS servers' certificates; set: connect with TLS")] = ""
    nats_tls_cert: Annotated[str, _d("client certificate for NATS (servers that verify clients)")] = ""
    nats_tls_key: Annotated[str, _d("the client certificate's key")] = ""
    stream_replicas: Annotated[
        int, _d("JetStream replicas of streams and buckets (0: 3 on a cluster of 3+ servers, else 1)", ge=0, le=5)
    ] = 0
    job_retention: Annotated[
        float, _d("seconds job specs, statuses and dead letters are kept after their last write "
                  "(0: 7 days); output files stay", ge=0)
    ] = 0.0
    provision: Annotated[
        bool, _d("create or update the streams and buckets at start-up (off: only check they exist, as a "
                 "fleet's services do: `prefixflow cluster provision` creates them with admin credentials)")
    ] = True

    def check_connection(self) -> None:
        """Credentials and TLS files that cannot work fail at start-up (`load` calls
        this; not a `__post_init__`, which subclasses override)."""
        if bool(self.nats_user) != bool(self.nats_password):
            raise ValueError("nats_user and nats_password go together")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError("nats_tls_cert and nats_tls_key go together")
        for name in ("nats_tls_ca", "nats_tls_cert", "nats_tls_key"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise ValueError(f"{name}: no such file {path!r}")
        if getattr(self, "result_key", ""):
            from prefixflow.shared.wire.provenance import parse_key

            parse_key(self.result_key)
        if getattr(self, "files_uri", ""):
            from prefixflow.shared.outputs import OutputLocationError, object_prefix

            try:
                object_prefix(self.files_uri)
            except OutputLocationError as exc:
                raise ValueError(f"files_uri: {exc} (or nothing: the NATS object store)") from None


class ModelConfig(CommonConfig, kw_only=True):
    model: Annotated[str, _d("model directory or hub id (default: the locally built tiny model)")] = (
        DEFAULT_MODEL
    )
    max_model_len: Annotated[
        int, _d("longest prompt + output, in tokens (0: the model's own, from its config, as vLLM takes it)", ge=0)
    ] = 0
    task: Annotated[
        Literal["generate", "embed"],
        _d("what the cluster's engines do: generate text, or embed (vLLM pooling runner); a job of the other task fails"),
    ] = "generate"


class IngestorConfig(ModelConfig, kw_only=True):
    fetch_batch: Annotated[int, _d("ingest messages fetched per pull (8 while several jobs wait: their turns)", gt=0)] = 64
    max_job_consumers: Annotated[
        int, _d("jobs pulled at once (one consumer each on the ingest stream, shared by the ingestors): more jobs "
                "wait their turn in the stream; a tenant below its fair number still gets one, up to twice this", gt=0)
    ] = 64
    hash_block_size: Annotated[int, _d("prefix-key block length in tokens (sharding key)", gt=0)] = HASH_BLOCK_SIZE
    shard_epsilon: Annotated[
        float, _d("bounded-load sharding: a bucketer may take (1 + this) x the average recent load", gt=0)
    ] = 0.25
    bucketer_gone_after: Annotated[
        float,
        _d("seconds without a heartbeat after which a bucketer node is gone for good: the prompts left "
           "in its bucket stream are moved to live nodes (at least 2: heartbeats come every second)", ge=2),
    ] = 60.0
    chat_template_timeout: Annotated[
        float, _d("CPU seconds one row's chat template may take to render (past it: an error row naming the limit; "
                  "a job's own template that overruns 3 times has its further chat rows refused at once); 0: no "
                  "limit", ge=0)
    ] = 2.0


class BucketerConfig(CommonConfig, kw_only=True):
    result_key: ResultKey = ""
    node: Annotated[str, _d("this node's name (bucketer subject pfx.bucket.<node>)")] = "node0"
    buffer_prompts: Annotated[int, _d("most prompts held in the buffer", gt=0)] = 5000
    buffer_bytes: Annotated[int, _d("most token bytes held in the buffer", gt=0)] = 256 * 1024 * 1024
    min_bucket: Annotated[
        int, _d("released buckets this large go out keyed by their prefix; smaller ones are pooled", gt=0)
    ] = 16
    threshold: Annotated[
        float, _d("new bucket when neighbours share less than this fraction of the shorter prompt", ge=0, le=1)
    ] = 0.33
    max_wait: Annotated[float, _d("longest a prompt waits in the buffer, seconds", gt=0)] = 5.0
    idle_flush: Annotated[
        float, _d("release everything after this long without new input and none left upstream (end of input), seconds", gt=0)
    ] = 0.5
    hash_block_size: Annotated[int, _d("prefix-key block length in tokens (bucket keys)", gt=0)] = HASH_BLOCK_SIZE
    max_batch: Annotated[int, _d("most prompts in one work message", gt=0)] = 256
    max_bucket: Annotated[
        int,
        _d("a released bucket larger than this goes out in slices of this many prompts, each routed on "
           "its own under the replicas' caps (0: whole)", ge=0),
    ] = 256
    pool_size: Annotated[
        int, _d("pooled (mixed) batches go out at this many prompts (at least min_bucket)", gt=0)
    ] = 64
    eager: Annotated[
        bool, _d("also release the largest buckets whenever the router reports free room on the replicas")
    ] = True
    max_job_consumers: Annotated[
        int, _d("jobs pulled at once (one consumer each; a stream takes 1,000 in all): more jobs wait their turn; "
                "a tenant below its fair number still gets one, up to twice this (tenants first)", gt=0)
    ] = 64
    eager_delay: Annotated[
        float,
        _d("eager release starts once no input is left upstream (the ingest stream and this node's "
           "bucket stream are drained), or at the latest when the oldest prompt has waited this long, seconds", ge=0),
    ] = 2.0
    new_job_burst: Annotated[
        int, _d("work tokens a new job may release ahead of the jobs already running (a small job beside a "
                "large one runs nearly as if alone; 0: a new job starts at its fair share)", ge=0),
    ] = 32768

    def __post_init__(self) -> None:
        _check_name("node", self.node)


class RouterConfig(CommonConfig, kw_only=True):
    result_key: ResultKey = ""
    policy: Annotated[
        Policy, _d("routing policy")
    ] = "prefix-aware"
    hash_block_size: Annotated[
        int, _d("prefix-key block length in tokens (as the bucketers'); engine KV blocks are converted", gt=0)
    ] = HASH_BLOCK_SIZE
    replica_cap_tokens: Annotated[
        int, _d("outstanding work tokens per replica before retry-after (0: automatic, a bounded lead)", ge=0)
    ] = 0
    start_windows: Annotated[
        float, _d("automatic cap until a replica's rate is measured: engine windows of average prompts", gt=0)
    ] = 1.0
    cap_windows: Annotated[
        float, _d("prefix-aware: load slack (a replica this many engine windows of average prompts above the "
                  "least loaded may still win on a prefix match)", gt=0)
    ] = 2.0
    lead_seconds: Annotated[
        float, _d("automatic cap once a replica's rate is measured: its engine window plus this many seconds of "
                  "work at that rate; more waits in the bucketers (for jobs that come later, replicas that "
                  "come up later)", gt=0)
    ] = 0.4
    dead_after: Annotated[float, _d("seconds a replica may go without status (or stay not ready) before it is excluded and its queued work moved", gt=0)] = 5.0
    history: Annotated[int, _d("prefix keys remembered per replica when it reports no KV capacity", gt=0)] = 64
    load_slack_tokens: Annotated[
        int, _d("prefix-aware: a replica this many tokens above the least loaded may still win on a match (0: its cap)", ge=0)
    ] = 0
    split_factor: Annotated[
        float, _d("prefix-aware: split a bucket larger than this many fair shares of the outstanding work", gt=0)
    ] = 2.0
    hot_factor: Annotated[
        float, _d("prefix-aware: a prefix group whose recent work exceeds this many replicas' fair shares is "
                  "spread over as many replicas as its work needs (rendezvous-chosen; 0: never)", ge=0)
    ] = 1.0


class EngineWorkerConfig(ModelConfig, kw_only=True):
    replica: Annotated[str, _d("this replica's name (work subject pfx.work.<replica>)")] = "r0"
    engine: Annotated[EngineKind, _d("vllm: the real engine; echo: no model (tests of orchestration)")] = "vllm"
    window: Annotated[int, _d("most prompts in flight in the engine", gt=0)] = 256
    adaptive: Annotated[
        bool,
        _d("size the window from measurements: one prompt alone first (a fast first result), then twice what "
           "the engine runs at once, up to --window; off: --window from the start"),
    ] = True
    kv_events: Annotated[
        bool,
        _d("forward vLLM's KV-cache events to the router, which then routes by the blocks each replica holds "
           "(vllm engine; off: by its history of what it sent)"),
    ] = False
    first_result_seconds: Annotated[
        float, _d("the first prompt runs alone while it can finish within this many seconds (adaptive window)", gt=0)
    ] = 10.0
    kv_admission: Annotated[
        bool,
        _d("admission by KV memory: a prompt goes into the engine only while the KV cache holds the blocks of "
           "the prompts in it and its own (prompt beyond its group's shared prefix, expected output), so vLLM "
           "rarely preempts (vllm engine)"),
    ] = True
    kv_output_reserve: Annotated[
        float, _d("admission by KV memory: the share of its expected output a prompt reserves (running prompts "
                  "are on average half way through their outputs; 1: the whole)", gt=0, le=1)
    ] = 1.0
    kv_cache_blocks: Annotated[
        int, _d("cap the KV cache at this many blocks (0: as much as the memory budget allows; without "
                "--max-model-len the context is then the model's, or what the blocks hold if less)", ge=0)
    ] = 0
    hash_block_size: Annotated[int, _d("prefix-key block length in tokens (prefix groups)", gt=0)] = HASH_BLOCK_SIZE
    max_num_seqs: Annotated[int, _d("vLLM max_num_seqs (requests scheduled together)", gt=0)] = 256
    result_batch: Annotated[int, _d("results per published message", gt=0)] = 64
    result_linger: Annotated[float, _d("seconds a partial result batch may wait", gt=0)] = 0.05
    echo_delay: Annotated[float, _d("echo engine: seconds per prompt (to simulate work)", ge=0)] = 0.0
    echo_token_delay: Annotated[
        float, _d("echo engine: seconds per output token, on top of --echo-delay (work that grows with the output)", ge=0)
    ] = 0.0
    echo_start_seconds: Annotated[
        float, _d("echo engine: seconds each start takes, like a real engine loading its model (tests of start-up)", ge=0)
    ] = 0.0
    nice: Annotated[
        int, _d("lower this process's CPU priority by this much (and its engine core's): on CPU, where the "
                "engines take every core, the services beside them stay responsive (`run` on CPU: 10)",
                ge=0, le=19),
    ] = 0
    start_delay: Annotated[
        float, _d("seconds to wait before the engine starts loading, as a fleet's GPUs come up apart "
                  "(`run --stagger`; tests and benchmarks of start-up)", ge=0)
    ] = 0.0
    echo_crash_token: Annotated[
        int,
        _d("echo engine: dies like a dead vLLM engine core on every prompt holding this token id (fault tests; -1: off)", ge=-1),
    ] = -1
    echo_crash_after: Annotated[
        int, _d("echo engine: dies like a dead vLLM engine core once, after this many prompts (fault tests; 0: off)", ge=0)
    ] = 0
    max_rebuilds: Annotated[
        int, _d("engine rebuilds charged within --rebuild-window (a death while isolating a suspect prompt is "
                "not charged); one more charged death exits with code 3", ge=0)
    ] = 3
    rebuild_window: Annotated[float, _d("seconds over which engine rebuilds are counted", gt=0)] = 600.0
    rebuild_backoff: Annotated[
        float, _d("seconds before the first rebuild of a dead engine, doubled for each further one in the window", ge=0)
    ] = 1.0
    enforce_eager: Annotated[
        bool | None,
        _d("vLLM enforce_eager: no CUDA graphs (a faster start, slower decoding); default: on without a GPU, "
           "off on GPUs"),
    ] = None
    gpus: Annotated[
        str,
        _d("this replica's GPUs, an index, range or list ('3', '4-7', '0,2'): sets CUDA_VISIBLE_DEVICES, and "
           "vLLM's tensor-parallel size defaults to their number; empty: CUDA_VISIBLE_DEVICES as the "
           "environment has it (tensor parallel over all of them)"),
    ] = ""
    metrics_port_base: Annotated[
        int,
        _d("serve metrics on this port plus the first index of --gpus (one port per engine-worker of a host, "
           "whatever its number of GPUs; the systemd unit uses 9470); 0: --metrics-port", ge=0, le=65535),
    ] = 0
    status_interval: Annotated[
        float, _d("seconds between status messages (the router's view of load lags by this much)", gt=0)
    ] = 0.25
    scheduling: Annotated[
        Literal["prefix-groups", "fcfs"],
        _d("prefix-groups: vLLM priority scheduling, a job's prompts of a prefix group seen earlier first, jobs and "
           "tenants by turns (fair queuing by --priority weight); fcfs: arrival order"),
    ] = "prefix-groups"
    engine_args: Annotated[
        str,
        _d("vLLM engine arguments as for `vllm serve`, one shell-quoted string (also accepted loose after "
           "the flags or after `--`; listed below by --help); they override prefixflow's engine defaults"),
    ] = ""

    def __post_init__(self) -> None:
        _check_name("replica", self.replica)
        if self.replica.startswith("_"):
            raise ValueError(f"replica {self.replica!r}: a name starting with '_' is a service's origin of results")
        if self.gpus:
            self.gpus = ",".join(str(i) for i in gpu_ids(self.gpus))
        if self.metrics_port_base:
            first = int(self.gpus.split(",")[0]) if self.gpus else 0
            if self.metrics_port_base + first > 65535:
                raise ValueError(f"metrics_port_base {self.metrics_port_base} + GPU {first} is past port 65535")
            self.metrics_port = self.metrics_port_base + first


class SinkConfig(CommonConfig, kw_only=True):
    result_key: ResultKey = ""
    flush_rows: Annotated[int, _d("rows buffered per job before a Parquet part is written", gt=0)] = 4096
    flush_seconds: Annotated[float, _d("longest a row waits before its part is written", gt=0)] = 0.5
    fetch_batch: Annotated[int, _d("result messages fetched per pull", gt=0)] = 64
    out_root: Annotated[
        str,
        _d("where jobs may write: one local directory (a job whose out_dir resolves outside it (.., "
           "another absolute path, a symlink out) fails; default: the working directory), and, comma-separated, "
           "object store prefixes (s3://bucket/prefix/, gs://bucket/) a job's out_dir may be under"),
    ] = ""
    inputs_cache: Annotated[
        str,
        _d("local directory for the input columns the sink joins to the results (a job's files are removed "
           "when it is done; default: a new temporary directory)"),
    ] = ""
    files_uri: Annotated[
        str, _d("where the batch service's files live: an object store prefix (s3://bucket/prefix, gs://...; "
                "the api and the sink must name the same, each with its own credentials), or nothing: the NATS "
                "object store")
    ] = ""
    fail_done_puts: Annotated[
        int, _d("test hook (fault tests): the first this many done-status puts fail, to prove they are retried "
                "(0: off)", ge=0)
    ] = 0
    exit_before_done: Annotated[
        bool,
        _d("test hook (fault tests): exit (code 75) right after the last part of a sealed job is on disk, before "
           "its summary and done status; once per output root (it leaves .pfx-exit-before-done there), so the "
           "restarted sink must complete the job"),
    ] = False

class ApiConfig(CommonConfig, kw_only=True):
    host: Annotated[str, _d("address the HTTP API listens on")] = "127.0.0.1"
    port: Annotated[int, _d("port the HTTP API listens on", ge=0, le=65535)] = 8000
    api_keys: Annotated[
        str, _d("tenants and their API keys, 'tenant:key,tenant:key', for keys without ',' (keep it in a 0600 "
                "env file); none here nor in --api-keys-file: one tenant, 'default', and no key asked")
    ] = ""
    api_keys_file: Annotated[str, _d("a file of 'TENANT KEY' lines (the key: the rest of the line, any printable "
                                     "ASCII; lines starting with # are comments), read at start-up and again when "
                                     "it changes (a key removed: 401 from the next request)")] = ""
    model: Annotated[
        str, _d("the model the cluster serves, as requests name it (a request naming another is an error line); "
                "default: the locally built tiny model's path")
    ] = DEFAULT_MODEL
    served_names: Annotated[
        str, _d("other names requests may give the served model, comma separated (e.g. its hub id)")
    ] = ""
    lora_adapters: Annotated[
        str, _d("LoRA adapters the engines serve (their --lora-modules names), comma separated: a request "
                "naming one as its model runs with that adapter")
    ] = ""
    task: Annotated[
        Literal["generate", "embed"], _d("what the cluster's engines do (its batches serve the matching endpoints)")
    ] = "generate"
    files_uri: Annotated[
        str, _d("where the batch service's files live: an object store prefix (s3://bucket/prefix, gs://...; "
                "the api and the sink must name the same, each with its own credentials), or nothing: the NATS "
                "object store")
    ] = ""
    out_prefix: Annotated[
        str, _d("batch outputs go to <sink out root>/pfxapi/<this>/<tenant>/<batch id> (the batch service's jobs are pfxapi.<batch id>: their own part of the root)")
    ] = "batches"
    max_requests: Annotated[int, _d("most requests (lines) in one batch's input file, checked when the batch is "
                                    "created (OpenAI's limit: 50,000)", gt=0)] = 50_000
    max_batch_bytes: Annotated[int, _d("largest input file of a batch in bytes, checked when the batch is created "
                                       "(OpenAI's limit: 200 MB)", gt=0)] = 200 * 1024 * 1024
    max_file_bytes: Annotated[int, _d("largest file upload in bytes, refused (413) as soon as an upload passes it "
                                      "(OpenAI's limit: 512 MB)", gt=0)] = 512 * 1024 * 1024
    completion_windows: Annotated[str, _d("the completion_window values a batch may ask, comma separated (OpenAI "
                                          "serves only 24h); a batch still running at its window's end expires")] = "24h"
    quotas_file: Annotated[str, _d("a TOML file of per-tenant quotas ([tenants.NAME] stored_bytes, open_batches, "
                                   "queued_rows, concurrent_jobs; [defaults] likewise), validated at start, read "
                                   "again when it changes (docs/quotas.md)")] = ""
    quota_stored_bytes: Annotated[int, _d("default per-tenant quota: bytes of files (uploads, batch outputs) a tenant "
                                          "may hold; an upload past it is refused, 507 (0: no limit)", ge=0)] = 0
    quota_open_batches: Annotated[int, _d("default per-tenant quota: batches not in a final state; one more is "
                                          "refused, 429 (0: no limit)", ge=0)] = 0
    quota_queued_rows: Annotated[int, _d("default per-tenant quota: requests (input lines) in a tenant's open batches; "
                                         "a batch past it is refused, 429 (0: no limit)", ge=0)] = 0
    quota_concurrent_jobs: Annotated[int, _d("default per-tenant quota: batches whose job runs or is about to (open, "
                                             "not yet finalizing); one more is refused, 429 (0: no limit)", ge=0)] = 0


def gpu_ids(spec: str) -> list[int]:
    """GPU indexes from '3', '4-7', '0,2' or '0-1,4' (a systemd instance name cannot hold a comma:
    `prefixflow-engine@4-7`)."""
    ids: list[int] = []
    for part in spec.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()) or (sep and int(hi) < int(lo)):
            raise ValueError(f"gpus {spec!r}: expected indexes, ranges or lists such as 3, 4-7 or 0,2")
        ids.extend(range(int(lo), int(hi if sep else lo) + 1))
    if len(set(ids)) != len(ids):
        raise ValueError(f"gpus {spec!r} names a GPU twice")
    return ids


def _check_name(what: str, name: str) -> None:
    from prefixflow.shared.wire.subjects import name_problem

    problem = name_problem(name)
    if problem:
        raise ValueError(f"{what} {name!r} is not a valid subject token: {problem}")


C = typing.TypeVar("C", bound=msgspec.Struct)


def _field_help(cls: type) -> dict[str, tuple[str, Any]]:
    """Map field name -> (description, base type) from `Annotated[..., Meta(...)]`."""
    out: dict[str, tuple[str, Any]] = {}
    for name, hint in typing.get_type_hints(cls, include_extras=True).items():
        desc, base = "", hint
        if typing.get_origin(hint) is Annotated:
            base, *metas = typing.get_args(hint)
            desc = next((m.description for m in metas if isinstance(m, Meta) and m.description), "")
        out[name] = (desc, base)
    return out


def add_arguments(parser: argparse.ArgumentParser, cls: type[msgspec.Struct]) -> None:
    """Add one `--flag` per field of `cls` (default None: resolved in `load`)."""
    defaults = {f.name: f.default for f in msgspec.structs.fields(cls)}
    for name, (desc, base) in _field_help(cls).items():
        flag = "--" + name.replace("_", "-")
        env = ENV_PREFIX + name.upper()
        help_text = f"{desc} (env {env}; default {defaults[name]!r})"
        if typing.get_origin(base) is Literal:
            parser.add_argument(flag, dest=name, choices=typing.get_args(base), help=help_text)
        elif base in (bool, bool | None):
            parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text)
        else:
            parser.add_argument(flag, dest=name, help=help_text)


def load(cls: type[C], args: argparse.Namespace | None = None, environ: dict[str, str] | None = None) -> C:
    """Build a validated config: flags override `PFX_*` variables override defaults."""
    environ = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    for f in msgspec.structs.fields(cls):
        value = getattr(args, f.name, None) if args is not None else None
        if value is None:
            value = environ.get(ENV_PREFIX + f.name.upper())
        if value is not None:
            raw[f.name] = value
    try:
        cfg = msgspec.convert(raw, cls, strict=False)
        if isinstance(cfg, CommonConfig):
            cfg.check_connection()
        return cfg
    except (msgspec.ValidationError, ValueError) as exc:
        raise usage_error(f"invalid configuration: {exc}") from None
