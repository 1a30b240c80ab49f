"""A job's submitter believes a cancel notice only when the job's spec says cancelled
(`prefixflow.shared.bus.jobs.follow_cancel`, issue 40): a notice on its subject that the spec
does not confirm, one naming another job, one that does not decode, or one for a job
that is gone changes nothing; a confirmed one stops the job, whatever its body says of
who sent it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nats.js.errors import KeyNotFoundError

from prefixflow.shared.bus.jobs import follow_cancel
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

JOB = "alice.nightly"


class SpecKV:
    """The jobs bucket, one spec (None: no such key)."""

    def __init__(self, spec: m.JobSpec | None) -> None:
        self.spec, self.reads = spec, 0

    async def get(self, key: str):
        self.reads += 1
        if self.spec is None or key != self.spec.job:
            raise KeyNotFoundError
        return SimpleNamespace(value=m.encode_json(self.spec))


class OneSubscription:
    """A connection that records its one subscription (subject, callback)."""

    async def subscribe(self, subject: str, cb, **limits):
        self.subject, self.cb, self.limits = subject, cb, limits
        return self

    async def deliver(self, data: bytes, subject: str | None = None) -> None:
        await self.cb(SimpleNamespace(subject=subject or self.subject, data=data))


def follow(spec: m.JobSpec | None) -> tuple[OneSubscription, SpecKV, list[m.JobSpec]]:
    nc, kv, seen = OneSubscription(), SpecKV(spec), []
    asyncio.run(follow_cancel(nc, kv, JOB, seen.append))
    return nc, kv, seen


def notice(job: str = JOB, by: str = "tenant-bob") -> bytes:
    return m.encode(m.CancelNotice(job, by, 1.0))


def test_only_the_jobs_own_subject_is_followed():
    nc, _, _ = follow(None)
    assert nc.subject == subjects.job_cancelled(JOB) == "pfx.jobs.cancelled.alice.nightly"
    assert nc.limits["pending_msgs_limit"] > 0 and nc.limits["pending_bytes_limit"] > 0, "a bounded backlog"


def test_a_notice_the_spec_does_not_confirm_is_ignored():
    running = m.JobSpec(JOB, "/out/alice/n")
    nc, kv, seen = follow(running)
    for data in (notice(), notice(by="tenant-alice"), notice("bob.nightly"), notice("nightly"), b"\xc1 not msgpack",
                 m.encode(m.CancelNotice(""))):
        asyncio.run(nc.deliver(data))
    assert seen == []
    assert kv.reads == 2, "only the notices naming the job read its spec"


def test_a_confirmed_notice_stops_the_job():
    cancelled = m.JobSpec(JOB, "/out/alice/n", cancelled_at=5.0, cancelled_by="tenant-alice")
    nc, _, seen = follow(cancelled)
    asyncio.run(nc.deliver(notice("bob.other")))
    assert seen == []
    asyncio.run(nc.deliver(notice(by="someone else")))  # the spec is the record, not the body
    assert seen == [cancelled]


def test_a_notice_of_a_job_that_is_gone_is_ignored():
    nc, kv, seen = follow(None)
    asyncio.run(nc.deliver(notice()))
    assert seen == [] and kv.reads == 1
