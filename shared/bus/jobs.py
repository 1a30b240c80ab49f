"""Reading job specs from the jobs key-value bucket, with a short-lived cache."""

from __future__ import annotations

import time

import msgspec
from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from shared.wire.messages import JobSpec, job_spec_decoder


class JobLookup(msgspec.Struct):
    spec: JobSpec | None
    error: str | None = None
    """Why the job cannot run: unknown job, or a spec that fails validation (for example
    bad sampling parameters)."""


class JobCache:
    def __init__(self, kv: KeyValue, ttl: float = 10.0) -> None:
        self._kv = kv
        self._ttl = ttl
        self._entries: dict[str, tuple[float, JobLookup]] = {}

    async def get(self, job: str, *, fresh: bool = False) -> JobLookup:
        now = time.monotonic()
        hit = self._entries.get(job)
        if hit is not None and not fresh and now - hit[0] < self._ttl:
            return hit[1]
        try:
            entry = await self._kv.get(job)
            lookup = JobLookup(job_spec_decoder.decode(entry.value))
        except KeyNotFoundError:
            lookup = JobLookup(None, f"unknown job {job!r} (create it before publishing prompts)")
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            lookup = JobLookup(None, f"invalid job spec: {exc}")
        self._entries[job] = (now, lookup)
        if len(self._entries) > 10_000:  # bounded: forget the oldest
            for key in sorted(self._entries, key=lambda k: self._entries[k][0])[:1000]:
                del self._entries[key]
        return lookup
