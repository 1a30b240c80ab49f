"""The sink's job boundary: what an exception on one job's path means. No I/O here.

Everything the sink does for one job (open and bind its output directory, read its parts
back, write a part, merge, write its summary, read or write its records in the key-value
buckets) may raise. The exception ends at the job boundary (`Failures.job_fault` in
`prefixflow/services/sink/failures.py`), never in the sink's task group, and is one of three kinds:

| kind        | examples                                            | what happens                      |
|-------------|-----------------------------------------------------|-----------------------------------|
| `RESOURCE`  | ENOSPC, EDQUOT, EROFS, EACCES                       | the job pauses: its messages are  |
|             |                                                     | parked until it resumes (pause.py)|
| `TRANSPORT` | a NATS timeout, a closed or reconnecting connection | retried; the job is not touched   |
| `JOB`       | anything else: `out_dir` is a file, a path under a  | the job fails with the reason in  |
|             | file, a name too long, an invalid key, a bad part   | its status; its messages are acked|

A resource fault is not the job's fault (a full disk frees up, a permission is granted):
it never fails the job, and never counts toward its messages' poison limit. The job
pauses (`prefixflow/services/sink/pause.py`): its status says why and where, its results wait
in JetStream, and it resumes by itself once its directory takes writes again.
"""

from __future__ import annotations

import asyncio
import enum
import errno

import nats.errors

from prefixflow.shared.outputs import hint

RESOURCE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES})
"""OS errors that mean "the output lacks a resource", not "this job is wrong"."""

TRANSPORT_ERRORS = (
    nats.errors.TimeoutError, nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError, nats.errors.NoRespondersError, nats.errors.OutboundBufferLimitError,
    asyncio.TimeoutError,
)
"""NATS being away or slow: the same call succeeds later, whatever the job."""


class Fault(enum.Enum):
    RESOURCE = "resource"
    TRANSPORT = "transport"
    JOB = "job"


def classify(exc: BaseException) -> Fault:
    """Which kind of fault `exc` on a job's path is (see the module's table)."""
    if isinstance(exc, OSError) and exc.errno in RESOURCE_ERRNOS:
        return Fault.RESOURCE
    if isinstance(exc, TRANSPORT_ERRORS):
        return Fault.TRANSPORT
    return Fault.JOB


def reason(stage: str, exc: BaseException) -> str:
    """The failed job's status text: where it failed and why, e.g. `the sink could not
    open the job's output: [Errno 17] File exists: '/out/file'`."""
    text = str(exc) if isinstance(exc, OSError) and str(exc) else f"{type(exc).__name__}: {exc}"
    return f"the sink could not {stage}: {text}{hint(exc)}"
