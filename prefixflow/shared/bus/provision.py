"""Idempotent stream / consumer / key-value provisioning.

Every service calls `provision()` at start-up: what exists with the right settings is
only looked at (so a client that may only read stream info, the submitter, passes), a
stream whose limits changed in `prefixflow.shared.wire.subjects` is updated in place, a missing one
is created. So services can start in any order and a fresh nats-server needs no separate
setup step.

On a fleet (`prefixflow cluster config`) services may not create or change streams
(`PFX_PROVISION=false`, and no grant for it): there `prefixflow cluster provision`, with
the admin user, does this once (and after an upgrade), and the services only check:
they wait for a missing stream or bucket, and log a stream whose settings differ.

Replicas: on a JetStream cluster of 3 or more servers, streams and key-value buckets get
3 replicas (any one server can die without losing or stalling anything); on a single
server, 1. `stream_replicas` (`PFX_STREAM_REPLICAS`) sets it explicitly; automatic mode
never scales an existing stream down (a service that starts while a server is away sees
a smaller cluster).
"""

from __future__ import annotations

import asyncio

import msgspec
import nats
import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import APIError, BadRequestError, NotFoundError, ServiceUnavailableError

from prefixflow.shared.bus.connection import current_options
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.subjects import ConsumerSpec, StreamSpec

log = structlog.get_logger()


CLUSTER_REPLICAS = 3


def cluster_size(js: JetStreamContext) -> int:
    """Servers of the cluster we are connected to: the client URLs the server gossips
    (`connect_urls`, every member's), or the URLs we were given, whichever is more; 1
    for a server that is not in a cluster."""
    nc = js._nc  # NOTE: nats.py keeps the connection on the context; no public getter.
    info = getattr(nc, "_server_info", None) or {}
    if not info.get("cluster"):
        return 1
    return max(len(info.get("connect_urls") or ()), len(getattr(nc, "servers", ()) or ()), 1)


def replicas_for(js: JetStreamContext, setting: int | None = None) -> tuple[int, bool]:
    """(replicas, explicit): the setting if nonzero, else 3 on a cluster of 3+ servers,
    else 1."""
    setting = current_options().stream_replicas if setting is None else setting
    if setting:
        return setting, True
    return (CLUSTER_REPLICAS if cluster_size(js) >= CLUSTER_REPLICAS else 1), False


def stream_config(spec: StreamSpec, replicas: int = 1) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=js_api.RetentionPolicy.WORK_QUEUE if spec.work_queue else js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        # Full work streams refuse new messages (backpressure); the dead-letter stream
        # drops its oldest instead, so poison can never block the pipeline.
        discard=js_api.DiscardPolicy.OLD if spec.discard_old else js_api.DiscardPolicy.NEW,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        max_msg_size=spec.max_msg_size,
        max_age=spec.max_age or None,
        max_consumers=spec.max_consumers or None,
        # Publishers set Nats-Msg-Id; the server drops a re-publish inside this window.
        duplicate_window=min(120.0, spec.max_age) if spec.max_age else 120.0,  # within max_age
        num_replicas=replicas,
    )


COMPARED = (
    "subjects", "retention", "storage", "discard", "max_bytes", "max_msgs", "max_msg_size", "max_age", "duplicate_window",
    "num_replicas",
)
"""The settings `provision` owns; anything else on a stream is left as the server has it."""


def differs(have: js_api.StreamConfig, want: js_api.StreamConfig) -> list[str]:
    def norm(k, v):
        if k == "max_age":  # the server reports "no limit" as 0
            return v or None
        return sorted(v) if isinstance(v, list) else v

    return [k for k in COMPARED if norm(k, getattr(have, k)) != norm(k, getattr(want, k))]


class NotProvisioned(NotFoundError):
    """A stream or bucket is missing and this process may not create it."""


async def check_stream(js: JetStreamContext, spec: StreamSpec) -> None:
    """Check only (no right to change streams): it exists; differing settings are logged."""
    try:
        have = (await js.stream_info(spec.name)).config
    except NotFoundError:
        raise NotProvisioned(description=f"stream {spec.name} missing: run `prefixflow cluster provision`") from None
    changed = [k for k in differs(have, stream_config(spec, have.num_replicas or 1)) if k not in ("num_replicas", "max_age")]
    if changed:
        log.warning("stream differs from this version's settings; `prefixflow cluster provision` updates it",
                    stream=spec.name, changed=changed)


async def ensure_stream(js: JetStreamContext, spec: StreamSpec, replicas: tuple[int, bool] = (1, True),
                        *, keep_age: bool = False) -> None:
    """`keep_age`: an existing stream keeps its max_age (a default, not a setting)."""
    n, explicit = replicas
    try:
        have = (await js.stream_info(spec.name)).config
    except NotFoundError:
        have = None
    if have is not None and not explicit:
        n = max(n, have.num_replicas or 1)  # automatic: never scale down
    if have is not None and keep_age:
        spec = msgspec.structs.replace(spec, max_age=have.max_age or 0.0)
    config = stream_config(spec, n)
    if have is None:
        try:
            await js.add_stream(config)
            log.info("stream created", stream=spec.name, replicas=n)
            return
        except BadRequestError:
            pass  # created meanwhile by another service: bring it in line below
    elif not differs(have, config):
        return
    else:
        log.info("stream updated", stream=spec.name, changed=differs(have, config), replicas=n)
        config.max_consumers = have.max_consumers  # fixed at creation: the server refuses to change it
    await js.update_stream(config)


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> None:
    config = js_api.ConsumerConfig(
        # Named too: created through the API subject that carries the filter, which a
        # grant can restrict (`prefixflow/shared/wire/permissions.py`: `consume(filtered=True)`).
        name=spec.durable,
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        max_waiting=512,
        inactive_threshold=spec.inactive_threshold or None,
    )
    try:
        await js.add_consumer(spec.stream, config)
    except BadRequestError:
        await js.delete_consumer(spec.stream, spec.durable)
        await js.add_consumer(spec.stream, config)


def retention_setting(setting: float | None = None) -> tuple[float, bool]:
    """(seconds, explicit): how long job specs, statuses and dead letters are kept. The
    setting (else the process's `job_retention`, `PFX_JOB_RETENTION`) if nonzero: it is
    applied to existing buckets too; else `subjects.JOB_RETENTION`, applied only when a
    bucket is created (a client started without the setting must not undo an operator's)."""
    setting = current_options().job_retention if setting is None else setting
    return (setting, True) if setting else (subjects.JOB_RETENTION, False)


def job_retention() -> float:
    """Seconds job records are kept as this process sees it (its setting or the default);
    `kv_ttl` says what a bucket actually has."""
    return retention_setting()[0]


async def kv_ttl(js: JetStreamContext, bucket: str) -> float:
    """Seconds the keys of `bucket` live after their last write (0: for ever)."""
    return (await js.stream_info(f"KV_{bucket}")).config.max_age or 0.0


async def ensure_kv(js: JetStreamContext, bucket: str, replicas: tuple[int, bool] = (1, True),
                    ttl: tuple[float, bool] = (0.0, True)):
    """A key-value bucket whose keys expire `ttl[0]` seconds after their last write (0:
    never); an existing bucket's TTL is changed only if `ttl[1]` (explicit)."""
    n, explicit = replicas
    ttl, ttl_explicit = ttl
    try:
        have = (await js.stream_info(f"KV_{bucket}")).config
    except NotFoundError:
        # Direct gets name the key in the API subject (`$JS.API.DIRECT.GET.KV_<b>.$KV.<b>.<key>`),
        # so a tenant's grant can allow its own keys only (`prefixflow/shared/wire/permissions.py`).
        return await js.create_key_value(
            bucket=bucket, history=1, storage=js_api.StorageType.FILE, max_bytes=256 * 1024 * 1024, replicas=n,
            ttl=ttl or None, direct=True,
        )
    current = have.num_replicas or 1
    changed = []
    if not have.allow_direct:
        have.allow_direct = True
        changed.append("direct gets on")
    if current != n and (explicit or n > current):
        have.num_replicas = n
        changed.append(f"replicas {current} -> {n}")
    if ttl_explicit and (have.max_age or 0) != (ttl or 0):
        changed.append(f"ttl {have.max_age or 0} -> {ttl or 0}")
        have.max_age = ttl or None
        if ttl and (have.duplicate_window or 0) > ttl:  # the server wants it within max_age
            have.duplicate_window = ttl
    if changed:
        await js.update_stream(have)
        log.info("bucket updated", bucket=bucket, changed=changed)
    return await js.key_value(bucket)


async def ensure_files(js: JetStreamContext, replicas: int, ttl: float):
    """The batch service's object store (`subjects.FILES_OBJ`), bounded; objects expire
    like job records. Created once (an existing store is left as it is)."""
    try:
        return await js.object_store(subjects.FILES_OBJ)
    except NotFoundError:
        return await js.create_object_store(
            subjects.FILES_OBJ, storage=js_api.StorageType.FILE, replicas=replicas, max_bytes=subjects.FILES_MAX_BYTES,
            ttl=ttl or None,
        )


async def check(js: JetStreamContext) -> None:
    """Every stream and bucket exists (raises `NotProvisioned` for the first that does not)."""
    for spec in subjects.STREAMS:
        await check_stream(js, spec)
    for name in (f"KV_{subjects.JOBS_KV}", f"KV_{subjects.JOB_STATUS_KV}", f"KV_{subjects.BATCHES_KV}",
                 f"OBJ_{subjects.FILES_OBJ}"):
        try:
            await js.stream_info(name)
        except NotFoundError:
            raise NotProvisioned(description=f"{name} missing: run `prefixflow cluster provision`") from None


async def provision(js: JetStreamContext, replicas: int | None = None, create: bool | None = None,
                    attempts: int = 60) -> None:
    """Create (or update) every stream and KV bucket the project uses. `replicas`:
    0 automatic, None the process's `stream_replicas` setting. `create` False (None: the
    process's `provision` setting): only check that they exist, waiting for them."""
    create = current_options().provision if create is None else create
    refused = ""
    for attempt in range(attempts):
        try:
            if not create:
                await check(js)
                return
            n = replicas_for(js, replicas)
            keep = retention_setting()
            for spec in subjects.STREAMS:
                if spec is subjects.DEAD_STREAM:  # dead letters are kept as long as their jobs
                    await ensure_stream(js, msgspec.structs.replace(spec, max_age=keep[0]), n, keep_age=not keep[1])
                    continue
                await ensure_stream(js, spec, n)
            await ensure_kv(js, subjects.JOBS_KV, n, ttl=keep)
            await ensure_kv(js, subjects.JOB_STATUS_KV, n, ttl=keep)
            await ensure_kv(js, subjects.BATCHES_KV, n, ttl=keep)
            await ensure_files(js, n[0], keep[0])
            return
        except (asyncio.TimeoutError, nats.errors.NoRespondersError, NotFoundError, ServiceUnavailableError) as exc:
            # JetStream not ready yet (server just started, or reconnecting; a cluster
            # still electing its meta leader). A user that may not create streams (the
            # submitter) also waits here until a service has created them.
            log.info("waiting for jetstream", attempt=attempt, error=repr(exc))
            await asyncio.sleep(0.5)
        except APIError as exc:
            # E.g. "insufficient resources" while too few cluster peers are up for the
            # replicas: they are coming.
            refused = refusal(exc)
            log.warning("jetstream refused provisioning; retrying", attempt=attempt, error=refused)
            await asyncio.sleep(0.5)
    if refused:
        raise RuntimeError(f"JetStream refused the streams: {refused}")
    raise RuntimeError("JetStream did not become available" if create else
                       "the streams were not provisioned: run `prefixflow cluster provision` with admin credentials")


STORAGE_REFUSED = 10047
"""JetStream's error code for "insufficient storage resources available"."""


def refusal(exc: APIError) -> str:
    """What the server said (nats.py's `repr` of its errors is empty), and for storage what
    to do about it."""
    said = f"{exc.description or type(exc).__name__} (JetStream error {exc.err_code})"
    if exc.err_code == STORAGE_REFUSED:
        said += ("; the streams' size limits add up to more than the server's JetStream storage "
                 "(max_file_store: by default 75 % of the free disk where its store is): free disk "
                 "space there, or give the server a store on a larger disk")
    return said


async def pull_subscription(js: JetStreamContext, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
    await ensure_consumer(js, spec)
    return await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)


