"""Pulling from durable consumers: fetch that does not wait out its timeout once a burst
starts, a subscription that re-binds itself, and keeping long-held messages leased."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from prefixflow.shared.bus.provision import pull_subscription
from prefixflow.shared.process import metrics
from prefixflow.shared.wire.subjects import ConsumerSpec

log = structlog.get_logger()


async def fetch(sub: JetStreamContext.PullSubscription, batch: int, timeout: float) -> list:
    """Pull up to `batch` messages; [] when none arrived within `timeout`.

    NOTE: nats.py's `fetch(batch, timeout)`, once a long poll delivers its first message,
    waits out the rest of `timeout` for the remaining batch, adding up to `timeout` of
    latency at every stage whenever a burst starts. So: long-poll for one message, then
    take whatever else is already there (a no-wait drain)."""
    try:
        msgs = await sub.fetch(1, timeout=timeout)
    except (nats.errors.TimeoutError, asyncio.TimeoutError):
        return []
    if batch > 1:
        # When nothing else is there this still polls for DRAIN_WAIT: keep it tiny, as a
        # stage that keeps up with its input pays it on every message.
        try:
            msgs += await sub.fetch(batch - 1, timeout=DRAIN_WAIT)
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            pass
    return msgs


DRAIN_WAIT = 0.002


class DurablePull:
    """A pull subscription on a durable consumer that re-creates and re-binds the
    consumer if it disappears (the router takes over a dead replica's consumer by
    re-creating it; a worker that was only paused then simply binds again)."""

    STALL_CHECK = 5.0
    """Seconds of empty fetches after which the consumer is asked whether it has work."""

    def __init__(self, js: JetStreamContext, spec: ConsumerSpec, label: str = "") -> None:
        """`label`: the metrics' consumer label (default the durable name; per-job consumers
        share their node's, so metric series stay bounded)."""
        self.js, self.spec = js, spec
        self.sub: JetStreamContext.PullSubscription | None = None
        self.empty_since: float | None = None
        label = label or spec.durable
        self._fetched = metrics.CONSUMER_FETCHED.labels(label)
        self._redelivered = metrics.CONSUMER_REDELIVERED.labels(label)
        self._pending = metrics.CONSUMER_PENDING.labels(label)

    async def fetch(self, batch: int, timeout: float) -> list:
        try:
            if self.sub is None:
                self.sub = await asyncio.wait_for(pull_subscription(self.js, self.spec), 10.0)
            # NOTE: a fetch in flight across a reconnect can outlive its own timeout;
            # a hard deadline turns that hang into a re-bind.
            msgs = await asyncio.wait_for(fetch(self.sub, batch, timeout), timeout + 5.0)
            await self._watchdog(bool(msgs))
            if msgs:
                self._count(msgs)
            return msgs
        except (NotFoundError, BadRequestError, nats.errors.Error, asyncio.TimeoutError) as exc:
            log.warning("consumer lost; re-binding", consumer=self.spec.durable, error=repr(exc))
            await self.unsubscribe()
            await asyncio.sleep(0.5)
            return []

    def _count(self, msgs: list) -> None:
        """Metrics of a fetch: messages, redeliveries, and the queue depth behind them
        (an empty fetch says nothing: the consumer may be at its max_ack_pending)."""
        self._fetched.inc(len(msgs))
        again = sum(1 for msg in msgs if msg.metadata.num_delivered > 1)
        self._pending.set(msgs[-1].metadata.num_pending)
        if again:
            self._redelivered.inc(again)

    async def _watchdog(self, got: bool) -> None:
        """Self-heal a consumer that stopped delivering. After STALL_CHECK seconds of
        empty fetches:
        1. the consumer holds deliverable messages but nothing arrives (seen after a
           nats-server restart under load): re-bind the subscription;
        2. the consumer has nothing pending or unacked, yet its stream still holds
           messages on its subject (seen after nats-server was SIGKILLed: the consumer's
           state had moved past messages the stream kept): re-create the consumer, which
           delivers them again (on a work queue every message left is unprocessed or a
           duplicate the sink drops)."""
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
            return
        if info.num_ack_pending:
            return
        stream = await self.js.stream_info(self.spec.stream, subjects_filter=self.spec.filter_subject)
        left = sum((stream.state.subjects or {}).values()) if stream.state.subjects else 0
        if left:
            log.warning("stream holds messages the consumer will not deliver: re-creating it",
                        consumer=self.spec.durable, messages=left)
            await self.unsubscribe()
            await self.js.delete_consumer(self.spec.stream, self.spec.durable)

    async def unsubscribe(self) -> None:
        if self.sub is not None:
            try:
                await self.sub.unsubscribe()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.sub = None


async def keep_in_progress(msgs_fn: Callable[[], list], interval: float, stop: asyncio.Event) -> None:
    """Tell the server every `interval` seconds that the messages from `msgs_fn()` are
    still being worked on, so a long generation is not redelivered elsewhere."""
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except asyncio.TimeoutError:
            pass
        for m in list(msgs_fn()):
            try:
                await m.in_progress()
            except Exception:  # noqa: BLE001 - connection blips: the next round retries
                pass
