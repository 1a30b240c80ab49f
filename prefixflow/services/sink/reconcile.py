"""Checking the sealed jobs that are due (`lifecycle.Reconciler` says which): a job not
done or failed and not open in the sink is opened from disk and checked, so it completes
even if the sink crashed before storing its done status, or forgot it (eviction)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import structlog
from nats.js.kv import KeyValue

from prefixflow.services.sink import lifecycle
from prefixflow.services.sink.failures import Failures
from prefixflow.shared.bus.jobs import JobCache

if TYPE_CHECKING:
    from prefixflow.services.sink.writer import JobOutput

log = structlog.get_logger()


class Checks(Protocol):
    """What checking due jobs needs of the sink (`prefixflow/services/sink/service.py`, `Sink`)."""

    reconciler: lifecycle.Reconciler
    outputs: Mapping[str, JobOutput]
    status_kv: KeyValue
    jobs: JobCache
    failures: Failures

    async def output(self, job: str, *, evict: bool = True) -> JobOutput | None: ...

    async def check_jobs(self, jobs: list[str] | None = None) -> None: ...


async def reconcile(sink: Checks) -> None:
    """Check the sealed jobs that are due; a job's fault ends at the job boundary."""
    for job, _ in sink.reconciler.take_expired(time.time()):
        sink.reconciler.due[job] = 0.0  # past its deadline: completes as expired (if not done)
    for job in sink.reconciler.take_due(time.monotonic()):
        if job in sink.outputs:
            continue  # open: check_jobs sees it every round
        try:
            await reconcile_job(sink, job)
        except Exception as exc:  # noqa: BLE001 - the job boundary: one job's fault never stops the sink
            await sink.failures.job_fault(job, "check the job", exc, [])


async def reconcile_job(sink: Checks, job: str) -> None:
    """`reconcile` for one due job."""
    try:
        known = await lifecycle.read_status(sink.status_kv, job)
    except lifecycle.StatusUnreadable as exc:
        log.warning("reconcile: status unreadable, checked again later", job=job, error=repr(exc.__cause__))
        return
    if known is not None and (known.done or known.failed):
        sink.reconciler.forget(job)
        return
    if (await sink.jobs.get(job, fresh=True)).spec is None:
        sink.reconciler.forget(job)  # expired, deleted or not runnable
        return
    if await sink.output(job) is None:
        return  # refused (forgotten by `Failures.refuse`), or gone
    log.info("reconcile: sealed job not done, checking it", job=job)
    await sink.check_jobs([job])
