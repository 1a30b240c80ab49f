"""Every outcome a user can see, named once: the exit codes of `prefixflow`'s commands and
services, the states `prefixflow status`/`jobs` show for a job, the states of a batch of
the OpenAI Batch API, and the HTTP statuses of that API's errors.

docs/outcomes.md is their table; `tests/unit/test_outcomes.py` checks it against this
module both ways (a value here that the page does not list, or the reverse, fails), and
checks that no module exits with a code that is not an `Exit` member.

The rule behind the codes: 2 (`USAGE`) when the command was asked something it will not
do as asked and nothing ran or changed (a bad flag or value, an unreadable input, an
invalid or unknown job id, an output directory bound to another job or input); 1
(`FAILED`) when it tried and the outcome is a failure (the job failed, was cancelled or
expired, a timeout passed, the cluster or NATS could not be reached or gave up).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from enum import IntEnum, StrEnum
from http import HTTPStatus
from typing import ClassVar, TypeVar

T = TypeVar("T")


class Exit(IntEnum):
    """Exit codes of every `prefixflow` command and service (docs/outcomes.md)."""

    OK = 0
    """Done: the job has every row (or had it already), the command did what it was asked."""
    FAILED = 1
    """It tried and failed: the job failed, was cancelled or expired; a timeout; NATS or the
    local cluster could not be reached or gave up; a service stopped on an unexpected error."""
    USAGE = 2
    """Refused before anything ran: a bad flag or value (argparse's own code), an unreadable
    input, an invalid or unknown job id, an output directory bound to another job or input."""
    ENGINE_GAVE_UP = 3
    """`serve engine-worker`: its engine died more often than `--max-rebuilds` allows; its
    supervisor restarts the process."""
    PAUSED = 75
    """sysexits.h's EX_TEMPFAIL, try again later: the job is paused, its output lacks a
    resource (disk full, quota, read-only file system, no permission). The same command
    completes it once that is fixed."""
    CRASH_HOOK = 99
    """`serve sink --exit-before-done` (a test hook): the sink ended as a crash would."""
    INTERRUPTED = 128
    """Plus the signal's number: `run` stopped by SIGINT (130) or SIGTERM (143), its cluster
    stopped (the shell's convention for a death by signal)."""


def interrupted(signum: int) -> int:
    """The exit code of a command a signal stopped: 128 + its number."""
    return int(Exit.INTERRUPTED) + int(signum)


class CommandError(SystemExit):
    """Ends a command with `code` (an `Exit`) after its message, `error: <message>`, on
    stderr: `prefixflow.cli.main` (and every other entry point, through `reported`) prints
    it. A `SystemExit`, so that it ends a command wherever it is raised, as a `SystemExit`
    with a message did; unlike that one (always code 1) it says which code."""

    def __init__(self, message: str, code: Exit = Exit.FAILED) -> None:
        super().__init__(int(code))
        self.message = message

    def __str__(self) -> str:
        return self.message


class PrefixflowError(Exception):
    """Base of the typed errors a job can end with (`prefixflow.JobFailed`, `JobPaused`,
    `InputError`, `OutputConflict`, ...): what the Python API raises where the commands
    exit. `code` is the exit code a command ends with for it (the classification above):
    `USAGE` refused before anything ran, `FAILED` tried and failed, `PAUSED` try again."""

    code: ClassVar[Exit] = Exit.FAILED


class OptionError(PrefixflowError, ValueError):
    """A job option (a flag, or a keyword of the Python API) that is unknown or whose value
    is refused: nothing ran."""

    code = Exit.USAGE


class ClusterError(PrefixflowError):
    """NATS or the local cluster could not be reached, refused us, or gave up."""


def usage_error(message: str) -> CommandError:
    """A command refused as asked: exit code 2."""
    return CommandError(message, Exit.USAGE)


def reported(fn: Callable[[], T]) -> T:
    """Run an entry point: a `CommandError` prints `error: <message>` on stderr and exits
    with its code."""
    try:
        return fn()
    except CommandError as exc:
        text = exc.message if exc.message.startswith("error: ") else f"error: {exc.message}"
        print(text, file=sys.stderr, flush=True)
        raise SystemExit(exc.code) from None


class JobState(StrEnum):
    """A job's state as `prefixflow status` and `jobs` show it (`client/status.JobView`),
    derived from its `JobStatus` (and its spec while nothing is written)."""

    QUEUED = "queued"
    """Created, nothing written yet."""
    RUNNING = "running"
    """Rows are being written."""
    PAUSED = "paused"
    """Its output lacks a resource (disk full, quota, read-only, no permission); it resumes
    by itself once the sink can write."""
    CANCELLING = "cancelling"
    """Cancelled (or past its deadline), its last rows still landing."""
    DONE = "done"
    """Every row is written (generated or an error row)."""
    FAILED = "failed"
    """The cluster cannot run it (an invalid spec, a model or task mismatch, an output it
    cannot open); its status says why."""
    CANCELLED = "cancelled"
    """Cancelled (`prefixflow cancel`) before every row was written; the rows written stay."""
    EXPIRED = "expired"
    """Not done by its `--expires-in` deadline: ended like a cancelled job, rows written stay."""


FINAL = frozenset({JobState.DONE, JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED})
"""Job states after which nothing more is written."""


class BatchState(StrEnum):
    """A batch's `status` in the OpenAI Batch API (OpenAI's own values;
    `prefixflow/batchapi/lifecycle.py` has the transitions)."""

    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


API_ERRORS: dict[HTTPStatus, str] = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.NOT_FOUND: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    HTTPStatus.CONFLICT: "invalid_request_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.TOO_MANY_REQUESTS: "insufficient_quota",
    HTTPStatus.INTERNAL_SERVER_ERROR: "server_error",
    HTTPStatus.INSUFFICIENT_STORAGE: "server_error",
}
"""The HTTP statuses of the batch API's errors, each with its OpenAI error `type`."""
