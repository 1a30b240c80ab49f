"""The engine's KV events, received and translated: a ZMQ SUB socket on the publisher vLLM
starts inside its engine-core process when `kv_events_config` is on, feeding a
`kv_events.KeyTranslator`. The I/O half of `kv_events.py`.

The worker gives its engine `--kv-events-config` (`events_config`) with an `ipc://`
endpoint of its own (the engine core binds it; several replicas on one machine do not
collide), and runs a `CacheEventForwarder`: it sends the key events to the router as
`messages.CacheEvents`, gathered over `interval` seconds (one engine step publishes
one batch; a few per message keep the router's work and the message count low).

Delivery: ZMQ PUB drops messages only past its high-water mark (100 000 batches by
default), so on one machine nothing is lost unless this side stalls. Every batch carries
the publisher's sequence number; a jump is counted in `gaps` (the model may then hold
keys the engine lost, until the router's bound evicts them, or lack keys it gained).
A sequence number going back means a new publisher (the engine was rebuilt): the
translator starts over and a CLEARED event says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import msgspec
import structlog
import zmq
import zmq.asyncio

from prefixflow.services.engine_worker.kv_events import BATCH_DECODER, KeyEvent, KeyTranslator
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.messages import CacheOp

log = structlog.get_logger()

TOPIC = "kv"


def ipc_endpoint(directory: str | Path, replica: str) -> str:
    """An IPC endpoint of this worker process (a socket file in `directory`): replicas,
    and clusters, on one machine do not collide."""
    return f"ipc://{Path(directory).resolve() / f'pfx-kv-{replica}-{os.getpid()}.sock'}"


def events_config(endpoint: str, topic: str = TOPIC) -> str:
    """vLLM's `--kv-events-config` value: the ZMQ publisher on `endpoint`."""
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": topic})


@dataclass
class KeyBatch:
    """One engine step's events, in our keys."""

    seq: int
    """The publisher's sequence number."""
    ts: float
    """When the engine published it (its wall clock, `time.time()`)."""
    received: float
    """When it was received here (`time.time()`)."""
    events: list[KeyEvent]


class KvEventSubscriber:
    """Receives one engine's KV event batches and translates them (see the module doc)."""

    def __init__(self, endpoint: str, translator: KeyTranslator, topic: str = TOPIC) -> None:
        self.endpoint = endpoint
        self.translator = translator
        self.topic = topic
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._last_seq: int | None = None
        self.batches_received = 0
        self.gaps = 0
        """Batches missed (sequence numbers skipped)."""
        self.restarts = 0
        """Times the sequence went back (a new publisher)."""
        self.undecodable = 0

    def connect(self) -> None:
        """Connect (before the engine binds is fine: ZMQ retries until it is there)."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sock.connect(self.endpoint)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def __aenter__(self) -> Self:
        self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    async def batches(self) -> AsyncIterator[KeyBatch]:
        """Translated batches, as they arrive (including empty ones, for their timing)."""
        if self._sock is None:
            self.connect()
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            received = time.time()
            if len(frames) != 3:
                self.undecodable += 1
                continue
            _, seq_bytes, payload = frames
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            try:
                batch = BATCH_DECODER.decode(payload)
            except msgspec.DecodeError:
                self.undecodable += 1
                log.warning("undecodable kv event batch", seq=seq)
                continue
            events: list[KeyEvent] = []
            if self._last_seq is not None and seq <= self._last_seq:
                self.restarts += 1
                self.translator.reset()
                events.append((CacheOp.CLEARED, []))
            elif seq != (self._last_seq if self._last_seq is not None else -1) + 1:
                missed = seq - (self._last_seq if self._last_seq is not None else -1) - 1
                self.gaps += missed
                log.warning("kv event batches missed", missed=missed, seq=seq)
            self._last_seq = seq
            self.batches_received += 1
            events += self.translator.apply(batch.events)
            yield KeyBatch(seq, batch.ts, received, events)


MAX_KEYS_PER_MESSAGE = 32_768
"""About 300 KiB of msgpack: under `messages.MAX_MESSAGE_BYTES`."""


class CacheEventForwarder:
    """Sends a replica's translated KV events to the router in `CacheEvents` batches.

    `publish` sends one encoded message (the worker passes its NATS connection's
    `publish` on `subjects.cache_events(replica)`): this module needs no NATS."""

    def __init__(
        self, replica: str, subscriber: KvEventSubscriber, publish: Callable[[bytes], Awaitable[None]], interval: float = 0.05
    ) -> None:
        self.replica = replica
        self.subscriber = subscriber
        self.publish = publish
        self.interval = interval
        self.epoch = uuid.uuid4().hex[:12]
        self.seq = 0
        self._pending: list[KeyEvent] = [(CacheOp.CLEARED, [])]
        """Ops not sent yet; a new epoch starts from nothing held."""
        self.sent_messages = 0
        self.sent_keys = 0

    def cleared(self) -> None:
        """The worker reset the engine's prefix cache. vLLM queues its AllBlocksCleared
        until the engine's next step, so the router would go on believing in the old
        blocks until then: say it now."""
        self.subscriber.translator.reset()
        self._add([(CacheOp.CLEARED, [])])

    async def run(self, finished: asyncio.Event | None = None) -> None:
        """Receive and send until `finished` is set (or until cancelled). A failure of
        the receiver is raised here."""
        finished = finished or asyncio.Event()
        receiver = asyncio.create_task(self._receive())
        try:
            while not finished.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(finished.wait(), self.interval)
                if receiver.done():
                    receiver.result()
                await self.flush()
        finally:
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await receiver

    async def _receive(self) -> None:
        async for batch in self.subscriber.batches():
            self._add(batch.events)

    def _add(self, events: list[KeyEvent]) -> None:
        pending = self._pending
        for op, keys in events:
            if op is CacheOp.CLEARED:
                pending.clear()  # everything before it is moot
                pending.append((op, []))
            elif pending and pending[-1][0] is op:
                pending[-1][1].extend(keys)
            else:
                pending.append((op, list(keys)))

    async def flush(self) -> None:
        """Send the pending ops (cut into messages of at most MAX_KEYS_PER_MESSAGE keys)."""
        while self._pending:
            ops, n = [], 0
            while self._pending and n < MAX_KEYS_PER_MESSAGE:
                op, keys = self._pending[0]
                room = MAX_KEYS_PER_MESSAGE - n
                if len(keys) > room:
                    ops.append((op, keys[:room]))
                    del keys[:room]
                    n += room
                    break
                ops.append(self._pending.pop(0))
                n += len(keys)
            msg = m.CacheEvents(self.replica, self.epoch, self.seq, ops, time.time())
            self.seq += 1
            await self.publish(m.encode(msg))
            self.sent_messages += 1
            self.sent_keys += n
