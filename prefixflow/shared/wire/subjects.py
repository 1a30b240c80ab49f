"""Every NATS subject, stream, consumer and key-value bucket name, and their limits.

This is the only module that spells a subject. Services call the helpers here instead of
formatting strings themselves, so renaming a subject is a one-line change.

A job id is a name (`nightly`), or on a fleet with tenants `<tenant>.<name>`
(`alice.nightly`): the tenant is a subject token of its own in every subject and a key
segment in every key-value key of the job, so a tenant's NATS grant can name exactly
its own (`prefixflow/shared/wire/permissions.py`, role `tenant`). Stream subjects and consumer
filters therefore end in `>` where a job id goes.

Flow (see docs/architecture.md):

    pfx.ingest.<job>     users / `prefixflow submit`   -> ingestor
    pfx.bucket.<node>.<job> ingestor                   -> bucketer on <node> (one consumer per job)
    pfx.route            bucketer (request/reply)      -> router
    pfx.work.<replica>   bucketer                      -> engine-worker <replica>
    pfx.results.<origin>.<job> engine <origin>, ingestor/bucketer (error rows) -> sink
                         (origin: the replica, or `_ingestor`/`_bucketer`: provenance.py)
    pfx.status.<replica> engine-worker (every second)  -> router, CLI
    pfx.cache.<replica>  engine-worker (KV events)     -> router
    pfx.hb.bucketer.<n>  bucketer (every second)       -> ingestor (live bucketers)
    pfx.jobs.cancelled.<job> `prefixflow cancel`, API  -> services, the job's submitter
"""

from __future__ import annotations

import msgspec

PREFIX = "pfx"

# --- subjects ------------------------------------------------------------------------


def ingest(job: str) -> str:
    return f"{PREFIX}.ingest.{job}"


def bucket(node: str, job: str) -> str:
    """A job's prompts for one node's bucketer: one subject per (node, job), so the
    bucketer pulls each job on its own (fair sharing, `prefixflow/services/bucketer/lanes.py`)."""
    return f"{PREFIX}.bucket.{node}.{job}"


def node_bucket(node: str) -> str:
    """Every job's prompts for `node` (a filter: stream info, not a consumer)."""
    return f"{PREFIX}.bucket.{node}.>"


def bucket_parts(subject: str) -> tuple[str, str] | None:
    """(node, job) of a bucket subject; None for any other subject."""
    parts = subject.split(".")
    if len(parts) not in (4, 5) or parts[:2] != [PREFIX, "bucket"] or not all(parts[2:]):
        return None
    return parts[2], ".".join(parts[3:])


def work(replica: str) -> str:
    return f"{PREFIX}.work.{replica}"


def results(origin: str, job: str) -> str:
    """Results of `job` from `origin`: the replica that computed them, or the service
    that wrote them as error rows (`prefixflow/shared/wire/provenance.py`). Each process may
    publish under its own origin only (its grant)."""
    return f"{PREFIX}.results.{origin}.{job}"


ORIGIN_INGESTOR = "_ingestor"
ORIGIN_BUCKETER = "_bucketer"
SERVICE_ORIGINS = frozenset({ORIGIN_INGESTOR, ORIGIN_BUCKETER})
"""Origins of the services' results (error rows); a replica's name never starts with '_'."""
ANY_ORIGIN = "*"
"""`results(ANY_ORIGIN, job)`: a job's results from every origin (a subscription)."""


def origin_and_job(subject: str) -> tuple[str, str]:
    """The origin and the job id of a `results` subject ('' for a token it lacks)."""
    parts = subject.split(".", 3)
    return (parts[2] if len(parts) > 2 else "", parts[3] if len(parts) > 3 else "")


def parked(job: str) -> str:
    """Where the sink parks the results of a paused job (its output lacks a resource:
    `prefixflow/services/sink/pause.py`) until it resumes: kept, never consumed, moved back
    to `results(origin, job)` then."""
    return f"{PREFIX}.parked.{job}"


def status(replica: str) -> str:
    return f"{PREFIX}.status.{replica}"


def cache_events(replica: str) -> str:
    """Event (core NATS): the replica's KV-cache changes (`messages.CacheEvents`)."""
    return f"{PREFIX}.cache.{replica}"


def engine_reset(replica: str) -> str:
    """Request/reply (nats.micro endpoint; empty -> `messages.ControlReply`): reset the
    replica's prefix cache."""
    return f"{PREFIX}.engine.{replica}.reset"


def engine_scheduling(replica: str) -> str:
    """Request/reply (nats.micro endpoint; `messages.SetScheduling` -> `messages.ControlReply`):
    set the replica's scheduling (`prefix-groups` or `fcfs`)."""
    return f"{PREFIX}.engine.{replica}.scheduling"


def engine_status_request(replica: str) -> str:
    """Request/reply (nats.micro endpoint; empty -> `messages.EngineStatus`): the replica's
    status now (instead of waiting for the next tick)."""
    return f"{PREFIX}.engine.{replica}.status"


def bucketer_heartbeat(node: str) -> str:
    return f"{PREFIX}.hb.bucketer.{node}"


def blob_piece(job: str, key: str, piece: int | str) -> str:
    """Piece `piece` of blob `key` of `job` (`prefixflow/shared/bus/blobs.py`); `key` is a subject
    token the writer chose (letters, digits, '-', '_'). With `*` for key and piece: every
    piece of the job's blobs (a purge filter)."""
    return f"{PREFIX}.blob.{job}.{key}.{piece}"


def done_query(job: str) -> str:
    """Request/reply (the sink): which of these ids of `job` are on disk already
    (`messages.DoneQuery` -> `messages.DoneReply`). A resuming client sends only the rest."""
    return f"{PREFIX}.sink.done.{job}"


def job_of_done_query(subject: str) -> str:
    """The job id of a `done_query` subject."""
    return subject.split(".", 3)[-1]


def job_cancelled(job: str) -> str:
    """Event (core NATS, no reply; `messages.CancelNotice`): `job`'s spec now says it is
    cancelled. The job id is in the subject (its tenant a token of its own), so a tenant's
    grant names only its own jobs' notices (`permissions._tenant`): nobody else can
    announce a cancel of them, nor read theirs. A notice is only a hint to read the spec
    again (the spec is the durable record): receivers act on the spec, never on the notice."""
    return f"{PREFIX}.jobs.cancelled.{job}"


def job_of_cancel(subject: str) -> str:
    """The job id of a `job_cancelled` subject."""
    return subject.split(".", 3)[-1]


def dead(original_subject: str) -> str:
    """Dead-letter subject for a message that can never be processed."""
    return f"{PREFIX}.dead.{original_subject}"


def job_from_subject(subject: str) -> str:
    """The job id of an `ingest` (or `parked`) subject: its tokens after the second."""
    return subject.split(".", 2)[-1]


ROUTE = f"{PREFIX}.route"
"""Request/reply subject of the router service (nats.micro endpoint)."""
ROUTER_ROOM = f"{PREFIX}.router.room"
"""Request/reply (nats.micro endpoint; empty -> `messages.RouterRoom`): work tokens the open
replicas can still take."""
ROUTER_ROOM_FREED = f"{PREFIX}.router.freed"
"""Event (core NATS, no reply): a status freed room on the fleet. Bucketers waiting on a
retry-after, or holding buckets for room, try again now rather than at their next poll."""
ROUTER_POLICY = f"{PREFIX}.router.policy"
"""Request/reply (nats.micro endpoint; `messages.SetPolicy` -> `messages.ControlReply`):
switch the router's policy."""
ALL_STATUS = f"{PREFIX}.status.*"
ALL_CACHE_EVENTS = f"{PREFIX}.cache.*"
ALL_BUCKETER_HEARTBEATS = f"{PREFIX}.hb.bucketer.*"
ALL_DONE_QUERIES = f"{PREFIX}.sink.done.>"
ALL_JOB_CANCELLED = f"{PREFIX}.jobs.cancelled.>"
"""Every job's cancel notices (`job_cancelled`): the services that cache specs follow them."""

# Job ids and node/replica names become subject tokens: keep them to a safe alphabet.
NAME_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


NAME_MAX = 64


def name_problem(name: str) -> str | None:
    """Why `name` cannot be a job id or node/replica name (a subject token), or None.

    Each case gets its own words: a dot would split the subject into more tokens (the job
    would land on another subject), `*` and `>` are NATS wildcards (publishing there is an
    error, subscribing reads other jobs), whitespace ends a subject in the protocol."""
    if not name:
        return "it is empty"
    if len(name) > NAME_MAX:
        return f"it is {len(name)} characters long (at most {NAME_MAX})"
    if "." in name:
        return "it contains '.', which separates NATS subject tokens"
    wild = sorted({c for c in name if c in "*>"})
    if wild:
        return f"it contains the NATS wildcard {' and '.join(repr(c) for c in wild)}"
    if any(c.isspace() for c in name):
        return "it contains whitespace"
    bad = sorted({c for c in name if c not in NAME_ALPHABET})
    if bad:
        return f"it contains {', '.join(repr(c) for c in bad)}; use letters, digits, '-' and '_'"
    return None


def is_valid_name(name: str) -> bool:
    return 0 < len(name) <= NAME_MAX and all(c in NAME_ALPHABET for c in name)


RESERVED_TENANTS = ("dir",)
"""`dir.<hash>` keys of `JOBS_KV` bind output directories (`dir_key`)."""

API_NAMESPACE = "pfxapi"
"""The batch service's jobs are `pfxapi.<batch id>` (`api_job`): the namespace of a tenant
no user may be (`tenant_problem`), so neither the `submitter` (one-token jobs) nor any
tenant's grant reaches them, and the sink writes them under `<root>/pfxapi/` only."""


def api_job(batch_id: str) -> str:
    """The job id of a batch of the batch service."""
    return f"{API_NAMESPACE}.{batch_id}"


def tenant_problem(tenant: str, *, in_job: bool = False) -> str | None:
    """Why `tenant` cannot be a tenant name (`in_job`: the tenant part of a job id, where
    the batch service's namespace is valid), or None."""
    if (problem := name_problem(tenant)) is not None:
        return problem
    if tenant in RESERVED_TENANTS or (tenant == API_NAMESPACE and not in_job):
        return f"{tenant!r} is reserved"
    return None


def job_id(tenant: str, name: str) -> str:
    """The job id of `name` for `tenant` ('' : no tenant, the name itself)."""
    return f"{tenant}.{name}" if tenant else name


def qualify(job: str, tenant: str) -> str:
    """A job id as `tenant` means it: a bare name becomes `tenant.name`; an id that names
    a tenant already is left as it is (the server refuses another tenant's)."""
    return job_id(tenant, job) if tenant and "." not in job else job


def probe_key(tenant: str) -> str:
    """A key of the jobs bucket a client of `tenant` ('' none) may read, found or not: its
    check that the buckets are there (`kv_keys.wait_buckets`)."""
    return f"{tenant}.pfx-probe" if tenant else "pfx-probe"


def tenant_of(job: str) -> str:
    """The tenant of a job id ('' for a job without one)."""
    return job.split(".", 1)[0] if "." in job else ""


def job_problem(job: str) -> str | None:
    """Why `job` cannot be a job id (`name`, or `tenant.name`), or None."""
    if job.count(".") > 1:
        return "it contains more than one '.' (a job id is NAME, or TENANT.NAME)"
    if "." in job:
        tenant, name = job.split(".")
        if (problem := tenant_problem(tenant, in_job=True)) is not None:
            return f"its tenant {tenant!r}: {problem}"
        if (problem := name_problem(name)) is not None:
            return f"its name {name!r}: {problem}"
        return None
    return name_problem(job)


JOB_ID_RULE = ("a job id is letters, digits, '-' and '_', at most 64, "
               "after its tenant and a '.' on a fleet with tenants")
"""The job-id grammar in words (`job_problem` is the rule), as errors and the README say it."""


def job_id_error(job: str) -> str | None:
    """None for a valid job id; else the whole reason, as every path reports it (the
    CLI's refusal, a dead letter's `Pfx-Error`, a done query's error reply):
    `invalid job id 'bad:job': it contains ':'; ... (a job id is ...)`.

    One grammar everywhere: a job id comes in from a user (the CLI, the batch API), from a
    subject (`pfx.ingest.<job>`, `pfx.results.<job>`, `pfx.sink.done.<job>`,
    `pfx.bucket.<node>.<job>`) or from a message body (`Prompt.job`, `ResultBatch.job`, a
    jobs-bucket key), and each of those paths checks it here before the id reaches a
    subject, a key-value key or a path."""
    if (problem := job_problem(job)) is None:
        return None
    return f"invalid job id {job!r}: {problem} ({JOB_ID_RULE})"


def durable_token(job: str) -> str:
    """A job id as part of a consumer name (which cannot hold '.'; '~' is in no name)."""
    return job.replace(".", "~")


def inbox_prefix(user: str) -> str:
    """Reply inbox prefix of a NATS user (`connect` sets it, `prefixflow.shared.wire.permissions`
    lets only that user subscribe there): no user can read another's replies."""
    return f"_INBOX_{user}"


# --- streams -------------------------------------------------------------------------


class StreamSpec(msgspec.Struct, frozen=True):
    """A JetStream stream this project owns. Every stream is bounded and discards new
    messages when full, so publishers get an error and back off instead of the server
    growing without limit."""

    name: str
    subjects: tuple[str, ...]
    max_bytes: int
    max_msgs: int
    max_msg_size: int = 8 * 1024 * 1024
    work_queue: bool = True
    """Work-queue retention (a message is deleted once acked); else limits retention."""
    discard_old: bool = False
    """When full, drop the oldest messages (dead letters) instead of refusing new ones."""
    max_age: float = 0.0
    """Seconds a message is kept (0: until acked or pushed out by the limits)."""
    max_consumers: int = 0
    """Consumers the stream takes (0: the server's default, 1,000 for a work queue)."""


MiB = 1024 * 1024

INGEST_STREAM = StreamSpec("PFX_INGEST", (f"{PREFIX}.ingest.>",), 1024 * MiB, 2_000_000)
BUCKET_STREAM = StreamSpec("PFX_BUCKET", (f"{PREFIX}.bucket.*.>",), 1024 * MiB, 200_000, max_consumers=16384)
"""One consumer per (node, job) pulled at once: `--max-job-consumers` (64) per bucketer,
so up to 256 nodes at the default."""
WORK_STREAM = StreamSpec("PFX_WORK", (f"{PREFIX}.work.*",), 1024 * MiB, 200_000)
RESULTS_STREAM = StreamSpec("PFX_RESULTS", (f"{PREFIX}.results.>",), 1024 * MiB, 200_000)
DEAD_STREAM = StreamSpec("PFX_DEAD", (f"{PREFIX}.dead.>",), 256 * MiB, 100_000, work_queue=False, discard_old=True)
"""Poison messages, kept for inspection (limits retention: the oldest go first)."""
BLOB_RETENTION = 7 * 24 * 3600.0
"""Seconds a job's blobs are kept (its input columns, results too large for a message)."""
BLOB_STREAM = StreamSpec(
    "PFX_BLOBS", (f"{PREFIX}.blob.>",), 8 * 1024 * MiB, 10_000_000, max_msg_size=2 * MiB, work_queue=False,
    max_age=BLOB_RETENTION,
)
"""Blobs (`prefixflow/shared/bus/blobs.py`): values too large for one message, and the input columns
that never travel with the prompts, cut into pieces under the server's max_payload. Read
by subject (direct get), never consumed; full: writers wait (discard new)."""
PARKED_STREAM = StreamSpec("PFX_PARKED", (f"{PREFIX}.parked.>",), 1024 * MiB, 1_000_000, work_queue=False)
"""Results of paused jobs (`parked`), read back by subject when their job resumes (limits
retention: the sink deletes each once it is back in the results stream). Full: the sink
naks instead (the results stay in their stream, retried later)."""
STREAMS = (INGEST_STREAM, BUCKET_STREAM, WORK_STREAM, RESULTS_STREAM, DEAD_STREAM, BLOB_STREAM, PARKED_STREAM)

# --- consumers -----------------------------------------------------------------------


class ConsumerSpec(msgspec.Struct, frozen=True):
    """A durable pull consumer. `max_ack_pending` is the backpressure bound: the server
    stops delivering once that many messages are out and unacked."""

    stream: str
    durable: str
    filter_subject: str
    max_ack_pending: int
    ack_wait: float = 30.0
    """Seconds before an unacked message is redelivered. Long-running holders send
    `in_progress()` well inside this window."""
    inactive_threshold: float = 0.0
    """Seconds without a pull after which the server deletes the consumer (0: kept). Per-job
    consumers use it, so finished jobs leave none behind."""
    max_deliver: int = -1
    """Unlimited: the poison check (`prefixflow/shared/bus/poison.py`) ends a failing message's
    retries with error rows. A server-side cap would strand a message silently (never
    delivered again, its job never complete) once backpressure or failover had
    redelivered it that often."""


# ack_wait bounds how long a crashed holder's messages wait before redelivery (the
# time-to-recover after a SIGKILL); holders of long-lived messages send in_progress()
# every IN_PROGRESS_EVERY seconds, well inside it.
IN_PROGRESS_EVERY = 3.0


INGEST_CONSUMER_IDLE = 120.0
"""Seconds a job's ingest consumer outlives its last pull (then the server deletes it: an
ingestor deletes a job's once its subject is empty, this is for one that died)."""


def ingestor_consumer(job: str) -> ConsumerSpec:
    """One job's rows on its ingest subject, shared by every ingestor (pull consumers
    load-balance by themselves): the ingestor pulls each job on its own and takes turns
    between them (`prefixflow/services/ingestor/shares.py`). A subject whose job part is no
    job id (`job_id_error`: its messages are dead-lettered) gets a durable name by hash."""
    import hashlib

    token = durable_token(job) if job == ">" or job_id_error(job) is None else \
        "bad-" + hashlib.sha256(job.encode()).hexdigest()[:16]
    return ConsumerSpec(INGEST_STREAM.name, f"ingest-{token}", ingest(job), 4096, ack_wait=10.0,
                        inactive_threshold=INGEST_CONSUMER_IDLE)


LEGACY_INGESTOR_CONSUMER = "ingestor"
"""The one FIFO consumer over every ingest subject that ingestors before per-job turns
shared: its filter overlaps every job's, which a work-queue stream refuses, so an
ingestor deletes it at start."""


BUCKET_CONSUMER_IDLE = 120.0
"""Seconds a job's bucket consumer outlives its last pull (then the server deletes it: a
bucketer closes its finished jobs' at once, this is for one that died)."""


def bucketer_consumer(node: str, job: str) -> ConsumerSpec:
    """One job's prompts for one node: the bucketer holds one per job with prompts there."""
    return ConsumerSpec(BUCKET_STREAM.name, f"bucketer-{node}-{durable_token(job)}", bucket(node, job), 256, ack_wait=10.0,
                        inactive_threshold=BUCKET_CONSUMER_IDLE)


def engine_consumer(replica: str) -> ConsumerSpec:
    return ConsumerSpec(WORK_STREAM.name, f"engine-{replica}", work(replica), 256, ack_wait=10.0)


def sink_consumer() -> ConsumerSpec:
    return ConsumerSpec(RESULTS_STREAM.name, "sink", f"{PREFIX}.results.>", 2048, ack_wait=10.0)


# --- key-value buckets ---------------------------------------------------------------

JOBS_KV = "PFX_JOBS"
"""Job specs (`messages.JobSpec`, JSON) by job id: written by the client, read by all."""
JOB_STATUS_KV = "PFX_JOB_STATUS"
"""Job progress (`messages.JobStatus`, JSON) by job id: written by the sink."""
FILES_OBJ = "PFX_FILES"
"""Object store of the batch service's files (`prefixflow serve api`): uploaded inputs
(`file-<hex>`), and each batch job's exported results (`<job>/output.jsonl`,
`<job>/errors.jsonl`, written by the sink). Replicated like the streams."""
FILES_MAX_BYTES = 16 * 1024**3
"""The files object store's size bound: full, uploads are refused (HTTP 507)."""
BATCHES_KV = "PFX_BATCHES"
"""The batch service's batches (its own record: the OpenAI Batch object, tenant, job),
by batch id; expire with the job records (`--job-retention`)."""
JOB_RETENTION = 7 * 24 * 3600.0
"""Default seconds a job's spec, status and dead letters are kept after their last write
(`--job-retention` / `PFX_JOB_RETENTION`); output files are the user's and stay."""
DIR_KEY_PREFIX = "dir."
"""Keys of `JOBS_KV` that bind an output directory to a job (`dir_key`); no tenant is
called `dir` (`RESERVED_TENANTS`), so they never meet a job's key."""


def dir_key(out_dir: str, tenant: str = "") -> str:
    """The `JOBS_KV` key that holds which job owns `out_dir` (an absolute path as the
    client resolved it), its value the job id; a tenant's under its own keys
    (`<tenant>.dir.<hash>`: its grant covers them, its directories are its own)."""
    import hashlib

    key = DIR_KEY_PREFIX + hashlib.sha256(out_dir.encode()).hexdigest()[:40]
    return f"{tenant}.{key}" if tenant else key


def is_dir_key(key: str) -> bool:
    """Whether a `JOBS_KV` key binds a directory (not a job's spec)."""
    return key.startswith(DIR_KEY_PREFIX) or key.split(".", 1)[-1].startswith(DIR_KEY_PREFIX)
