"""Ending a job early: `prefixflow cancel JOB`; and a job's deadline (`--expires-in`).

Cancelling writes `cancelled_at` into the job's spec (`prefixflow.shared.bus.jobs.cancel_job`: a
compare-and-set on its revision, so a client sealing the job at the same moment cannot
undo it: its own compare-and-set fails and it sees the cancellation), with who cancelled
(`JobSpec.cancelled_by`: the NATS user, `local:<os user>` without auth), and announces it
on the job's own subject (`subjects.job_cancelled`, which only the job's tenant, the batch
service and operators may publish on), so the services drop their cached spec at once
and the job's submitter stops publishing (each reads the spec to confirm it). A job past its
deadline (`JobSpec.expires_at`) is treated the same way by every service, with nothing
written (`JobSpec.ended_at`): it completes as expired. From then on the ingestor drops the job's
prompts, engine-workers do not start the ones they hold, prompts already in an engine
finish, and the sink completes the job as cancelled once no row has come for a few
seconds (`prefixflow/services/sink/lifecycle.CANCEL_SETTLE`): its rows written so far stay, its
status says `cancelled` (and `done`: nothing more will be written).
"""

from __future__ import annotations

import asyncio
import getpass
import sys
import time

from nats.js.errors import KeyNotFoundError

from prefixflow.shared.bus.jobs import UnknownJob, cancel_job
from prefixflow.shared.bus.kv_keys import bound
from prefixflow.shared.outcomes import Exit
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

def canceller() -> str:
    """Who this process cancels as (`JobSpec.cancelled_by`): its NATS user (the server
    checked it, and the grants let it cancel only its own jobs), else `local:<os user>`."""
    from prefixflow.shared.bus.connection import current_options

    if user := current_options().nats_user:
        return user
    try:
        return f"local:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (a container)
        return "local:unknown"


CANCEL_WAIT = 60.0
"""Seconds `prefixflow cancel` waits for the job's status to say cancelled."""


async def wait_cancelled(status_kv, job: str, timeout: float = CANCEL_WAIT) -> m.JobStatus | None:
    """The job's status once it says done (cancelled, or finished before the cancel took
    effect); None if it does not within `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            st = m.job_status_decoder.decode((await status_kv.get(job)).value)
        except KeyNotFoundError:
            st = None
        if st is not None and (st.done or st.failed):
            return st
        await asyncio.sleep(0.25)
    return None


def cmd_cancel(args) -> None:
    from prefixflow.shared.bus.connection import NatsRefused, close, connect

    async def main() -> Exit:
        if (why := subjects.job_id_error(args.job)) is not None:
            print(f"error: {why}", file=sys.stderr)
            return Exit.USAGE
        try:
            nc = await connect(args.nats, "prefixflow-cancel", wait=args.connect_timeout)
        except (TimeoutError, NatsRefused) as exc:
            print(f"error: cannot reach NATS at {args.nats}: {exc}", file=sys.stderr)
            return Exit.FAILED
        try:
            js = nc.jetstream()
            status_kv = bound(js, subjects.JOB_STATUS_KV)
            try:
                before = m.job_status_decoder.decode((await status_kv.get(args.job)).value)
            except KeyNotFoundError:
                before = None
            if before is not None and before.done:
                print(f"job {args.job} is already {'cancelled' if before.cancelled else 'done'}: {before.rows} rows")
                return Exit.OK
            if before is not None and before.failed:  # nothing runs for it: nothing to cancel
                print(f"job {args.job} already failed: {before.error or 'no reason given'}")
                return Exit.OK
            try:
                _, fresh = await cancel_job(js, nc, args.job, by=canceller())
            except UnknownJob:
                print(f"error: no job {args.job!r} in the cluster (never submitted, or expired)", file=sys.stderr)
                return Exit.USAGE
            print(f"job {args.job}: {'cancelling' if fresh else 'already cancelling'}", flush=True)
            if args.no_wait:
                return Exit.OK
            st = await wait_cancelled(status_kv, args.job, args.timeout)
            if st is None:
                print(f"job {args.job}: not settled after {args.timeout:.0f} s (prompts still in engines?); "
                      "it completes as cancelled once they land", file=sys.stderr)
                return Exit.FAILED
            state = "cancelled" if st.cancelled else "failed" if st.failed else "done"
            print(f"job {args.job} {state}: {st.rows} rows written ({st.errors} errors)")
            return Exit.OK
        finally:
            await close(nc)

    raise SystemExit(asyncio.run(main()))


def add_parsers(sub, default_nats: str) -> None:
    p = sub.add_parser(
        "cancel", help="cancel a job: the cluster stops feeding it, rows written stay, its status says cancelled",
    )
    p.add_argument("job", help="job id")
    p.add_argument("--nats", default=default_nats, help="NATS URL (env PFX_NATS_URL)")
    p.add_argument("--no-wait", action="store_true", help="return once the cancel is recorded")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for NATS (default 5)")
    p.add_argument("--timeout", type=float, default=CANCEL_WAIT,
                   help=f"seconds to wait for the job to settle as cancelled (default {CANCEL_WAIT:.0f})")
    p.set_defaults(fn=cmd_cancel)
