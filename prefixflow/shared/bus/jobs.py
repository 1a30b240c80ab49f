"""Job specs in the jobs key-value bucket: reading them with a short-lived cache that a
cancel notice (`subjects.job_cancelled`) clears at once (`JobCache.follow_cancels`);
cancelling and sealing a job, each a compare-and-set on the spec's revision so neither
undoes the other (a client sealing a job as it is cancelled sees the cancellation); a
client following its own job's cancel notices (`follow_cancel`).

A notice is a hint, never the truth: anyone the grants let publish on a job's subject
(its tenant, the batch service, an operator; anyone on a cluster without auth) can send
one. Every receiver reads the spec again and acts on its `cancelled_at` alone, so a
notice the spec does not confirm costs one read and changes nothing."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import nats.errors
import structlog
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from prefixflow.shared.bus.connection import SHUTDOWN
from prefixflow.shared.bus.kv_keys import bound
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.messages import JobLookup, job_spec_decoder

log = structlog.get_logger()

MAX_CACHED_JOBS = 10_000


class JobCache:
    def __init__(self, kv: KeyValue, ttl: float = 10.0, max_jobs: int = MAX_CACHED_JOBS) -> None:
        self._kv = kv
        self._ttl = ttl
        self._max_jobs = max_jobs
        self._entries: OrderedDict[str, tuple[float, JobLookup]] = OrderedDict()

    async def get(self, job: str, *, fresh: bool = False) -> JobLookup:
        now = time.monotonic()
        hit = self._entries.get(job)
        if hit is not None and not fresh and now - hit[0] < self._ttl:
            return hit[1]
        lookup = await self._read(job)
        self._entries.pop(job, None)
        self._entries[job] = (now, lookup)
        while len(self._entries) > self._max_jobs:  # bounded: forget the least recently read
            self._entries.popitem(last=False)
        return lookup

    def forget(self, job: str) -> None:
        """Read the job's spec afresh next time (it changed: cancelled)."""
        self._entries.pop(job, None)

    async def follow_cancels(self, nc) -> object:
        """Forget a job's cached spec as soon as it is cancelled (a core subscription to
        every job's notices, `subjects.ALL_JOB_CANCELLED`; returns it): the next lookup
        reads the spec, which says whether it is. A missed notice costs at most the TTL;
        a false one, a read."""

        async def on_cancel(msg) -> None:
            self.forget(subjects.job_of_cancel(msg.subject))

        return await nc.subscribe(subjects.ALL_JOB_CANCELLED, cb=on_cancel)

    async def _read(self, job: str) -> JobLookup:
        """The job's spec. A server that is away or restarting is waited for (with
        backoff), never mistaken for an unknown job and never fatal to the caller; once
        the service is stopping (`SHUTDOWN` set) the wait ends with NATS's error. A job
        id outside the grammar (`subjects.job_id_error`: it came from a raw subject or a
        foreign body) is never looked up (the bucket would refuse the key): no such job."""
        if (why := subjects.job_id_error(job)) is not None:
            return JobLookup(None, why, exists=False)
        delay = 0.1
        for attempt in range(1_000_000):
            try:
                entry = await self._kv.get(job)
                return JobLookup(job_spec_decoder.decode(entry.value))
            except KeyNotFoundError:
                return JobLookup(None, f"unknown job {job!r} (create it before publishing prompts)", exists=False)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                return JobLookup(None, f"invalid job spec: {exc}")
            except (nats.errors.TimeoutError, asyncio.TimeoutError, nats.errors.ConnectionClosedError,
                    nats.errors.NoRespondersError) as exc:
                if (stop := SHUTDOWN.get()) is not None and stop.is_set():
                    # Stopping (SIGTERM) with NATS away: waiting on would hold the shutdown
                    # for good. The caller meets a transport fault (nothing acked: redelivered).
                    raise
                if attempt % 10 == 0:
                    log.warning("job spec lookup waiting for nats", job=job, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")


class UnknownJob(Exception):
    """No spec of this job in the cluster (never submitted, or expired)."""


async def cancel_job(js, nc, job: str, *, by: str, at: float | None = None) -> tuple[m.JobSpec, bool]:
    """Mark `job` cancelled by `by` (`JobSpec.cancelled_by`) at `at` (default now), then
    announce it on the job's own subject: (its spec, True if this call cancelled it; False
    if it was cancelled already). Raises `UnknownJob`."""
    kv = bound(js, subjects.JOBS_KV)
    while True:
        try:
            entry = await kv.get(job)
        except KeyNotFoundError:
            raise UnknownJob(job) from None
        spec = m.job_spec_decoder.decode(entry.value)
        if spec.cancelled_at:
            return spec, False
        cancelled = msgspec.structs.replace(spec, cancelled_at=at or time.time(), cancelled_by=by)
        try:
            await kv.update(job, m.encode_json(cancelled), last=entry.revision)
        except KeyWrongLastSequenceError:
            continue  # written meanwhile (sealed): read it again
        notice = m.CancelNotice(job, by, cancelled.cancelled_at)
        await nc.publish(subjects.job_cancelled(job), m.encode(notice))
        return cancelled, True


IGNORED_LOG_EVERY = 1.0
NOTICE_BACKLOG = 1024
"""Notices a job's follower holds unread (more are dropped by nats.py: any later one reads
the spec again, which is what a notice is for)."""
"""Seconds between two log lines about ignored cancel notices (a flood is one line a second)."""


async def follow_cancel(nc, kv: KeyValue, job: str, on_cancelled: Callable[[m.JobSpec], None]) -> object:
    """Call `on_cancelled(spec)` when `job` is cancelled: a core subscription to the job's
    own notices (`subjects.job_cancelled(job)`, which its submitter's grant covers; returns
    it). Each notice is checked against the job's spec, read again: a notice that names
    another job, or that the spec does not confirm (`cancelled_at` unset: a spoof, or a
    stale notice of an earlier job of that id), is logged and ignored. Notices are handled
    one at a time (nats.py's per-subscription task), so a flood costs one read each and its
    backlog is bounded by the subscription's pending limits; the ignored ones are logged at
    most once per `IGNORED_LOG_EVERY` seconds, with their count."""
    ignored = {"count": 0, "logged_at": 0.0}

    async def on_notice(msg) -> None:
        try:
            notice = m.cancel_notice_decoder.decode(msg.data)
        except msgspec.DecodeError:
            notice = m.CancelNotice("")
        spec = None
        if notice.job == job == subjects.job_of_cancel(msg.subject):
            try:
                spec = job_spec_decoder.decode((await kv.get(job)).value)
            except (KeyNotFoundError, msgspec.DecodeError):
                spec = None
            except nats.errors.Error as exc:
                # NOTE: server away: unconfirmed. A real cancel still ends the job: its seal
                # (a compare-and-set) sees it, and its status says so.
                log.warning("cancel notice: job spec unreadable", job=job, error=repr(exc))
        if spec is None or not spec.cancelled_at:
            ignored["count"] += 1
            if (now := time.monotonic()) - ignored["logged_at"] >= IGNORED_LOG_EVERY:
                log.warning("ignored a cancel notice its job's spec does not confirm", job=job, ignored=ignored["count"],
                            notice_job=notice.job, by=notice.by, subject=msg.subject)
                ignored["logged_at"] = now
            return
        log.info("job cancelled", job=job, by=spec.cancelled_by or notice.by)
        on_cancelled(spec)

    return await nc.subscribe(subjects.job_cancelled(job), cb=on_notice, pending_msgs_limit=NOTICE_BACKLOG,
                              pending_bytes_limit=NOTICE_BACKLOG * 1024)


async def seal(js, spec: m.JobSpec, total: int, planned_output_tokens: int = 0) -> m.JobSpec:
    """Seal `spec.job` with `total` rows (and their output budget `planned_output_tokens`,
    for the ETA), unless it was cancelled meanwhile (then its cancelled spec is returned,
    unsealed). A compare-and-set: never undoes a cancel."""
    kv = bound(js, subjects.JOBS_KV)
    while True:
        try:
            entry = await kv.get(spec.job)
            current = m.job_spec_decoder.decode(entry.value)
        except KeyNotFoundError:  # expired or deleted meanwhile: write it whole
            sealed = msgspec.structs.replace(spec, total=total, planned_output_tokens=planned_output_tokens)
            await kv.put(spec.job, m.encode_json(sealed))
            return sealed
        if current.cancelled_at:
            return current
        sealed = msgspec.structs.replace(current, total=total, planned_output_tokens=planned_output_tokens)
        try:
            await kv.update(spec.job, m.encode_json(sealed), last=entry.revision)
            return sealed
        except KeyWrongLastSequenceError:
            continue
