"""A job's way to `done`, made durable: which sealed jobs still need completing, how an
empty job completes, what the done status carries, and the fault-test hooks.

A job is done only once its done status is in `PFX_JOB_STATUS` (the sink retries the put
every round until it succeeds). Before that the sink may crash or lose the job from its
open outputs; the `Reconciler` makes sure it is checked again: it watches the jobs bucket
(every existing spec first, then every change) and keeps each sealed job (`total` set) as
a candidate until its status says done or failed. A candidate the sink does not have open
is opened from disk and checked (completed if every row is there) when it is due.

Bounded: a candidate is a sealed spec in the jobs bucket, and specs expire
(`--job-retention`, the bucket's TTL; a deleted or purged spec leaves at once, an expired
one at its next check, when its spec is no longer found). Done and failed jobs leave at
their first check, so a freshly started sink reads each existing job's status once.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import structlog
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KV_DEL, KV_PURGE, KeyValue

from prefixflow.shared.outcomes import Exit
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

log = structlog.get_logger()

RECHECK_SECONDS = 30.0
"""A candidate not open in the sink is opened and checked at most this often (an open
one is checked every round anyway)."""
RECONCILE_PER_ROUND = 32
"""Candidates checked per round (each may read a status and open a job from disk), so a
sink that starts beside thousands of old jobs keeps writing parts meanwhile."""
EXIT_MARKER = ".pfx-exit-before-done"
"""`--exit-before-done` (a test hook) exits once per output root: it leaves this file there."""
EXIT_BEFORE_DONE_CODE = Exit.CRASH_HOOK
"""Exit code of the `--exit-before-done` hook (non-zero: the supervisor restarts the sink;
not 75, which says paused)."""


class Reconciler:
    """Sealed jobs that may still need completing -> when to check each next (monotonic)."""

    def __init__(self) -> None:
        self.due: dict[str, float] = {}
        self.expiring: dict[str, float] = {}
        """Jobs with a deadline (`JobSpec.expires_at`, Unix time), not cancelled: each is
        checked once its deadline passes (it then completes as expired, unless done)."""
        self.caught_up = False
        """The watch has delivered every spec that existed when it started."""

    def __len__(self) -> int:
        return len(self.due)

    def __contains__(self, job: str) -> bool:
        return job in self.due

    def note(self, key: str, value: bytes, op: str | None) -> str | None:
        """A change of the jobs bucket; returns the job whose spec was written, if any."""
        if subjects.is_dir_key(key):
            return None  # an output directory's binding (the client's), not a job
        if subjects.job_id_error(key) is not None:
            return None  # a key written by hand, outside the job-id grammar: no job runs under it
        if op in (KV_DEL, KV_PURGE):
            self.forget(key)
            return None
        try:
            spec = m.job_spec_decoder.decode(value)
        except (msgspec.ValidationError, msgspec.DecodeError):
            self.forget(key)  # cannot run: the ingestor fails it
            return None
        if spec.expires_at and not spec.cancelled_at:
            self.expiring[key] = spec.expires_at
        else:
            self.expiring.pop(key, None)
        if spec.total is None and not spec.cancelled_at:
            self.due.pop(key, None)  # (re)created, not sealed yet
        else:
            self.due[key] = 0.0  # sealed (again) or cancelled: check it now
        return key

    def take_due(self, now: float, limit: int = RECONCILE_PER_ROUND) -> list[str]:
        """Up to `limit` candidates due for a check; each is pushed back by RECHECK_SECONDS
        (`forget` drops it once its job is done, failed or gone)."""
        jobs = []
        for job, at in self.due.items():
            if at <= now:
                jobs.append(job)
                if len(jobs) >= limit:
                    break
        for job in jobs:
            self.due[job] = now + RECHECK_SECONDS
        return jobs

    def forget(self, job: str) -> None:
        self.due.pop(job, None)
        self.expiring.pop(job, None)

    def take_expired(self, now: float, limit: int = RECONCILE_PER_ROUND) -> list[tuple[str, float]]:
        """Up to `limit` jobs whose deadline has passed (Unix time `now`), with it; each
        leaves the list (the caller makes it due for a check: it completes as expired)."""
        jobs = [(job, at) for job, at in self.expiring.items() if at <= now][:limit]
        for job, _ in jobs:
            del self.expiring[job]
        return jobs

    async def watch(self, kv: KeyValue, stop: asyncio.Event, on_spec: Callable[[str], None]) -> None:
        """Follow the jobs bucket until `stop`: every existing spec first, then changes.
        `on_spec(job)` runs for every spec written."""
        watcher = await kv.watchall()
        seen = 0
        try:
            while not stop.is_set():
                try:
                    entry = await watcher.updates(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                if entry is None:  # the initial values are all delivered
                    self.caught_up = True
                    log.info("jobs watch caught up", specs=seen, sealed_to_check=len(self.due))
                    continue
                seen += 1
                job = self.note(entry.key, entry.value or b"", entry.operation)
                if job is not None:
                    on_spec(job)
        finally:
            try:
                await watcher.stop()
            except nats.errors.Error:
                pass  # the connection is closing anyway


CANCEL_SETTLE = 3.0
"""Seconds a cancelled job must go without a new row (and since it was cancelled) before
the sink completes it as cancelled: the prompts already in engines land first."""


def complete(spec: m.JobSpec, rows: int, pending: bool, quiet_for: float, now: float) -> bool:
    """Is the job complete: sealed with every row on disk, or cancelled (or expired) and
    settled (`quiet_for`: seconds since its last row arrived here)?"""
    if pending:
        return False
    if spec.total is not None and rows >= spec.total:
        return True
    ended = spec.ended_at(now)
    return bool(ended) and now - ended >= CANCEL_SETTLE and quiet_for >= CANCEL_SETTLE


class StatusUnreadable(Exception):
    """A job's status could not be read now (its cause says why): try again later."""


async def read_status(kv: KeyValue, job: str) -> m.JobStatus | None:
    """The job's stored status; None if it has none."""
    try:
        entry = await kv.get(job)
        return m.job_status_decoder.decode(entry.value)
    except KeyNotFoundError:
        return None
    except (nats.errors.Error, asyncio.TimeoutError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise StatusUnreadable(job) from exc


def status_summary(summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The summary as the status carries it: without per-replica totals (a status stays
    small whatever the fleet; `_summary.json` keeps them)."""
    if summary is None:
        return None
    return {k: v for k, v in summary.items() if k != "replicas"}


def claim_exit(root: Path) -> bool:
    """`--exit-before-done` (test hook): True the first time for this output root (it
    leaves `EXIT_MARKER` there), False after."""
    marker = root / EXIT_MARKER
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    os.write(fd, f"{time.time()}\n".encode())
    os.fsync(fd)
    os.close(fd)
    return True


def exit_now(job: str) -> None:
    """End the process at once, as a crash would (no cleanup, nothing more written)."""
    log.warning("test hook: exiting before the job completes (--exit-before-done)", job=job, code=EXIT_BEFORE_DONE_CODE)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_BEFORE_DONE_CODE)


class DonePutFault(Exception):
    """A done-status put failed on purpose (`--fail-done-puts`, a test hook)."""


class Faults:
    """The sink's fault-test hooks (`SinkConfig.fail_done_puts`, `exit_before_done`)."""

    def __init__(self, fail_done_puts: int, exit_before_done: bool) -> None:
        self.fail_done_puts = fail_done_puts
        self.exit_before_done = exit_before_done

    def before_done_put(self, job: str) -> None:
        if self.fail_done_puts > 0:
            self.fail_done_puts -= 1
            raise DonePutFault(f"test hook: done-status put of {job} fails (--fail-done-puts)")
