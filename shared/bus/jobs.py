"""Reading job specs from the jobs key-value bucket, with a short-lived cache."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

import msgspec
import nats.errors
import structlog
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.wire.messages import JobLookup, job_spec_decoder

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

    async def _read(self, job: str) -> JobLookup:
        """The job's spec. A server that is away or restarting is waited for (with
        backoff), never mistaken for an unknown job and never fatal to the caller."""
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
                if attempt % 10 == 0:
                    log.warning("job spec lookup waiting for nats", job=job, error=repr(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        raise AssertionError("unreachable")
