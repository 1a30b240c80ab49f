"""What the sink does at the job boundary: a job refused or failed, and a fault on one
job's path turned into failing that job, or retrying its messages.

A bad job fails alone. Every exception on one job's path (opening and binding its
directory, reading its parts back, writing a part, finishing it, its key-value records)
ends here (`Failures.job_fault`, kinds in `prefixflow/services/sink/boundary.py`): a fault of the
job's own fails that job (`fail_job`: the reason in its status, its messages acked); a
missing resource (disk full, read-only, no permission) pauses it (`prefixflow/services/sink/pause.py`:
its messages parked until it resumes); NATS being away retries its messages (that delivery
not counted toward poison); the sink and every other job go on. A failed or refused job is remembered
(`refused`): its results are dropped as they come, until a new spec of it is written.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import structlog
from nats.aio.msg import Msg

from prefixflow.services.sink import boundary
from prefixflow.services.sink.boundary import Fault
from prefixflow.services.sink.held import Held
from prefixflow.services.sink.lifecycle import Reconciler
from prefixflow.services.sink.pause import Pauses
from prefixflow.shared.bus.provision import job_retention
from prefixflow.shared.wire import messages as m

log = structlog.get_logger()

TRANSPORT_RETRY = 1.0
"""Seconds before the messages of a job whose path met NATS away are delivered again."""
MAX_REFUSED_JOBS = 10_000
"""Refused jobs remembered (their results are dropped at once); the oldest are forgotten
first (and refused again, from their spec, if more of their results arrive)."""


class Failures:
    """Refused and failed jobs, and the job boundary's handling of a fault on a job's path."""

    def __init__(
        self, reconciler: Reconciler, forget: Callable[[str], list[Held]],
        put_status: Callable[[str, bytes], Awaitable[object]],
    ) -> None:
        self.refused: OrderedDict[str, str] = OrderedDict()
        """Jobs whose out_dir is outside the root or bound to another job, or that failed
        -> why (their results are dropped). A new spec of the job clears its entry
        (`spec_written`: checked again)."""
        self.reconciler = reconciler
        self.forget = forget
        """Drops what the sink holds of a job (its open output, queued rows, progress) and
        gives its held messages, for the failure to settle."""
        self.put_status = put_status
        """Stores a job's encoded status in the status bucket."""
        self.pauses: Pauses | None = None
        """Paused jobs (set once the sink is connected)."""

    def spec_written(self, job: str) -> None:
        """A spec of `job` was written (the jobs watch): a refusal is decided again."""
        self.refused.pop(job, None)

    def remember_failed(self, job: str, why: str) -> None:
        """`job` failed before (its status says so): drop its results from now on
        (`refused`), its status unchanged."""
        self.reconciler.forget(job)
        self.refused[job] = why
        while len(self.refused) > MAX_REFUSED_JOBS:
            self.refused.popitem(last=False)

    async def refuse(self, job: str, why: str) -> None:
        """Mark `job` failed (its out_dir escapes the root, or another job owns it); its
        results get dropped."""
        log.error("job refused", job=job, error=why)
        now = time.time()
        status = m.JobStatus(job, updated_at=now, failed=True, error=why, expires_at=now + job_retention())
        try:
            await self.put_status(job, m.encode_json(status))
        except Exception as exc:  # noqa: BLE001 - not remembered: the next result tries again
            log.warning("status update failed", job=job, error=repr(exc))
            return
        self.remember_failed(job, why)

    async def fail_job(self, job: str, why: str, msgs: list[Msg] = ()) -> None:
        """Fail `job` with `why` in its status and drop what the sink holds of it: its open
        output, its queued rows, its held messages and `msgs` (the job's messages in hand),
        settled. From then on its results are dropped as they come (`refused`), until a new
        spec of the job is written. A failure that could not be recorded (the status put
        failed) naks them instead: redelivered, the job fails again then.

        NOTE: a failed job's messages are acked, not dead-lettered: they are sound results
        of a job that will not be written, not poison; the reason is in the job's status
        (once, not per message), and copying every row of a large job into the dead-letter
        stream (which keeps the newest 100,000 messages) would push out the real poison."""
        held = self.forget(job)
        await self.refuse(job, why)
        if job in self.refused:
            ends = [h.settle() for h in held] + [msg.ack() for msg in msgs]
        else:
            ends = [msg.nak(delay=5.0) for msg in [h.msg for h in held] + list(msgs)]
        await asyncio.gather(*ends, return_exceptions=True)

    async def job_fault(self, job: str, stage: str, exc: Exception, msgs: list[Msg]) -> None:
        """The job boundary: `exc` was raised on `job`'s path (`stage`: what the sink was
        doing, as the reason says it); `msgs`: that job's messages in hand, not held. The
        kinds are `boundary.classify`'s; nothing here raises."""
        match boundary.classify(exc):
            case Fault.RESOURCE:
                await self.wait_for_resources(job, exc, msgs)
            case Fault.TRANSPORT:
                log.warning("nats unavailable on a job's path; its messages are retried", job=job, stage=stage,
                            error=repr(exc))
                for msg in msgs:  # not the messages' fault: not counted toward poison
                    self.pauses.excused.add(msg)
                await asyncio.gather(*(msg.nak(delay=TRANSPORT_RETRY) for msg in msgs), return_exceptions=True)
            case Fault.JOB:
                log.exception("job failed at the sink", job=job, stage=stage, exc_info=exc)
                await self.fail_job(job, boundary.reason(stage, exc), msgs)

    async def wait_for_resources(self, job: str, exc: OSError, msgs: list[Msg]) -> None:
        """The job's output lacks a resource (disk full, quota, read-only file system, no
        permission: `boundary.RESOURCE_ERRNOS`). Not the job's fault, so it does not fail:
        it pauses (its status says why and where) and its messages are parked until it
        resumes (`prefixflow/services/sink/pause.py`); the sink goes on."""
        await self.pauses.pause(job, exc, msgs)
