"""Every message the services send each other over NATS, as `msgspec.Struct`s, in one module.

Encoding: msgpack for everything between services (compact, fast, binary-safe); JSON for
the two key-value records (`JobSpec`, `JobStatus`) so people can read and write them with
the `nats` CLI. One message type per subject, decoded with a typed decoder; the few
bodies that are no Struct are named below (a user's rows, a job id, blob pieces, empty
requests). Not here: the batch API's own records (`prefixflow/batchapi/store.py`, written and read
by it alone) and vLLM's KV events, which reach the engine-worker over ZMQ in vLLM's
format (`prefixflow/services/engine_worker/kv_events.py`).

    pfx.ingest.<job>             a user's row, or an array of rows (JSON or msgpack; `prefixflow/services/ingestor/validate.py`)
    pfx.bucket.<node>.<job>      PromptBatch
    pfx.work.<replica>           WorkBatch
    pfx.results.<origin>.<job>   ResultBatch
    pfx.status.<replica>         EngineStatus
    pfx.cache.<replica>          CacheEvents
    pfx.hb.bucketer.<node>       BucketerHeartbeat
    pfx.sink.done.<job>          DoneQuery -> DoneReply
    pfx.route                    RouteRequest -> RouteReply
    pfx.router.room              (empty) -> RouterRoom
    pfx.router.policy            SetPolicy -> ControlReply
    pfx.router.freed             (empty: an event)
    pfx.engine.<replica>.reset   (empty) -> ControlReply
    pfx.engine.<replica>.scheduling  SetScheduling -> ControlReply
    pfx.engine.<replica>.status  (empty) -> EngineStatus
    pfx.jobs.cancelled.<job>     CancelNotice (an event)
    pfx.blob.<job>.<key>.<n>     raw bytes: a piece of a blob (`prefixflow/shared/bus/blobs.py`)
    KV jobs / job-status         JobSpec / JobStatus (JSON); a jobs `dir.<hash>` key: the owning job id (text)

The control subjects (the router's route, room and policy; an engine-worker's reset,
scheduling and status) are nats.micro endpoints (`prefixflow/shared/bus/control.py`): a request that
fails (one that does not decode, an unknown policy or mode, an exception in the handler)
is answered with micro's error headers (`Nats-Service-Error`, `Nats-Service-Error-Code`)
and counted in the endpoint's stats, never in the body. The sink's done query is no
control subject: `DoneReply.error` says the sink cannot tell (the client then sends every
row), an answer the client acts on.

Schema evolution: new fields are appended with defaults and never retyped, so services of
mixed versions keep running. Wire structs are lenient: a field this version does not know
(sent by a newer peer) is ignored. User input is checked strictly where it enters, never
by the wire structs (`prefixflow/shared/wire/sampling.py`'s `user_sampling`). High-volume structs are
`array_like` (positional, no field names on the wire) and `gc=False` (they hold no
reference cycles).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import Meta

from prefixflow.shared.eta import DEFAULT_DECODE_COST, EtaModel
from prefixflow.shared.eta import Progress as EtaProgress
from prefixflow.shared.wire.fingerprint import Fingerprint
from prefixflow.shared.wire.structured import check_structured
from prefixflow.shared.wire.limits import ROW_TIMEOUT, sampling_error

# --- job control (JSON, in the key-value buckets) ------------------------------------


class StructuredSpec(msgspec.Struct, omit_defaults=True):
    """Constrained output (vLLM's `StructuredOutputsParams`, xgrammar): exactly one form.

    Checked cheaply when decoded (one form, a valid JSON Schema, a non-empty choice);
    compiled with xgrammar by the client and the ingestor (`prefixflow/shared/wire/sampling.py`).
    Lenient like every wire struct; a user's form is checked strictly (`user_sampling`)."""

    json_schema: dict[str, Any] | None = None
    """Output is JSON valid against this JSON Schema."""
    regex: str | None = None
    """Output matches this regular expression."""
    choice: list[str] | None = None
    """Output is exactly one of these strings."""
    grammar: str | None = None
    """Output follows this grammar (EBNF/GBNF, or Lark)."""
    json_object: bool = False
    """Output is some JSON object (OpenAI `response_format: {"type": "json_object"}`)."""

    def __post_init__(self) -> None:
        check_structured(self)


class SamplingSpec(msgspec.Struct, omit_defaults=True):
    """Sampling parameters for every prompt of a job (a subset of vLLM's SamplingParams).

    On the wire (a `JobSpec` in the jobs bucket, a `Prompt`'s own sampling) it is lenient
    like every wire struct: a field added by a newer peer is ignored by an older one. A
    user's parameters are checked strictly where they enter (`prefixflow/shared/wire/sampling.py`'s
    `user_sampling`: the CLI, per-row `sampling` of the batch API and of input rows): a
    misspelt parameter is an error there, as is one out of range (everywhere)."""

    max_tokens: Annotated[int, Meta(gt=0, le=1_000_000)] = 128
    """Upper bound on generated tokens per prompt."""
    min_tokens: Annotated[int, Meta(ge=0)] = 0
    """Generate at least this many tokens (EOS is suppressed until then)."""
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = -1
    """-1 (or 0) disables top-k."""
    seed: int | None = None
    """Per-request seed (the prompt's sequence number is added) for reproducible sampling."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks use it with min_tokens == max_tokens)."""

    stop: list[str] = msgspec.field(default_factory=list)
    """Stop generating at any of these strings (not included in the output); at most
    `limits.MAX_STOP` of them, each at most `limits.MAX_STOP_CHARS` characters."""
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] = 0.0
    structured: StructuredSpec | None = None
    """Constrained output (JSON schema, regex, choice, grammar); None: free text."""
    n: Annotated[int, Meta(ge=1, le=64)] = 1
    """Completions per prompt: with n > 1 the row's `outputs` column lists them all
    (`output` is the first)."""
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    """Log-probabilities of each generated token of the first completion and of this many
    alternatives (the row's `logprobs` column); None: none."""

    def __post_init__(self) -> None:
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be <= max_tokens")
        if (why := sampling_error(self.stop)) is not None:  # docs/limits.md
            raise ValueError(why)


MAX_PRIORITY = 100
"""The largest job weight (`JobSpec.priority`): bounds how far one job can crowd out others."""


class JobSpec(msgspec.Struct, omit_defaults=True):
    """A job: what to run and where to write it. Created by the client before it
    publishes prompts; `total` is set when the job is sealed (all prompts published)."""

    job: str
    out_dir: str
    """Directory the sink writes `part-*.parquet` and `_summary.json` into."""
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    model: str = ""
    """The model the client expects; informational (the cluster serves one model)."""
    created_at: float = 0.0
    """Unix time the job was (last) submitted; the summary's wall time starts here."""
    total: int | None = None
    """Number of distinct prompt ids once sealed; None while prompts are still coming."""
    chat_template: str = ""
    """Chat template (Jinja text) for `messages` rows; empty: the model's own."""
    chat_template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    """Extra variables for the chat template (as vLLM's `chat_template_kwargs`)."""
    task: str = "generate"
    """generate (text) or embed (vectors); a cluster runs one task and fails jobs of the other."""
    overwrite: bool = False
    """`out_dir` may be bound to another job (its manifest `_job.json`): the sink deletes
    that job's output and binds the directory to this one. Without it, such a job fails."""
    cancelled_at: float = 0.0
    """Unix time the job was cancelled (`prefixflow cancel`; 0: not cancelled). The cluster
    stops feeding it: the ingestor drops its prompts, engine-workers skip the ones not
    started; the sink keeps the rows written and, once none has come for a few seconds,
    completes it as cancelled."""
    deliver: str = ""
    """"openai-batch": when the job completes, the sink also stores its rows as OpenAI
    Batch result lines in the files object store (`prefixflow/services/sink/export.py`)."""
    expires_at: float = 0.0
    """Unix time after which the cluster stops feeding the job as it does a cancelled one
    (0: never; the OpenAI Batch API's `completion_window`): it completes as expired."""
    priority: int = 1
    """Weight of the job's share of the replicas while other jobs run too (`--priority`, a
    batch's `metadata.priority`): a job of priority 3 gets three times the engine work of
    a job of priority 1. Within a job, prefix affinity is kept."""
    cancelled_by: str = ""
    """Who cancelled the job (with `cancelled_at`): the canceller's NATS user (`tenant-alice`,
    `submitter`; `api:<tenant>` for the batch service's), or `local:<os user>` without auth."""
    fingerprint: Fingerprint | None = None
    """What the job was asked to do: its input's and its spec's fingerprint
    (`prefixflow/shared/wire/fingerprint.py`), set by the client. The sink writes it into the
    directory's manifest (`_job.json`); another input or spec into the same output is
    refused unless `overwrite`. None: a spec from before fingerprints (unknown)."""
    row_timeout: Annotated[float, Meta(ge=0)] = ROW_TIMEOUT
    """Seconds a row may take from its first admission to an engine (`Prompt.admitted_at`)
    until it is finished (`--row-timeout`; 0: no deadline): the engine-worker then aborts
    it and writes its error row (`limits.timeout_error`). Time queued before an engine
    takes the row does not count."""
    dedupe: bool = True
    """Generate identical requests once (`--no-dedupe`: False): rows of the job with the
    same model input and sampling share one request in an engine-worker
    (`prefixflow/services/engine_worker/dedupe.py`): deterministic ones get a copy of its
    completion, sampled ones one completion each of a request with `n` = their count."""
    planned_output_tokens: int = 0
    """Output tokens the job was asked for at most: every row's `max_tokens` (its own or
    the job's), summed by the client as it publishes and set with `total` when it seals
    the job (0: unknown). The ETA's model of the remaining work (`prefixflow/shared/eta.py`)."""

    def ended_at(self, now: float) -> float:
        """When the cluster stopped feeding this job: `cancelled_at`, or `expires_at` once
        passed (whichever came first); 0 while it runs."""
        times = [t for t in (self.cancelled_at, self.expires_at) if t and t <= now]
        return min(times) if times else 0.0

    def expired(self, now: float) -> bool:
        """Its deadline ended it (before any cancel)."""
        ended = self.ended_at(now)
        return bool(ended) and ended == self.expires_at


class DoneQuery(msgspec.Struct):
    """Which of these ids of a job are on disk already? (`subjects.done_query(job)`, asked
    of the sink by a client that resumes a job: it sends only the missing rows)."""

    ids: list[int | str]


class DoneReply(msgspec.Struct, omit_defaults=True):
    """The sink's answer to a `DoneQuery`: `done[i]` for `ids[i]`; `error` when the sink
    cannot tell (then the client sends every row; the sink drops duplicates)."""

    done: list[bool] = msgspec.field(default_factory=list)
    error: str | None = None
    on_disk: int = -1
    """Rows of the job on disk when the sink answered (-1: not said). 0 tells a client
    that nothing of the job was written before: it need not ask about later chunks."""


class JobLookup(msgspec.Struct):
    """A job as a service finds it in the jobs bucket: its spec, or why it cannot run."""

    spec: JobSpec | None
    error: str | None = None
    """Why the job cannot run: unknown job, or a spec that fails validation (for example
    bad sampling parameters)."""
    exists: bool = True
    """False for a job that was never created (its prompts go to the dead-letter stream;
    a job that exists but cannot run is marked failed instead)."""


class StepModel(msgspec.Struct, array_like=True, gc=False):
    """How fast an engine goes, measured from its steps (`prefixflow/services/engine_worker/cost_fit.py`,
    `StepFit`) and its limits: a step takes `s0` + `prompt_s` x prompt tokens it computes +
    `output_s` x tokens it generates (one per running request); a step computes at most
    `batch_tokens` prompt tokens (vLLM's `max_num_batched_tokens`), runs at most `slots`
    requests (vLLM's `max_num_seqs`, at most the worker's window) and holds at most
    `kv_tokens` tokens in its KV cache (0: not known). The ETA's engine model
    (`prefixflow/shared/eta.py`)."""

    s0: float = 0.0
    prompt_s: float = 0.0
    output_s: float = 0.0
    batch_tokens: int = 0
    slots: int = 0
    kv_tokens: int = 0

    def valid(self) -> bool:
        """Every number finite, non-negative and within what an engine can report (a
        message is not trusted), a step costing something, and some slots."""
        times = (self.s0, self.prompt_s, self.output_s)
        return (all(isinstance(x, float | int) and 0 <= x < 60 for x in times) and self.prompt_s + self.output_s > 0
                and 0 < self.slots <= 1 << 20 and 0 <= self.batch_tokens <= 1 << 30 and 0 <= self.kv_tokens <= 1 << 40)


class JobStatus(msgspec.Struct, omit_defaults=True):
    """Progress of a job as the sink sees it (rows durably written to Parquet)."""

    job: str
    rows: int = 0
    errors: int = 0
    total: int | None = None
    done: bool = False
    updated_at: float = 0.0
    summary: dict[str, Any] | None = None
    """The job's `_summary.json`, once done (so clients on other machines can read it)."""
    failed: bool = False
    """The cluster cannot run this job (invalid spec, model or task mismatch); see `error`."""
    error: str | None = None
    """Why the job failed."""
    created_at: float = 0.0
    """When the job was (last) submitted (its spec's `created_at`), Unix time."""
    rate: float = 0.0
    """Rows written per second over the last half minute or so."""
    prompt_tokens: int = 0
    """Prompt tokens of the ok rows written so far."""
    cached_tokens: int = 0
    """Prefix-cache hit tokens of the ok rows written so far."""
    output_tokens: int = 0
    """Generated tokens of the ok rows written so far."""
    expires_at: float = 0.0
    """Unix time after which the job's spec and status are gone from the cluster (the
    buckets' retention; 0: unknown). Its output files stay."""
    cancelled: bool = False
    """The job was cancelled (or expired: `summary["expired"]`) before every row was
    written; with `done`, the rows written are final."""
    duplicates: int = 0
    """Rows the sink received again and dropped (already written), since it opened the
    job (a restarted sink counts from 0): with `rows`, how much of what was sent arrived."""
    paused: str | None = None
    """Why the job is paused, None while it is not: its output lacks a resource (disk full,
    quota, read-only file system, no permission; `prefixflow/services/sink/pause.py`). Not a
    failure: its results wait in JetStream and it resumes by itself once the sink can
    write again."""
    paused_path: str | None = None
    """The directory whose file system lacks it (the job's output directory)."""
    planned_output_tokens: int = 0
    """The job's output budget (`JobSpec.planned_output_tokens`; 0: unknown)."""
    uncached_rate: float = 0.0
    """Uncached prompt tokens of rows written per second, over the same window as `rate`."""
    output_rate: float = 0.0
    """Output tokens of rows written per second, over the same window as `rate`."""
    decode_cost: float = 0.0
    """What an output token of this job costs its engines in uncached prompt tokens: the
    mean over the replicas that wrote its rows of what each measured last
    (`ResultBatch.decode_cost`; 0: none measured). The ETA weighs output tokens by it."""
    step: StepModel | None = None
    """How fast the job's engines go (the mean over the replicas that wrote its rows of
    what each reported last, `ResultBatch.step`; None: no engine measured it, e.g. echo).
    The ETA's engine model."""
    replicas: int = 0
    """Replicas whose `step` the mean is over."""

    @property
    def hit_rate(self) -> float:
        """Prefix-cache hit rate so far (cached / prompt tokens of the ok rows)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def eta_seconds(self, decode_cost: float | None = None) -> float | None:
        """Seconds until every row is written, by the model of the remaining work
        (`prefixflow/shared/eta.py`: remaining rows' tokens / the token rate, an output token
        at `decode_cost` prompt tokens: the one given, else the job's engines' measured one,
        else the router's default), else at the current rows/s;
        None while the total is unknown (not sealed) or nothing is being written; 0 once done."""
        if self.done:
            return 0.0
        progress = self.eta_progress()
        return self.eta_model(decode_cost).eta_seconds(progress)

    def eta_progress(self) -> EtaProgress:
        return EtaProgress(self.rows, self.total, self.prompt_tokens, self.cached_tokens, self.output_tokens,
                           self.planned_output_tokens, self.rate, self.uncached_rate, self.output_rate)

    def eta_model(self, decode_cost: float | None = None) -> EtaModel:
        return EtaModel(decode_cost or self.decode_cost or DEFAULT_DECODE_COST, self.step, self.replicas)


# --- data plane (msgpack) ------------------------------------------------------------

PromptId = int | str
"""A prompt's id as the user gave it (`id` column); the sink dedupes on (job, id)."""

SRC_FIELD = "_pfx_src"
"""Ingest-message field: the job's blob (`in-<src>`) that holds the row's input columns
(`prefixflow/client/columns.py` writes it; rows published without one keep their extra fields in a
blob the ingestor writes)."""
ROW_FIELD = "_pfx_row"
"""Ingest-message field: the row's index in that blob's record batch."""
LORA_FIELD = "lora"
"""Row column naming the row's LoRA adapter (an OpenAI batch line's `model` becomes it);
empty, null or the base model's name: no adapter."""
INGEST_SRC_BASE = 1 << 48
"""Blob numbers the ingestor uses for the extra fields of rows published without a
reference (this plus a number of the batch's messages, `services/ingestor/plan.py`
`batch_src`, below 2^56): never a client's chunk number."""


def input_blob(src: int) -> str:
    """Blob key of the input columns of chunk `src` of a job."""
    return f"in-{src}"


class Prompt(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One validated, tokenized prompt on its way to an engine."""

    job: str
    id: PromptId
    tokens: bytes
    """Token ids, packed big-endian uint32 (`prefixflow.shared.prefix.tokens`): compact, and byte order is
    token order."""
    columns: bytes = b""
    """Unused since input columns stay out of the pipeline (`src`, `row`); kept so that
    older peers still decode this struct (a rolling upgrade)."""
    max_tokens: int = 0
    """The row's output budget: its max_tokens times its `n` (every completion it asks
    for), so load can be counted in tokens (prompt + output)."""
    sampling: bytes = b""
    """The row's own sampling (msgpack `SamplingSpec`, the job's merged with the row's
    overrides and structured output); empty: the job's."""
    src: int = -1
    """Where the row's input columns are kept: blob `in-<src>` of the job
    (`prefixflow/client/columns.py`); -1: the row has none. Only model inputs travel."""
    row: int = -1
    """The row's index in that blob's record batch."""
    cost: int = 0
    """Its share of what the router charged the replica for its work batch, in engine cost
    (uncached prompt tokens, output tokens at their measured cost: `Fleet.charge`); set
    by the bucketer from the route reply. The worker reports it done in that unit. 0: not
    charged (`work_tokens` stands in)."""
    lora: str = ""
    """The LoRA adapter the row asked for (its `lora` column, or an OpenAI batch line's
    `model`); empty: the base model. Its prefix keys are the adapter's own
    (`block_keys.block_hashes`); an engine without that adapter answers an error row."""
    admitted_at: float = 0.0
    """Unix time an engine first took the row (0: none yet). Set by the engine-worker when
    it submits the row, so a row it re-publishes after its engine died keeps its deadline
    (`JobSpec.row_timeout`); a work message redelivered by JetStream (the worker process
    died) carries none, and the deadline starts again (docs/limits.md)."""
    grant: bytes = b""
    """Proof that the replica it was routed to holds its assignment (HMAC of job, id and
    replica: `prefixflow/shared/wire/provenance.py`); set by the bucketer when it sends the
    prompt to a replica, by the router when it moves it to another; the replica copies it
    into its result. Empty: no key on this cluster."""

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def work_tokens(self) -> int:
        """Its size in tokens: prompt tokens plus output budget (the bucketer's unit)."""
        return self.prompt_tokens + self.max_tokens

    @property
    def load(self) -> int:
        """What it weighs on its replica, in the router's unit: its charged cost."""
        return self.cost or self.prompt_tokens + self.max_tokens


def cost_shares(cost: int, weights: list[int]) -> list[int]:
    """`cost` shared out in proportion to `weights`: one each, the rest by weight, the last
    taking the rounding (they add up to `cost` when it is at least one each)."""
    n = len(weights)
    total = sum(weights) or n
    rest = max(cost - n, 0)
    shares = [1 + rest * w // total for w in weights]
    if shares:
        shares[-1] += rest - sum(shares) + n
    return shares


def charge_prompts(prompts: list[Prompt], cost: int) -> None:
    """Share what the router charged for `prompts` (`Assignment.cost`) out over them by
    work tokens (`cost_shares`): each carries its share (`Prompt.cost`) to the replica,
    which reports it done in that unit. A cost of 0 (not told) leaves them uncharged."""
    if cost <= 0:
        return
    for p, share in zip(prompts, cost_shares(cost, [p.work_tokens for p in prompts]), strict=True):
        p.cost = share


MAX_PROMPTS_PER_MESSAGE = 512
"""Most prompts the ingestor puts in one `PromptBatch` (bytes are bounded apart)."""


class PromptBatch(msgspec.Struct, array_like=True, gc=False):
    """ingestor -> bucketer (`pfx.bucket.<node>.<job>`): prompts of one job."""

    prompts: list[Prompt]
    priority: int = 1
    """The job's weight (`JobSpec.priority`): the bucketer shares the replicas between jobs
    in proportion to it."""


class WorkBatch(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """bucketer -> engine-worker (`pfx.work.<replica>`): one bucket, or part of one."""

    bucket: str
    """Unique bucket id (for logs and dedupe of redeliveries in metrics)."""
    prompts: list[Prompt]
    key: list[int] = msgspec.field(default_factory=list)
    """Block-hash chain of the bucket's common token prefix (empty: mixed batch)."""
    strikes: list[int] = msgspec.field(default_factory=list)
    """Set on a suspect batch (prompts that were in flight when an engine died, re-published
    by the engine-worker to its own work subject: `prefixflow/services/engine_worker/isolate.py`): per
    prompt, how often the engine died while that prompt ran alone in it. A suspect batch
    runs alone in its engine. Empty: an ordinary batch."""


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3


class Result(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """One output row: a completion, or an error row (`error` set)."""

    id: PromptId
    columns: bytes = b""
    output: str = ""
    finish_reason: FinishReason = FinishReason.STOP
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    replica: str = ""
    error: str | None = None
    bucket: str = ""
    """Id of the bucket the prompt was released in (`WorkBatch.bucket`; empty: unknown)."""
    started_at: float = 0.0
    """Unix time the engine-worker submitted the prompt to its engine (0: unknown)."""
    finished_at: float = 0.0
    """Unix time the engine finished it (0: unknown; the sink then takes the time the
    result reached the results stream)."""
    outputs: list[str] = msgspec.field(default_factory=list)
    """Every completion when the prompt asked for n > 1 (`output` is the first)."""
    logprobs: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """With `logprobs`: per generated token of the first completion, `{"token",
    "logprob", "top": [{"token", "logprob"}, ...]}`."""
    embedding: list[float] = msgspec.field(default_factory=list)
    """Embed jobs: the prompt's embedding (vLLM's pooler output)."""
    src: int = -1
    """The prompt's `Prompt.src`: the blob holding its input columns (-1: none)."""
    row: int = -1
    """The prompt's `Prompt.row` in that blob."""
    blob: str = ""
    """Set on a stand-in for a result too large for one message: the key of the job's
    blob (`prefixflow/shared/bus/blobs.py`) holding the whole `Result`, msgpack (the engine-worker's
    outbox writes it, the sink reads it back: `prefixflow/services/sink/large.py`). Empty: this is
    the result."""
    dedupe: int = 0
    """How the row got its completion (`prefixflow/services/engine_worker/dedupe.py`'s
    `Kind`): 0 its own request; 1 a copy of an identical deterministic row's; 2 its own
    completion of a request merged (`n`) with identical sampled rows."""
    grant: bytes = b""
    """The prompt's `Prompt.grant`, copied by the replica that answers it (the sink checks
    it against the subject's origin: `prefixflow/shared/wire/provenance.py`)."""


def error_result(
    id: PromptId, error: str, *, prompt_tokens: int = 0, replica: str = "", bucket: str = "", src: int = -1, row: int = -1,
    grant: bytes = b"",
) -> Result:
    """The error row of a prompt (the one way every stage builds one); `src`, `row`: where
    its input columns are kept (the sink joins them to the row)."""
    return Result(
        id, error=error, finish_reason=FinishReason.ERROR, prompt_tokens=prompt_tokens, replica=replica, bucket=bucket,
        src=src, row=row, grant=grant,
    )


class ResultBatch(msgspec.Struct, array_like=True, gc=False):
    """engine-worker / ingestor, bucketer (error rows) -> sink (`pfx.results.<origin>.<job>`)."""

    job: str
    results: list[Result]
    decode_cost: float = 0.0
    """The producing engine's measured cost of an output token in uncached prompt tokens
    (`EngineStats.decode_cost`; 0: not measured, or not from an engine). The sink puts
    the job's into its status, for the ETA. (Trailing and optional: a peer one version
    apart decodes the batch either way.)"""
    step: StepModel | None = None
    """How fast the producing engine goes (`StepModel`; None: not measured, or not from an
    engine). The sink puts the job's into its status, for the ETA. (Trailing, optional.)"""


OLDEST_IDS = 5
"""Ids per job in `EngineStatus.oldest` (bounds the status message)."""


class InEngine(msgspec.Struct, array_like=True):
    """A job's rows in one engine, as its status reports them (`EngineStatus.oldest`)."""

    job: str
    count: int
    """The job's rows in the engine now."""
    ids: list[PromptId]
    """The first `OLDEST_IDS` of them by admission, oldest first."""
    admitted_at: float
    """Unix time the oldest was first admitted to an engine (`Prompt.admitted_at`)."""


class EngineStatus(msgspec.Struct, omit_defaults=True):
    """engine-worker -> router (`pfx.status.<replica>`), every second, core NATS."""

    replica: str
    ts: float
    ready: bool = False
    running: int = 0
    """Requests vLLM is running."""
    waiting: int = 0
    """Requests queued inside vLLM."""
    inflight: int = 0
    """Prompts submitted to the engine and not finished."""
    outstanding_tokens: int = 0
    """Load of the prompts held here (`Prompt.load`: their charged engine cost)."""
    kv_usage: float = 0.0
    kv_blocks: int = 0
    """KV-cache capacity in blocks."""
    block_size: int = 0
    prompt_tokens: int = 0
    """Cumulative prompt tokens of finished requests."""
    cached_tokens: int = 0
    """Cumulative prefix-cache hit tokens (vLLM's num_cached_tokens)."""
    completed: int = 0
    """Cumulative finished prompts."""
    done_tokens: int = 0
    """Cumulative load (`Prompt.load`) of finished prompts: the router subtracts it from
    what it charged here."""
    window: int = 0
    """Most prompts the worker keeps in flight."""
    idle_seconds: float = 0.0
    """Cumulative time with no prompt in the engine."""
    output_tokens: int = 0
    """Cumulative generated tokens of finished prompts."""
    generated_tokens: int = 0
    """Cumulative generated tokens, prompts in flight included (progress before a row is done)."""
    jobs: dict[str, int] = {}
    """Prompts held here per job (in the engine or waiting for its window)."""
    cache_epoch: str = ""
    """Changes whenever the engine's prefix cache starts empty (a new worker, a rebuilt
    engine, a reset): what the router remembers routing here is gone."""
    decode_cost: float = 0.0
    """What an output token costs the engine, in uncached prompt tokens (measured from its
    steps: `prefixflow/services/engine_worker/cost_fit.py`; 0: not measured yet)."""
    preemptions: int = 0
    """Cumulative requests vLLM preempted (out of KV cache; each is recomputed)."""
    adapters: list[str] = []
    """The LoRA adapters this replica serves (`--lora-modules`); empty: none."""
    lora_slots: int = 0
    """How many adapters its engine runs at once (vLLM's `--max-loras`; 0: no LoRA)."""
    loras: dict[str, int] = {}
    """Prompts held here per adapter (in the engine or waiting for its window)."""
    oldest: list[InEngine] = []
    """Per job with rows in the engine: its rows that have been there longest (what
    `prefixflow status` names when a job waits on its last rows)."""
    deduplicated: int = 0
    """Cumulative rows given a copy of an identical deterministic request's completion
    (`prefixflow/services/engine_worker/dedupe.py`): generated once, not again."""
    merged: int = 0
    """Cumulative rows that took their completion from an identical sampled request
    merged into one with `n` completions (its leader not counted)."""


class BucketerHeartbeat(msgspec.Struct, omit_defaults=True):
    """bucketer -> ingestors (`pfx.hb.bucketer.<node>`), every second, core NATS."""

    node: str
    ts: float
    buffered: int = 0


class CancelNotice(msgspec.Struct, omit_defaults=True):
    """`prefixflow cancel` or the batch service -> the services and the job's submitter
    (`pfx.jobs.cancelled.<job>`, core NATS): the job's spec was just marked cancelled.
    Only a hint: a receiver reads the spec again and acts on what it says (a notice the
    spec does not confirm is ignored). Who may send one for a job is the grants' business:
    the subject names the job, tenant included."""

    job: str
    by: str = ""
    """Who cancelled (`JobSpec.cancelled_by`)."""
    at: float = 0.0
    """When (`JobSpec.cancelled_at`)."""


class RoutePart(msgspec.Struct, array_like=True):
    """One small bucket inside a pooled batch."""

    prompts: int
    tokens: int
    key: list[int] = msgspec.field(default_factory=list)
    output: int = -1
    """Of `tokens`, output budget (sum of max_tokens); -1: not told (charged as tokens)."""
    lora: str = ""
    """The part's LoRA adapter (empty: the base model)."""


class RouteRequest(msgspec.Struct, omit_defaults=True):
    """bucketer -> router (`pfx.route`): where should this bucket go?"""

    bucketer: str
    prompts: int
    tokens: int
    """Work tokens (prompt + max_tokens) of all its prompts."""
    key: list[int] = msgspec.field(default_factory=list)
    """Block-hash chain of the bucket's common prefix; empty for a pooled batch."""
    parts: list[RoutePart] = msgspec.field(default_factory=list)
    """A pooled batch's small buckets, in prompt order (their prompts sum to `prompts`)."""
    bucket: str = ""
    """The bucket's id: a request asked again (its reply lost) gets the first answer, its
    work is not counted twice."""
    output: int = -1
    """Of `tokens`, output budget (sum of max_tokens); -1: not told (charged as tokens)."""
    lora: str = ""
    """The bucket's LoRA adapter (empty: the base model; a pooled batch tells it per part)."""


class Assignment(msgspec.Struct, array_like=True):
    replica: str
    """Where these prompts go; empty: nowhere now (the replicas have no room for them:
    the bucketer puts them back in its buffer)."""
    prompts: int
    cost: int = 0
    """What the router charged the replica for these prompts (engine cost: `Fleet.charge`);
    the bucketer shares it out over them (`Prompt.cost`). 0: not told."""


class RouteReply(msgspec.Struct, omit_defaults=True):
    """router -> bucketer. Either assignments covering every prompt of the bucket, in
    order (some of them, past what the chosen replicas have room for, to no replica: kept
    by the bucketer for later), or `retry_after` seconds when every live replica is at its
    cap. A request the router fails on is a nats.micro error reply instead (no body)."""

    assignments: list[Assignment] = msgspec.field(default_factory=list)
    retry_after: float = 0.0
    error: str | None = None
    """Set only by older routers (with `retry_after`), which answered a failure in-band;
    kept so that a bucketer still decodes and logs their replies (a rolling upgrade)."""


class RouterRoom(msgspec.Struct, omit_defaults=True):
    """router -> bucketer: free capacity of the fleet, in work tokens (-1: unbounded).
    `eager` False (the `daft` policy): no early release; the bucketer follows the
    reference's rules (a bucket at its size, over the buffer's limit, at end of input)."""

    tokens: int = 0
    live: int = 0
    eager: bool = True


router_room_decoder = msgspec.msgpack.Decoder(RouterRoom)


class CacheOp(enum.IntEnum):
    """What happened to a replica's cached prefix blocks (`CacheEvents.ops`)."""

    STORED = 0
    """The blocks are now held (one prefix's run, shallowest first)."""
    REMOVED = 1
    """The blocks are no longer held."""
    CLEARED = 2
    """Nothing is held (the cache was reset, or the engine was rebuilt); no blocks."""


class CacheEvents(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """engine-worker -> router (`pfx.cache.<replica>`, core NATS), a few times a second
    while the engine works: what its KV cache gained and lost, in prefix block keys
    (`block_keys.block_hashes` chain hashes), translated from vLLM's KV events
    (`prefixflow/services/engine_worker/kv_events.py`). The router's precise cache model
    (`prefixflow/services/router/block_index.py`) applies the ops in order."""

    replica: str
    epoch: str
    """The sender's lifetime (a new worker process starts a new one): the router forgets
    what it knew of the replica when it changes."""
    seq: int
    """Batch number within the epoch, from 0: a jump means batches were lost."""
    ops: list[tuple[CacheOp, list[int]]]
    ts: float = 0.0
    """When it was sent (Unix time)."""


# --- control (request/reply, msgpack; nats.micro endpoints) -------------------------


class Control(msgspec.Struct, tag_field="kind", omit_defaults=True):
    """A control request or reply: tagged (`kind`), so a later type can share a subject."""


class SetPolicy(Control, tag="policy"):
    """operator -> router (`pfx.router.policy`): route with this policy from now on."""

    name: str
    """A policy name (`prefixflow/services/router/policies.py`); an unknown one is a 400 error reply."""


class SetScheduling(Control, tag="scheduling"):
    """operator -> engine-worker (`pfx.engine.<replica>.scheduling`): how it orders prompts."""

    mode: str
    """`prefix-groups` or `fcfs`; anything else is a 400 error reply."""


class ControlReply(Control, tag="reply"):
    """The answer of `pfx.router.policy`, `pfx.engine.<replica>.scheduling` and
    `pfx.engine.<replica>.reset`. A failure is never this: it is a nats.micro error reply.
    `ok` False is a state the caller waits out and asks again (a reset refused while
    requests run), not an error."""

    ok: bool
    """Done (the cache is empty, the mode or policy is set)."""
    detail: str = ""
    """Why not yet (`busy`: requests are running; `not ready`: the engine is being
    rebuilt), or the value now in effect."""


# --- batching -----------------------------------------------------------------------

MAX_MESSAGE_BYTES = 512 * 1024
"""Byte budget of a batch where no connection is at hand to ask (`prefixflow/client/submit.py`'s
ingest messages). Services cut by the server's own limit instead
(`prefixflow.shared.bus.publish.message_limit`: `nc.max_payload` less headroom)."""

ARRAY_HEADER_GROWTH = 4
"""Bytes an empty msgpack array's header (fixarray, 1 byte) can grow by once it holds
items (array32, 5 bytes)."""


def encoded_size(msg: Any) -> int:
    """Bytes of `msg` as msgpack (what goes on the wire)."""
    return len(msgpack_encoder.encode(msg))


def prompt_fits(p: Prompt, max_bytes: int, hash_block_size: int) -> bool:
    """Whether `p` alone fits a message of `max_bytes` everywhere it travels: in a
    `PromptBatch`, and in a `WorkBatch` with a bucket id and the longest key its bucket
    can have (a 64-bit hash per full block of it). An upper bound, without encoding."""
    ident = len(p.id.encode()) if isinstance(p.id, str) else 0
    own = len(p.job.encode()) + ident + len(p.tokens) + len(p.columns) + len(p.sampling) + len(p.lora.encode()) + 64
    key = 9 * (p.prompt_tokens // hash_block_size)
    return own + key + 64 <= max_bytes


def envelope_size(wrap: Callable[[list], msgspec.Struct]) -> int:
    """Most bytes `wrap(items)` adds around its items' own encodings (job, bucket id,
    key, the list's header), whatever their number."""
    return encoded_size(wrap([])) + ARRAY_HEADER_GROWTH


def runs_by_size(sizes: Sequence[int], budget: int, max_items: int) -> list[range]:
    """Consecutive index runs, in order, covering every item: each of at most `max_items`
    items whose sizes sum to at most `budget`. An item over `budget` on its own gets a run
    to itself (the caller decides what to do with it: `Batch.oversized`)."""
    out: list[range] = []
    start = used = 0
    for i, size in enumerate(sizes):
        if i > start and (i - start >= max_items or used + size > budget):
            out.append(range(start, i))
            start, used = i, 0
        used += size
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out


class Batch(NamedTuple):
    """One message of `encode_batches`: items `[start, stop)` and their encoded batch."""

    start: int
    stop: int
    data: bytes
    oversized: bool
    """A single item that does not fit `max_bytes` even alone (`data` is over it)."""


def encode_batches(
    items: Sequence[Any], wrap: Callable[[list], msgspec.Struct], max_bytes: int, max_items: int
) -> list[Batch]:
    """`items` as batch messages `wrap(run)`, each at most `max_items` items and
    `max_bytes` bytes of msgpack (exactly: every item is encoded once, its real size
    counted, and its bytes spliced into the batch as `msgspec.Raw`). An item too large on
    its own comes alone, `oversized`."""
    encoded = [msgpack_encoder.encode(item) for item in items]
    envelope = envelope_size(wrap)
    out = []
    for run in runs_by_size([len(e) for e in encoded], max_bytes - envelope, max_items):
        data = msgpack_encoder.encode(wrap([msgspec.Raw(e) for e in encoded[run.start : run.stop]]))
        out.append(Batch(run.start, run.stop, data, len(data) > max_bytes))
    return out


def chunked(items: list, size_of, max_items: int, max_bytes: int = MAX_MESSAGE_BYTES) -> list[list]:
    """Split `items` into runs of at most `max_items` and at most `max_bytes` by
    `size_of` each (an item over `max_bytes` alone in its run)."""
    return [items[r.start : r.stop] for r in runs_by_size([size_of(i) for i in items], max_bytes, max_items)]


# --- codecs --------------------------------------------------------------------------

msgpack_encoder = msgspec.msgpack.Encoder()
json_encoder = msgspec.json.Encoder()

prompt_batch_decoder = msgspec.msgpack.Decoder(PromptBatch)
work_batch_decoder = msgspec.msgpack.Decoder(WorkBatch)
result_batch_decoder = msgspec.msgpack.Decoder(ResultBatch)
engine_status_decoder = msgspec.msgpack.Decoder(EngineStatus)
heartbeat_decoder = msgspec.msgpack.Decoder(BucketerHeartbeat)
cancel_notice_decoder = msgspec.msgpack.Decoder(CancelNotice)
route_request_decoder = msgspec.msgpack.Decoder(RouteRequest)
route_reply_decoder = msgspec.msgpack.Decoder(RouteReply)
job_spec_decoder = msgspec.json.Decoder(JobSpec)
sampling_decoder = msgspec.msgpack.Decoder(SamplingSpec)
job_status_decoder = msgspec.json.Decoder(JobStatus)
columns_decoder = msgspec.msgpack.Decoder(dict[str, Any])
cache_events_decoder = msgspec.msgpack.Decoder(CacheEvents)
set_policy_decoder = msgspec.msgpack.Decoder(SetPolicy)
set_scheduling_decoder = msgspec.msgpack.Decoder(SetScheduling)
control_reply_decoder = msgspec.msgpack.Decoder(ControlReply)


def encode(msg: msgspec.Struct) -> bytes:
    return msgpack_encoder.encode(msg)


def encode_json(msg: msgspec.Struct) -> bytes:
    return json_encoder.encode(msg)
