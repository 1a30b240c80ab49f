"""Idempotent stream / consumer / key-value provisioning.

Every service calls `provision()` at start-up: creating what exists already is a no-op,
and a stream whose limits changed in `shared.wire.subjects` is updated in place. So
services can start in any order and a fresh nats-server needs no separate setup step.
"""

from __future__ import annotations

import asyncio

import nats
import structlog
from nats.js import JetStreamContext
from nats.js import api as js_api
from nats.js.errors import BadRequestError, NotFoundError

from shared.wire import subjects
from shared.wire.subjects import ConsumerSpec, StreamSpec

log = structlog.get_logger()


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


