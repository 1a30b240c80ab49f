"""How a job followed by `submit` (and `run`, and the Python API) ends when it does not
complete: its exceptions, and the message and exit code each ends a command with
(`ending`, docs/outcomes.md)."""

from __future__ import annotations

from prefixflow.shared.wire import messages as m
from prefixflow.shared.outcomes import CommandError, Exit, PrefixflowError


class JobFailed(PrefixflowError):
    """The cluster marked the job failed (its status says why)."""

    def __init__(self, job: str, reason: str | None) -> None:
        super().__init__(f"job {job} failed: {reason or 'no reason given'}")
        self.job = job
        self.reason = reason


class JobCancelled(JobFailed):
    """The job was cancelled (`prefixflow cancel`) or expired: the rows written stay."""

    def __init__(self, job: str, status: m.JobStatus | None = None, note: str = "") -> None:
        rows = f": {status.rows} rows written ({status.errors} errors), they stay" if status is not None else ""
        how = "expired" if status is not None and (status.summary or {}).get("expired") else "cancelled"
        Exception.__init__(self, f"job {job} {how}{rows}{note}")
        self.job, self.reason, self.status = job, "cancelled", status


PAUSED_GRACE = 5.0
"""Seconds a job stays paused before the client gives up waiting (`JobPaused`): a pause
the sink resolves at its next probe does not end the command."""


class JobPaused(PrefixflowError):
    """The job is paused: its output lacks a resource (disk full, quota, read-only file
    system, no permission). Not failed: its results wait in the cluster and it resumes by
    itself once the sink can write; the same command then completes it. Exit code 75
    (`Exit.PAUSED`)."""

    code = Exit.PAUSED

    def __init__(self, job: str, status: m.JobStatus) -> None:
        super().__init__(f"job {job} paused: {status.paused} ({status.rows} rows written)")
        self.job, self.status = job, status
        self.path = status.paused_path or "its output directory"


class PauseWatch:
    """Raises `JobPaused` once a job has been paused for `PAUSED_GRACE` seconds."""

    def __init__(self, grace: float = PAUSED_GRACE) -> None:
        self.grace = grace
        self.since: float | None = None

    def observe(self, job: str, st: m.JobStatus | None, now: float) -> None:
        if st is None or not st.paused or st.done or st.failed:
            self.since = None
            return
        self.since = now if self.since is None else self.since
        if now - self.since >= self.grace:
            raise JobPaused(job, st)


class OutputConflict(PrefixflowError):
    """The output directory (or the job id) belongs to another job, or to one asked another
    input or spec: refused before anything ran (exit code 2)."""

    code = Exit.USAGE


class DirTaken(OutputConflict):
    """The output directory is bound to another job (`prefixflow` exits with code 2)."""

    def __init__(self, out_dir: str, owner: str, job: str) -> None:
        super().__init__(
            f"{out_dir} holds the output of job {owner}: pass --job {owner} to resume that job, "
            f"--overwrite to replace its output with job {job}'s, or another --out"
        )
        self.out_dir, self.owner, self.job = out_dir, owner, job


class JobMismatch(OutputConflict):
    """The job id, or the job bound to the output directory, was asked another input or
    spec than this one (`prefixflow` exits with code 2); the message names the difference."""


def mismatch_text(out_dir: str, owner: str, diff: str) -> str:
    """The refusal of another job into `owner`'s directory (`run` and `submit` say the same)."""
    return (f"{out_dir} holds the output of job {owner}, which was asked something else ({diff}): pass --overwrite "
            "to replace that output with this job's, or another --out")


class AlreadyDone(Exception):
    """The job is done already (every row written, `status.summary` its summary): nothing
    was published."""

    def __init__(self, status: m.JobStatus) -> None:
        super().__init__(f"job {status.job} is already done: {status.rows} rows ({status.errors} errors)")
        self.status = status


def ending(exc: Exception, *, cluster_stays: bool) -> CommandError:
    """The message and exit code (a `CommandError`) `submit` and `run` end with for one of `ENDINGS`
    (docs/outcomes.md); `cluster_stays`: the job's cluster runs on after the command (`submit`),
    not `run`'s own."""
    if isinstance(exc, JobPaused):
        then = (f"the job waits on the cluster and resumes by itself once {exc.path} takes writes again; "
                "run the same command again to follow it to the end" if cluster_stays
                else f"once {exc.path} takes writes again, run the same command to resume it")
        return CommandError(f"{exc}\n{then}", Exit.PAUSED)
    if isinstance(exc, OutputConflict):  # OUT (or the id) bound to another job, input or spec
        return CommandError(str(exc), Exit.USAGE)
    return CommandError(str(exc), Exit.FAILED)  # JobFailed: failed, cancelled or expired


ENDINGS = (JobFailed, JobPaused, OutputConflict)
"""`submit`'s exceptions that end a command with a documented code (`ending`)."""
