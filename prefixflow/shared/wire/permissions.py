"""NATS users and what each may publish and subscribe to, derived from `subjects`.

One role per kind of process (`ingestor`, `bucketer`, `router`, `engine-worker`, `sink`),
plus `submitter` (people and programs that submit jobs) and `admin` (operators,
benchmarks, tests: everything). A process that has a name of its own gets a grant of its
own (`permissions(role, name)`, user `user_name(role, name)`): a bucketer may pull only
its own node's prompts and send only its own heartbeat; an engine-worker may pull only its
own replica's work and publish only its own status, cache events and work (its suspect
batches), and answers only its own control requests. A tenant (`tenant-<name>`, the
submitter of one tenant's jobs, ids `<name>.<job>`) may publish and read only subjects and
keys naming its own jobs; `submitter` only those of jobs without a tenant.
`prefixflow cluster config` renders these into
nats-server's `authorization` block; nothing here spells a subject by hand: subjects,
streams, consumers and buckets all come from `prefixflow.shared.wire.subjects`, called with `*`
(or `>`) for the variable token, so a renamed subject moves its permission with it.

What a grant covers, besides the pipeline subjects (JetStream is itself NATS subjects):

- consuming a durable (`ConsumerSpec`): create, info, delete it, pull from it
  (`$JS.API.CONSUMER.MSG.NEXT`) and ack its messages (`$JS.ACK.<stream>.<durable>.>`);
- publishing into a stream: the subject itself (the publish ack comes back on the
  user's inbox);
- reading a key-value bucket: its stream info and direct/message gets; writing one:
  `$KV.<bucket>.>`;
- provisioning is an operator's step (`prefixflow cluster provision`, the admin user):
  services and submitters may only look at the streams (stream info), never create,
  update, purge or delete one (the sink's purge of a finished job's blobs and the batch
  service's of a replaced file aside);
- replies: each user's inbox is `_INBOX_<user>` (`subjects.inbox_prefix`), and only that
  user may subscribe there; responders (router, engine-worker) answer requests through
  `allow_responses`, which lets them publish to a request's reply subject only.

Pure: imports nothing but `subjects` (a unit test checks every subject in `subjects` is
granted to some role, so a new subject cannot ship without a permission).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prefixflow.shared.wire import subjects as s
from prefixflow.shared.wire.subjects import ConsumerSpec

ANY = "*"
"""The variable token (node, replica) of a subject, as a NATS wildcard."""
ANY_JOB = ">"
"""Any job id as the last part of a subject: `name` or `tenant.name` (one or two tokens)."""

JS_API = "$JS.API"
SERVICE_DISCOVERY = "$SRV.>"
"""nats.micro's discovery subjects (PING, INFO, STATS), served by the router and the
engine-workers (their control endpoints are micro services)."""

ROLES = ("ingestor", "bucketer", "router", "engine-worker", "sink", "submitter", "api", "tenant", "admin")
SERVICE_ROLES = ROLES[:5]
"""The roles that are `prefixflow serve NAME` processes (the role name is the service name)."""


@dataclass(frozen=True)
class Permissions:
    """A NATS user's allow lists (everything else is denied)."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    """May publish to the reply subject of a request it received (responders)."""


def wild(subject: str) -> str:
    """`engine-*` is not a NATS wildcard: a token that merely contains `*` (or `>`)
    becomes `*`."""
    return ".".join("*" if ("*" in t or ">" in t) and len(t) > 1 else t for t in subject.split("."))


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --- JetStream building blocks -------------------------------------------------------


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def stream_info(streams: Iterable[str]) -> list[str]:
    return [f"{JS_API}.STREAM.INFO.{name}" for name in streams]


def consume(spec: ConsumerSpec, *, filtered: bool = False) -> list[str]:
    """Everything a holder of a durable pull consumer does with it. `filtered`: it may
    create one only through the API subject that names its filter (`spec.filter_subject`,
    wildcards included), for durables NATS cannot match by name (`bucketer-<node>-<job>`:
    a wildcard is a whole token)."""
    stream, durable = spec.stream, wild(spec.durable)
    api = f"{JS_API}.CONSUMER"
    create = ([f"{api}.CREATE.{stream}.{durable}.{spec.filter_subject}"] if filtered else [
        f"{api}.CREATE.{stream}.{durable}",
        f"{api}.CREATE.{stream}.{durable}.>",  # with its filter subject (server >= 2.9)
        f"{api}.DURABLE.CREATE.{stream}.{durable}",
    ])
    return [
        *create,
        f"{api}.INFO.{stream}.{durable}",
        f"{api}.DELETE.{stream}.{durable}",
        f"{api}.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",  # ack, nak, in_progress, term
    ]


def consumer_info(spec: ConsumerSpec) -> list[str]:
    return [f"{JS_API}.CONSUMER.INFO.{spec.stream}.{wild(spec.durable)}"]


def kv_read(bucket: str) -> list[str]:
    stream = kv_stream(bucket)
    return [
        f"{JS_API}.STREAM.INFO.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}",
        f"{JS_API}.DIRECT.GET.{stream}.>",
        f"{JS_API}.STREAM.MSG.GET.{stream}",
    ]


def kv_write(bucket: str) -> list[str]:
    return [f"$KV.{bucket}.>"]


def kv_read_keys(bucket: str, keys: str) -> list[str]:
    """Read only the keys matching `keys` (a subject pattern): direct gets that name the
    key in the API subject, so the server can check them (no gets with the key in the
    request body), and no stream info (it lists every key's subject: the client binds
    the bucket without it, `prefixflow/shared/bus/kv_keys.py` `bound`)."""
    return [f"{JS_API}.DIRECT.GET.{kv_stream(bucket)}.$KV.{bucket}.{keys}"]


def object_read(bucket: str) -> list[str]:
    """Read objects of an object store (their meta by direct get; chunks through an
    ordered consumer delivering to the user's inbox)."""
    stream = f"OBJ_{bucket}"
    api = f"{JS_API}.CONSUMER"
    return [f"{JS_API}.STREAM.INFO.{stream}", f"{JS_API}.DIRECT.GET.{stream}", f"{JS_API}.DIRECT.GET.{stream}.>",
            f"{JS_API}.STREAM.MSG.GET.{stream}", f"{api}.CREATE.{stream}", f"{api}.CREATE.{stream}.>",
            f"{api}.DELETE.{stream}.>", f"{api}.INFO.{stream}.>", f"$JS.FC.{stream}.>"]


def object_write(bucket: str) -> list[str]:
    """Put and delete objects (chunks, meta; a replaced object's old chunks purged)."""
    return [f"$O.{bucket}.C.>", f"$O.{bucket}.M.>", f"{JS_API}.STREAM.PURGE.OBJ_{bucket}"]


def blob_write(job: str = "") -> list[str]:
    """Store blobs (`prefixflow/shared/bus/blobs.py`): publish their pieces (of `job`'s, a pattern
    such as `alice.*`; default: of any job, with or without a tenant)."""
    jobs = [job] if job else [ANY, f"{ANY}.{ANY}"]
    return [s.blob_piece(j, ANY, ANY) for j in jobs]


def blob_read() -> list[str]:
    """Read blobs by subject (a message get on the blob stream)."""
    name = s.BLOB_STREAM.name
    return [f"{JS_API}.STREAM.MSG.GET.{name}", f"{JS_API}.DIRECT.GET.{name}", f"{JS_API}.DIRECT.GET.{name}.>"]


def parked_read() -> list[str]:
    """Read a paused job's parked results back by subject, delete each once it is moved,
    and list which jobs have any (stream info with a subject filter)."""
    name = s.PARKED_STREAM.name
    return [f"{JS_API}.STREAM.MSG.GET.{name}", f"{JS_API}.STREAM.MSG.DELETE.{name}", f"{JS_API}.STREAM.INFO.{name}"]


def kv_watch(bucket: str) -> list[str]:
    """Watch a key-value bucket (an ordered, ephemeral consumer delivering to the user's
    inbox, with flow control)."""
    stream = kv_stream(bucket)
    api = f"{JS_API}.CONSUMER"
    return [f"{api}.CREATE.{stream}", f"{api}.CREATE.{stream}.>", f"{api}.DELETE.{stream}.>",
            f"{api}.INFO.{stream}.>", f"$JS.FC.{stream}.>"]


ALL_STREAMS = ([spec.name for spec in s.STREAMS] + [kv_stream(b) for b in (s.JOBS_KV, s.JOB_STATUS_KV, s.BATCHES_KV)]
               + [f"OBJ_{s.FILES_OBJ}"])


# --- the roles -----------------------------------------------------------------------


def _service(pub: list[str], sub: list[str], *, responds: bool = False) -> tuple[list[str], list[str], bool]:
    """Every service checks the streams and buckets at start-up (stream info); it may
    neither create nor change one (`prefixflow cluster provision` does, as admin)."""
    return [f"{JS_API}.INFO", *stream_info(ALL_STREAMS), *pub], sub, responds


def _ingestor():
    return _service(
        [
            # One consumer per job with rows waiting (`ingest-<job>`), and deleting the one FIFO
            # consumer of earlier versions (`ingestor`): any durable on the ingest stream.
            *consume(s.ingestor_consumer(ANY_JOB)),
            *consume(s.bucketer_consumer(ANY, ANY_JOB)),  # takeover of a gone node's prompts (prefixflow/services/ingestor/mover.py)
            s.bucket(ANY, ANY_JOB),
            s.results(s.ORIGIN_INGESTOR, ANY_JOB),  # error rows, under its own origin only
            s.dead(">"),
            *blob_write(),  # extra fields of rows published to the ingest subject
            *kv_read(s.JOBS_KV),
            *kv_write(s.JOB_STATUS_KV),  # jobs that cannot run are marked failed
        ],
        # the ingest subjects while idle: the first message of a job wakes it (`Ingestor.idle`)
        [s.ALL_BUCKETER_HEARTBEATS, s.ALL_JOB_CANCELLED, s.ingest(">")],
    )


def _bucketer(node: str = ANY):
    return _service(
        [
            # One consumer per job with prompts on this node: created only on its node's subjects
            # (pulled by durable name, `bucketer-<node>-<job>`, which no grant can match by prefix).
            *consume(s.bucketer_consumer(node, ANY_JOB), filtered=node != ANY),
            s.bucketer_heartbeat(node),
            s.ROUTE,
            s.ROUTER_ROOM,
            s.work(ANY),
            s.results(s.ORIGIN_BUCKETER, ANY_JOB),  # error rows of a quarantined batch, under its own origin
            s.dead(">"),
        ],
        [s.ROUTER_ROOM_FREED],
    )


def _router():
    return _service(
        [
            *consume(s.engine_consumer(ANY)),  # failover takes over a dead replica's work
            s.ROUTER_ROOM_FREED,
            s.work(ANY),
            s.dead(">"),
        ],
        [s.ALL_STATUS, s.ALL_CACHE_EVENTS, s.ROUTE, s.ROUTER_ROOM, s.ROUTER_POLICY, SERVICE_DISCOVERY],
        responds=True,
    )


def _engine_worker(replica: str = ANY):
    return _service(
        [
            *consume(s.engine_consumer(replica)),
            s.work(replica),  # its suspect batches after an engine death (`prefixflow/services/engine_worker/isolate.py`)
            s.status(replica),
            s.cache_events(replica),
            s.results(replica, ANY_JOB),  # under its own name only (provenance.py: the sink checks each row's grant)
            s.dead(">"),
            *blob_write(),  # a result too large for one message
            *kv_read(s.JOBS_KV),
        ],
        [s.engine_reset(replica), s.engine_scheduling(replica), s.engine_status_request(replica), s.ALL_JOB_CANCELLED,
         SERVICE_DISCOVERY],
        responds=True,
    )


def _sink():
    return _service(
        [
            *consume(s.sink_consumer()),
            s.dead(">"),
            s.parked(">"),  # a paused job's results (prefixflow/services/sink/pause.py)
            s.results(ANY, ANY_JOB),  # a resumed job's parked results, back under their origins
            *parked_read(),
            *blob_read(),  # input columns, large results
            f"{JS_API}.STREAM.PURGE.{s.BLOB_STREAM.name}",  # a done job's blobs
            *kv_read(s.JOBS_KV),
            *kv_watch(s.JOBS_KV),  # sealed jobs to reconcile (prefixflow/services/sink/service.py)
            *kv_read(s.JOB_STATUS_KV),
            *kv_write(s.JOB_STATUS_KV),
            *object_read(s.FILES_OBJ),  # a batch job's results exported for the batch service
            *object_write(s.FILES_OBJ),
        ],
        [s.ALL_DONE_QUERIES, s.ALL_JOB_CANCELLED],
        responds=True,
    )


def _tenant(tenant: str = ""):
    """Submit jobs, publish their prompts, follow their status: of its own jobs only, job
    ids `<tenant>.<name>` (`prefixflow/shared/wire/subjects.py`), every subject and key naming the
    tenant (no results, no work, no stream changes, no other tenant's specs or statuses).
    `tenant` '' (the `submitter` role): the jobs without a tenant (one-token ids)."""
    job = f"{tenant}.{ANY}" if tenant else ANY
    keys = f"{tenant}.>" if tenant else ANY  # a tenant's job specs and its directories' bindings
    dirs = [] if tenant else [f"{s.DIR_KEY_PREFIX}{ANY}"]  # `dir.<hash>`: the jobs without a tenant's
    pub = [  # no stream info: with a subject filter it lists every tenant's job, batch and file ids
        s.ingest(job),
        s.done_query(job),  # which rows of a resumed job are done (the sink answers)
        s.job_cancelled(job),  # `prefixflow cancel` of its own jobs: the services read the spec again
        *blob_write(job),  # the input columns that do not travel with the prompts
        *(f"$KV.{s.JOBS_KV}.{k}" for k in [keys, *dirs]),
        *(p for k in [keys, *dirs] for p in kv_read_keys(s.JOBS_KV, k)),
        *kv_read_keys(s.JOB_STATUS_KV, keys),
    ]
    return pub, [s.job_cancelled(job)], False  # its own jobs' cancel notices (`submit` stops)


def _submitter():
    """The jobs without a tenant (`_tenant("")`), and the replicas' status (load, prompts
    held per job, tokens generated): the progress line shows work under way before the
    first row is written."""
    pub, sub, _ = _tenant("")
    return pub, [*sub, s.ALL_STATUS], False


def _api():
    """The batch service (`prefixflow serve api`): submits its tenants' jobs (it keeps
    them apart itself, by API key), plus its files (object store) and batches (key-value)
    and cancelling its jobs. No consumer on its bucket: it lists keys by stream info with
    a subject filter (`prefixflow/shared/bus/kv_keys.py`), and reads objects naming their
    stream (`prefixflow/shared/bus/objects.py`, no `STREAM.NAMES` lookup)."""
    pub = [
        *stream_info(ALL_STREAMS), s.ingest(ANY_JOB), s.done_query(ANY_JOB), s.job_cancelled(ANY_JOB), *blob_write(),
        *kv_write(s.JOBS_KV), *kv_read(s.JOBS_KV), *kv_read(s.JOB_STATUS_KV),
        *object_read(s.FILES_OBJ), *object_write(s.FILES_OBJ), *kv_read(s.BATCHES_KV), *kv_write(s.BATCHES_KV),
    ]
    return pub, [s.ALL_STATUS, s.ALL_JOB_CANCELLED], False


ROLE_GRANTS: dict[str, Callable[..., tuple[list[str], list[str], bool]]] = {
    "ingestor": _ingestor,
    "bucketer": _bucketer,
    "router": _router,
    "engine-worker": _engine_worker,
    "sink": _sink,
    "submitter": _submitter,
    "api": _api,
    "tenant": _tenant,
}


NAMED_ROLES = {"bucketer": "bucketer", "engine-worker": "engine", "tenant": "tenant"}
"""Roles whose every process (or tenant) has a user of its own: role -> the user name's
first part (`bucketer-<node>`, `engine-<replica>`, `tenant-<name>`)."""


def user_name(role: str, name: str = "") -> str:
    """The NATS user of one process of `role` (`name`: its node or replica; only for the
    roles in `NAMED_ROLES`, which need one)."""
    if role in NAMED_ROLES:
        if not name:
            raise ValueError(f"a {role} user is per process (or tenant): give its name")
        problem = s.tenant_problem(name) if role == "tenant" else s.name_problem(name)
        if problem is not None:
            raise ValueError(f"{role} name {name!r}: {problem}")
        return f"{NAMED_ROLES[role]}-{name}"
    if name:
        raise ValueError(f"role {role!r} has one user for all its processes, not one per name")
    return role


def permissions(role: str, name: str = "") -> Permissions:
    """The allow lists of `role` (`admin`: everything); with `name` (a node or replica),
    of that one process's user (`user_name`)."""
    if role == "admin":
        return Permissions((">",), (">",), allow_responses=False)
    try:
        grant = ROLE_GRANTS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})") from None
    pub, sub, responds = grant(name) if name else grant()
    user = user_name(role, name) if name else role
    # Replies (publish acks, JetStream API answers, requests) come back on the user's own inbox.
    return Permissions(_unique(pub), _unique([*sub, f"{s.inbox_prefix(user)}.>"]), responds)


def matches(pattern: str, subject: str) -> bool:
    """Whether `pattern` covers `subject` (`*` one token, `>` the rest); a wildcard in
    `subject` (a subscription) is covered only by a wildcard at least as wide."""
    p, t = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(t) > i
        if i >= len(t) or t[i] == ">" or (tok != "*" and tok != t[i]):
            return False
    return len(p) == len(t)


def allowed(role: str, action: str, subject: str, name: str = "") -> bool:
    """Whether `role` (the process `name`) may `publish` or `subscribe` on `subject`
    (allow lists only)."""
    perms = permissions(role, name)
    patterns = perms.publish if action == "publish" else perms.subscribe
    return any(matches(p, subject) for p in patterns)
