"""NATS users and what each may publish and subscribe to, derived from `subjects`.

One role per kind of process (`ingestor`, `bucketer`, `router`, `engine-worker`, `sink`),
plus `submitter` (people and programs that submit jobs) and `admin` (operators,
benchmarks, tests: everything). `prefixflow cluster config` renders these into
nats-server's `authorization` block; nothing here spells a subject by hand: subjects,
streams, consumers and buckets all come from `shared.wire.subjects`, called with `*`
(or `>`) for the variable token, so a renamed subject moves its permission with it.

What a grant covers, besides the pipeline subjects (JetStream is itself NATS subjects):

- consuming a durable (`ConsumerSpec`): create, info, delete it, pull from it
  (`$JS.API.CONSUMER.MSG.NEXT`) and ack its messages (`$JS.ACK.<stream>.<durable>.>`);
- publishing into a stream: the subject itself (the publish ack comes back on the
  user's inbox);
- reading a key-value bucket: its stream info and direct/message gets; writing one:
  `$KV.<bucket>.>`;
- provisioning (every service creates or updates the streams and buckets at start-up,
  so they can start in any order): stream info/create/update of the project's streams;
  the submitter may only look at stream info;
- replies: each user's inbox is `_INBOX_<user>` (`subjects.inbox_prefix`), and only that
  user may subscribe there; responders (router, engine-worker) answer requests through
  `allow_responses`, which lets them publish to a request's reply subject only.

Pure: imports nothing but `subjects` (a unit test checks every subject in `subjects` is
granted to some role, so a new subject cannot ship without a permission).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from shared.wire import subjects as s
from shared.wire.subjects import ConsumerSpec

ANY = "*"
"""The variable token (job, node, replica) of a subject, as a NATS wildcard."""

JS_API = "$JS.API"
SERVICE_DISCOVERY = "$SRV.>"
"""nats.micro's discovery subjects (PING, INFO, STATS), served by the router."""

ROLES = ("ingestor", "bucketer", "router", "engine-worker", "sink", "submitter", "api", "admin")
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
    """`engine-*` is not a NATS wildcard: a token that merely contains `*` becomes `*`."""
    return ".".join("*" if "*" in t else t for t in subject.split("."))


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --- JetStream building blocks -------------------------------------------------------


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def stream_info(streams: Iterable[str]) -> list[str]:
    return [f"{JS_API}.STREAM.INFO.{name}" for name in streams]


def provision(streams: Iterable[str]) -> list[str]:
    """Create, update and look at these streams (idempotent provisioning)."""
    return [f"{JS_API}.STREAM.{op}.{name}" for name in streams for op in ("INFO", "CREATE", "UPDATE")]


def consume(spec: ConsumerSpec) -> list[str]:
    """Everything a holder of a durable pull consumer does with it."""
    stream, durable = spec.stream, wild(spec.durable)
    api = f"{JS_API}.CONSUMER"
    return [
        f"{api}.CREATE.{stream}.{durable}",
        f"{api}.CREATE.{stream}.{durable}.>",  # with its filter subject (server >= 2.9)
        f"{api}.DURABLE.CREATE.{stream}.{durable}",
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


def blob_write() -> list[str]:
    """Store blobs (`shared/bus/blobs.py`): publish their pieces."""
    return [s.blob_piece(ANY, ANY, ANY)]


def blob_read() -> list[str]:
    """Read blobs by subject (a message get on the blob stream)."""
    name = s.BLOB_STREAM.name
    return [f"{JS_API}.STREAM.MSG.GET.{name}", f"{JS_API}.DIRECT.GET.{name}", f"{JS_API}.DIRECT.GET.{name}.>"]


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
    """Every service provisions the streams and buckets at start-up."""
    return [f"{JS_API}.INFO", *provision(ALL_STREAMS), *pub], sub, responds


def _ingestor():
    return _service(
        [
            *consume(s.ingestor_consumer()),
            *consume(s.bucketer_consumer(ANY, ANY)),  # takeover of a gone node's prompts (services/ingestor/mover.py)
            s.bucket(ANY, ANY),
            s.results(ANY),  # error rows
            s.dead(">"),
            *blob_write(),  # extra fields of rows published to the ingest subject
            *kv_read(s.JOBS_KV),
            *kv_write(s.JOB_STATUS_KV),  # jobs that cannot run are marked failed
        ],
        [s.ALL_BUCKETER_HEARTBEATS, s.JOB_CANCELLED],
    )


def _bucketer():
    return _service(
        [
            *consume(s.bucketer_consumer(ANY, ANY)),  # one consumer per job with prompts on this node
            s.bucketer_heartbeat(ANY),
            s.ROUTE,
            s.ROUTER_ROOM,
            s.work(ANY),
            s.results(ANY),  # error rows of a quarantined batch
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
            s.results(ANY),
            s.dead(">"),
        ],
        [s.ALL_STATUS, s.ALL_CACHE_EVENTS, s.ROUTE, s.ROUTER_ROOM, s.ROUTER_POLICY, SERVICE_DISCOVERY],
        responds=True,
    )


def _engine_worker():
    return _service(
        [
            *consume(s.engine_consumer(ANY)),
            s.work(ANY),  # suspect batches after an engine death (`services/engine_worker/isolate.py`)
            s.status(ANY),
            s.cache_events(ANY),
            s.results(ANY),
            s.dead(">"),
            *blob_write(),  # a result too large for one message
            *kv_read(s.JOBS_KV),
        ],
        [s.engine_reset(ANY), s.engine_scheduling(ANY), s.engine_status_request(ANY), s.JOB_CANCELLED],
        responds=True,
    )


def _sink():
    return _service(
        [
            *consume(s.sink_consumer()),
            s.dead(">"),
            *blob_read(),  # input columns, large results
            f"{JS_API}.STREAM.PURGE.{s.BLOB_STREAM.name}",  # a done job's blobs
            *kv_read(s.JOBS_KV),
            *kv_watch(s.JOBS_KV),  # sealed jobs to reconcile (services/sink/service.py)
            *kv_read(s.JOB_STATUS_KV),
            *kv_write(s.JOB_STATUS_KV),
            *object_read(s.FILES_OBJ),  # a batch job's results exported for the batch service
            *object_write(s.FILES_OBJ),
        ],
        [s.ALL_DONE_QUERIES, s.JOB_CANCELLED],
        responds=True,
    )


def _submitter():
    """Create jobs, publish their prompts, follow their status and the replicas' load:
    nothing else (no results, no work, no stream changes)."""
    pub = [
        *stream_info(ALL_STREAMS),  # `provision` only checks that they exist
        s.ingest(ANY),
        s.done_query(ANY),  # which rows of a resumed job are done (the sink answers)
        s.JOB_CANCELLED,  # `prefixflow cancel`: the services drop their cached spec at once
        *blob_write(),  # the input columns that do not travel with the prompts
        *kv_write(s.JOBS_KV),
        *kv_read(s.JOBS_KV),
        *kv_read(s.JOB_STATUS_KV),
    ]
    # Replica status (load, prompts held per job, tokens generated): the progress line
    # shows work under way before the first row is written.
    return pub, [s.ALL_STATUS, s.JOB_CANCELLED], False


def _api():
    """The batch service (`prefixflow serve api`): a submitter of its tenants' jobs, plus
    its files (object store) and batches (key-value) and cancelling its jobs."""
    pub, sub, _ = _submitter()
    pub = [*provision(ALL_STREAMS), *pub, s.JOB_CANCELLED, *object_read(s.FILES_OBJ), *object_write(s.FILES_OBJ),
           *kv_read(s.BATCHES_KV), *kv_write(s.BATCHES_KV)]
    return pub, sub, False


ROLE_GRANTS: dict[str, Callable[[], tuple[list[str], list[str], bool]]] = {
    "ingestor": _ingestor,
    "bucketer": _bucketer,
    "router": _router,
    "engine-worker": _engine_worker,
    "sink": _sink,
    "submitter": _submitter,
    "api": _api,
}


def permissions(role: str) -> Permissions:
    """The allow lists of `role` (`admin`: everything)."""
    if role == "admin":
        return Permissions((">",), (">",), allow_responses=False)
    try:
        grant = ROLE_GRANTS[role]
    except KeyError:
        raise ValueError(f"unknown role {role!r} (roles: {', '.join(ROLES)})") from None
    pub, sub, responds = grant()
    # Replies (publish acks, JetStream API answers, requests) come back on the user's own inbox.
    return Permissions(_unique(pub), _unique([*sub, f"{s.inbox_prefix(role)}.>"]), responds)


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


def allowed(role: str, action: str, subject: str) -> bool:
    """Whether `role` may `publish` or `subscribe` on `subject` (allow lists only)."""
    perms = permissions(role)
    patterns = perms.publish if action == "publish" else perms.subscribe
    return any(matches(p, subject) for p in patterns)
