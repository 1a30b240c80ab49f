"""NATS connection with reconnect, and idempotent stream / consumer / KV provisioning.

Every service calls `provision()` at start-up: creating what exists already is a no-op,
and a stream whose limits changed in `subjects.py` is updated in place. So services can
start in any order and a fresh nats-server needs no separate setup step.
"""

from __future__ import annotations

import asyncio

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, NotFoundError

from shared import subjects
from shared.subjects import ConsumerSpec, StreamSpec

log = structlog.get_logger()

last_reconnect = 0.0
"""Event-loop time of this process's last NATS reconnect (0: never)."""


async def connect(url: str, name: str, *, wait: float = 120.0) -> Client:
    """Connect, retrying for up to `wait` seconds until the server is up (services may
    start before nats-server); once connected, reconnect forever."""

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        global last_reconnect
        last_reconnect = asyncio.get_running_loop().time()
        log.info("nats reconnected")

    async def on_error(exc: Exception) -> None:
        log.debug("nats error", error=repr(exc))

    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            return await _connect_once(url, name, on_disconnect, on_reconnect, on_error)
        except (OSError, nats.errors.NoServersError, asyncio.TimeoutError) as exc:
            if asyncio.get_running_loop().time() > deadline:
                raise
            log.info("waiting for nats-server", url=url, error=repr(exc))
            await asyncio.sleep(0.5)


async def _connect_once(url, name, on_disconnect, on_reconnect, on_error) -> Client:
    return await nats.connect(
        servers=url.split(","),
        name=name,
        connect_timeout=2,
        reconnect_time_wait=0.5,
        max_reconnect_attempts=-1,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
    )


def stream_config(spec: StreamSpec) -> js_api.StreamConfig:
    return js_api.StreamConfig(
        name=spec.name,
        subjects=list(spec.subjects),
        retention=js_api.RetentionPolicy.WORK_QUEUE if spec.work_queue else js_api.RetentionPolicy.LIMITS,
        storage=js_api.StorageType.FILE,
        # Full work streams refuse new messages (backpressure); the dead-letter stream
        # drops its oldest instead, so poison can never block the pipeline.
        discard=js_api.DiscardPolicy.NEW if spec.work_queue else js_api.DiscardPolicy.OLD,
        max_bytes=spec.max_bytes,
        max_msgs=spec.max_msgs,
        max_msg_size=spec.max_msg_size,
        # Publishers set Nats-Msg-Id; the server drops a re-publish inside this window.
        duplicate_window=120.0,
    )


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> None:
    config = stream_config(spec)
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with other settings: bring it in line with subjects.py.
        await js.update_stream(config)


async def ensure_consumer(js: JetStreamContext, spec: ConsumerSpec) -> None:
    config = js_api.ConsumerConfig(
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=js_api.AckPolicy.EXPLICIT,
        deliver_policy=js_api.DeliverPolicy.ALL,
        ack_wait=spec.ack_wait,
        max_deliver=spec.max_deliver,
        max_ack_pending=spec.max_ack_pending,
        max_waiting=512,
    )
    try:
        await js.add_consumer(spec.stream, config)
    except BadRequestError:
        await js.delete_consumer(spec.stream, spec.durable)
        await js.add_consumer(spec.stream, config)


async def ensure_kv(js: JetStreamContext, bucket: str):
    try:
        return await js.key_value(bucket)
    except Exception:  # noqa: BLE001 - BucketNotFoundError and friends
        return await js.create_key_value(
            bucket=bucket, history=1, storage=js_api.StorageType.FILE, max_bytes=256 * 1024 * 1024
        )


async def provision(js: JetStreamContext) -> None:
    """Create (or update) every stream and KV bucket the project uses."""
    for attempt in range(60):
        try:
            for spec in subjects.STREAMS:
                await ensure_stream(js, spec)
            await ensure_kv(js, subjects.JOBS_KV)
            await ensure_kv(js, subjects.JOB_STATUS_KV)
            return
        except (asyncio.TimeoutError, nats.errors.NoRespondersError, NotFoundError) as exc:
            # JetStream not ready yet (server just started, or reconnecting).
            log.info("waiting for jetstream", attempt=attempt, error=repr(exc))
            await asyncio.sleep(0.5)
    raise RuntimeError("JetStream did not become available")


async def pull_subscription(js: JetStreamContext, spec: ConsumerSpec) -> JetStreamContext.PullSubscription:
    await ensure_consumer(js, spec)
    return await js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)


async def close(nc: Client, *subs) -> None:
    """Unsubscribe pull subscriptions, then drain. (nats.py's drain waits its full
    timeout on an open pull subscription, which would blow the 5 s stop window.)"""
    for sub in subs:
        try:
            await sub.unsubscribe()
        except Exception:  # noqa: BLE001 - already closed
            pass
    try:
        await asyncio.wait_for(nc.drain(), 2.0)
    except Exception:  # noqa: BLE001 - drain timed out or connection gone: just close
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - nothing left to close
            pass


class DurablePull:
    """A pull subscription on a durable consumer that re-creates and re-binds the
    consumer if it disappears (the router takes over a dead replica's consumer by
    re-creating it; a worker that was only paused then simply binds again)."""

    STALL_CHECK = 5.0
    """Seconds of empty fetches after which the consumer is asked whether it has work."""

    def __init__(self, js: JetStreamContext, spec: ConsumerSpec) -> None:
        self.js, self.spec = js, spec
        self.sub: JetStreamContext.PullSubscription | None = None
        self.empty_since: float | None = None

    async def fetch(self, batch: int, timeout: float) -> list:
        from shared.runtime import fetch

        try:
            if self.sub is None:
                self.sub = await asyncio.wait_for(pull_subscription(self.js, self.spec), 10.0)
            # NOTE: a fetch in flight across a reconnect can outlive its own timeout;
            # a hard deadline turns that hang into a re-bind.
            msgs = await asyncio.wait_for(fetch(self.sub, batch, timeout), timeout + 5.0)
            await self._watchdog(bool(msgs))
            return msgs
        except (NotFoundError, BadRequestError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("consumer lost; re-binding", consumer=self.spec.durable, error=repr(exc))
            await self.unsubscribe()
            await asyncio.sleep(0.5)
            return []

    async def _watchdog(self, got: bool) -> None:
        """Self-heal a subscription that stopped receiving (seen after a nats-server
        restart under load): nothing for STALL_CHECK seconds while the consumer holds
        deliverable messages means re-bind."""
        now = asyncio.get_running_loop().time()
        if got:
            self.empty_since = None
            return
        if self.empty_since is None:
            self.empty_since = now
            return
        if now - self.empty_since < self.STALL_CHECK:
            return
        self.empty_since = now
        info = await self.js.consumer_info(self.spec.stream, self.spec.durable)
        if info.num_pending > 0:
            log.warning("consumer has work but nothing arrives: re-binding", consumer=self.spec.durable, pending=info.num_pending)
            await self.unsubscribe()

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.sub = None
