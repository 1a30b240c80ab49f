"""`prefixflow status` and `prefixflow top`: what the cluster is doing, from any machine
that reaches NATS.

- `status [JOB]`: the jobs (or one), each with rows written, errors, rate, prefix-cache
  hit rate so far and ETA, from the job-status bucket the sink keeps (jobs created but
  not yet written to come from the jobs bucket, as queued). For a job in progress it
  listens a second to the engines' statuses and, when the job is in its tail
  (`waiting.TAIL_ROWS` rows left) or a row has been in an engine `waiting.STUCK_SECONDS`, says which rows
  it waits on: "waiting on N rows: K in engines (ids ...), the oldest admitted T ago on
  replica R" (`--json`: the `waiting` object of every job in progress).
- `top`: a live view (rich). One line per engine replica (from the `EngineStatus`
  messages on `pfx.status.*`): live or not, load (prompts in flight / window, work tokens
  outstanding), vLLM's running and waiting requests, KV-cache use, tokens per second,
  prefix-cache hit rate; one line per bucketer (heartbeats on `pfx.hb.bucketer.*`) with
  its buffer depth; the jobs in progress with a progress bar and ETA.

Both only read: key-value gets and core subscriptions. (With NATS users, listing all
jobs needs a user that may watch the job buckets; a `submitter` can ask for one JOB.)
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import nats.errors
from nats.js.errors import KeyNotFoundError, NoKeysError, NotFoundError

from prefixflow.client.fmt import fmt_duration
from prefixflow.client.waiting import Waiting, engine_statuses, waiting_on
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.kv_keys import bound
from prefixflow.shared.outcomes import FINAL, CommandError, Exit, JobState, usage_error
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

LIVE_FOR = 5.0
"""Seconds after its last status a replica still counts as live (the router's default
`--dead-after`)."""
RATE_SPAN = 5.0
"""Seconds over which top measures tokens per second."""


IN_PROGRESS = (JobState.QUEUED, JobState.RUNNING, JobState.CANCELLING)
"""Job states that wait on rows in the pipeline (`status` says which; a paused job's wait
for its disk)."""


@dataclass
class JobView:
    """One job as `status` shows it."""

    job: str
    state: JobState
    """`prefixflow.shared.outcomes.JobState` (docs/outcomes.md): queued, running, paused
    (`error` says which resource, `path` where), cancelling, done, failed, cancelled,
    expired."""
    rows: int = 0
    total: int | None = None
    errors: int = 0
    rate: float = 0.0
    hit_rate: float | None = None
    eta: float | None = None
    updated_at: float = 0.0
    error: str | None = None
    expires_at: float = 0.0
    """When the cluster forgets the job's spec and status (0: unknown); the output stays."""
    created_at: float = 0.0
    """When the job was (last) submitted (0: unknown)."""
    waiting: Waiting | None = None
    """A job in progress: the rows it waits on (`waiting_on`; None: not asked)."""
    path: str | None = None
    """A paused job's directory that lacks the resource."""

    @classmethod
    def of(cls, job: str, status: m.JobStatus | None, spec: m.JobSpec | None) -> JobView:
        view = cls._of(job, status, spec)
        view.created_at = (status.created_at if status is not None else 0.0) or (spec.created_at if spec else 0.0)
        if spec is not None and spec.cancelled_at and view.state in (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED):
            view.state = JobState.CANCELLING
        return view

    @classmethod
    def _of(cls, job: str, status: m.JobStatus | None, spec: m.JobSpec | None) -> JobView:
        if status is None:
            return cls(job, JobState.QUEUED, total=spec.total if spec else None, updated_at=spec.created_at if spec else 0.0)
        if status.failed:
            return cls(job, JobState.FAILED, status.rows, status.total, status.errors, updated_at=status.updated_at,
                       error=status.error, expires_at=status.expires_at)
        rate = status.rate
        if status.done and status.summary and status.summary.get("wall_seconds"):
            rate = status.rows / status.summary["wall_seconds"]
        hit = status.hit_rate if status.prompt_tokens else (status.summary or {}).get("prefix_cache_hit_rate")
        if not status.done and status.paused:
            return cls(job, JobState.PAUSED, status.rows, status.total, status.errors, 0.0, hit, None, status.updated_at,
                       error=f"paused: {status.paused}", expires_at=status.expires_at, path=status.paused_path)
        return cls(
            job, ended_state(status) if status.done else JobState.RUNNING, status.rows, status.total, status.errors, rate,
            hit, status.eta_seconds(), status.updated_at, expires_at=status.expires_at,
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def ended_state(status: m.JobStatus) -> JobState:
    """A done job's state: done (every row), cancelled, or expired (ended at its deadline)."""
    if not status.cancelled:
        return JobState.DONE
    return JobState.EXPIRED if (status.summary or {}).get("expired") else JobState.CANCELLED


async def _all_keys(kv) -> list[str]:
    try:
        return await kv.keys()
    except NoKeysError:
        return []


async def read_jobs(nc, job: str | None = None) -> list[JobView]:
    """The jobs (or `job`), most recently updated first."""
    js = nc.jetstream()
    if job:  # its own keys only: a tenant may not ask about the buckets' streams (`kv_keys.bound`)
        status_kv, jobs_kv = bound(js, subjects.JOB_STATUS_KV), bound(js, subjects.JOBS_KV)
    else:
        try:
            status_kv = await js.key_value(subjects.JOB_STATUS_KV)
            jobs_kv = await js.key_value(subjects.JOBS_KV)
        except NotFoundError:  # no service has provisioned the buckets yet: no job ever ran
            return []
    names = [job] if job else sorted(set(await _all_keys(status_kv)) | set(await _all_keys(jobs_kv)))
    names = [n for n in names if not subjects.is_dir_key(n)]  # output directories' owners

    async def one(name: str) -> JobView | None:
        status = spec = None
        try:
            status = m.job_status_decoder.decode((await status_kv.get(name)).value)
        except (KeyNotFoundError, msgspec.DecodeError, nats.errors.NoRespondersError):  # no bucket yet: no job
            pass
        if status is None or not (status.done or status.failed):  # queued, running or cancelling?
            try:
                spec = m.job_spec_decoder.decode((await jobs_kv.get(name)).value)
            except (KeyNotFoundError, msgspec.DecodeError, nats.errors.NoRespondersError):
                if job and status is None:
                    return None
        return JobView.of(name, status, spec)

    views = [v for v in await asyncio.gather(*(one(n) for n in names)) if v is not None]
    return sorted(views, key=lambda v: v.updated_at, reverse=True)


def status_table(views: list[JobView]):
    from rich.table import Table

    t = Table(box=None, header_style="bold", pad_edge=False)
    for name, justify in (("job", "left"), ("state", "left"), ("rows", "right"), ("total", "right"), ("errors", "right"),
                          ("rows/s", "right"), ("hit rate", "right"), ("ETA", "right"), ("age", "right"),
                          ("updated", "right"), ("expires", "right")):
        t.add_column(name, justify=justify)
    now = time.time()
    colors = {JobState.DONE: "green", JobState.RUNNING: "cyan", JobState.PAUSED: "red", JobState.FAILED: "red",
              JobState.QUEUED: "yellow", JobState.CANCELLING: "magenta", JobState.CANCELLED: "magenta",
              JobState.EXPIRED: "magenta"}
    for v in views:
        t.add_row(
            v.job,
            f"[{colors.get(v.state, 'white')}]{v.state}[/]",
            str(v.rows),
            "?" if v.total is None else str(v.total),
            str(v.errors),
            f"{v.rate:.1f}" if v.rate else "-",
            "-" if v.hit_rate is None else f"{v.hit_rate:.1%}",
            "-" if v.state in FINAL else fmt_duration(v.eta),
            fmt_duration(now - v.created_at) if v.created_at else "-",
            f"{fmt_duration(now - v.updated_at)} ago" if v.updated_at else "-",
            f"in {fmt_duration(max(v.expires_at - now, 0))}" if v.expires_at else "-",
        )
    return t


def cmd_status(args) -> None:
    from rich.console import Console

    if args.job and (why := subjects.job_id_error(args.job)) is not None:
        raise usage_error(why)  # before connecting, as every command

    async def main() -> list[JobView]:
        try:
            nc = await connect(args.nats, "prefixflow-status", wait=args.connect_timeout)
        except Exception as exc:  # noqa: BLE001 - say why, do not trace back
            raise CommandError(f"cannot reach NATS at {args.nats}: {exc}", Exit.FAILED) from None
        try:
            views = await read_jobs(nc, args.job)
            if any(v.state in IN_PROGRESS for v in views):  # what do they wait on?
                statuses, now = await engine_statuses(nc), time.time()
                for v in views:
                    if v.state in IN_PROGRESS:
                        v.waiting = waiting_on(v.job, v.rows, v.total, statuses, now)
            return views
        except nats.errors.Error as exc:
            raise CommandError(f"cannot read the job buckets: {exc!r} (with NATS users, pass a JOB id or use a user that may "
                               "list jobs)", Exit.FAILED) from None
        finally:
            await close(nc)

    views = asyncio.run(main())
    if args.job and not views:
        raise usage_error(f"no job {args.job!r} in the cluster (never submitted, or expired)")
    if args.limit:
        views = views[: args.limit]
    if args.json:
        print(json.dumps([v.as_dict() for v in views], indent=1))
        return
    if not views:
        print("no jobs")
        return
    Console().print(status_table(views))
    for v in views:
        if v.error:
            print(f"{v.job}: {v.error}", file=sys.stderr)
        elif v.waiting is not None and v.waiting.stuck():
            print(v.waiting.line(v.job))


# --- top --------------------------------------------------------------------------------


@dataclass
class ReplicaView:
    status: m.EngineStatus
    seen: float
    """Monotonic time of the last status."""
    history: deque = field(default_factory=lambda: deque(maxlen=256))
    """(monotonic time, prompt tokens, output tokens, cached tokens) samples."""

    def observe(self, status: m.EngineStatus, now: float) -> None:
        if status.completed < self.status.completed:  # the worker restarted: counts start over
            self.history.clear()
        self.status, self.seen = status, now
        self.history.append((now, status.prompt_tokens, status.output_tokens, status.cached_tokens))

    def rates(self, now: float) -> tuple[float, float, float | None]:
        """(prompt tokens/s, generated tokens/s, hit rate) over the last RATE_SPAN seconds;
        the hit rate is None when no prompt finished in that span."""
        h = self.history
        if len(h) < 2:
            return 0.0, 0.0, None
        last = h[-1]
        first = next((x for x in h if now - x[0] <= RATE_SPAN), h[-2])
        if first is last:
            first = h[-2]
        dt = max(last[0] - first[0], 1e-6)
        dp, do, dc = last[1] - first[1], last[2] - first[2], last[3] - first[3]
        if now - last[0] > RATE_SPAN:  # nothing heard lately
            return 0.0, 0.0, None
        return dp / dt, do / dt, (dc / dp if dp > 0 else None)


class Top:
    """The state behind `prefixflow top`, fed by NATS callbacks; `render()` draws it."""

    def __init__(self, url: str, job: str | None = None) -> None:
        self.url = url
        self.job = job
        self.replicas: dict[str, ReplicaView] = {}
        self.bucketers: dict[str, tuple[m.BucketerHeartbeat, float]] = {}
        self.jobs: dict[str, m.JobStatus] = {}
        self.jobs_note = ""

    def on_status(self, status: m.EngineStatus, now: float) -> None:
        view = self.replicas.get(status.replica)
        if view is None:
            self.replicas[status.replica] = view = ReplicaView(status, now)
        view.observe(status, now)

    def on_heartbeat(self, hb: m.BucketerHeartbeat, now: float) -> None:
        self.bucketers[hb.node] = (hb, now)

    def on_job(self, status: m.JobStatus) -> None:
        self.jobs[status.job] = status

    def shown_jobs(self) -> list[m.JobStatus]:
        """The job asked for, else the jobs in progress and those done in the last minute."""
        if self.job:
            return [self.jobs[self.job]] if self.job in self.jobs else []
        now = time.time()
        shown = [s for s in self.jobs.values() if (not s.done and not s.failed and now - s.updated_at < 600) or now - s.updated_at < 60]
        return sorted(shown, key=lambda s: s.updated_at, reverse=True)[:8]

    def decode_cost(self) -> float | None:
        """What an output token costs the replicas in uncached prompt tokens (their mean;
        None: none measured)."""
        from prefixflow.shared.eta import fleet_decode_cost

        return fleet_decode_cost(v.status.decode_cost for v in self.replicas.values())

    def render(self, now: float | None = None):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        now = time.monotonic() if now is None else now
        header = Text.assemble(("prefixflow top", "bold"), f"  {self.url}  {time.strftime('%H:%M:%S')}  (Ctrl-C quits)")

        reps = Table(box=None, header_style="bold", pad_edge=False, title_justify="left")
        for name, justify in (("replica", "left"), ("state", "left"), ("in flight", "right"), ("work tok", "right"),
                              ("running", "right"), ("waiting", "right"), ("KV", "right"), ("prompt tok/s", "right"),
                              ("gen tok/s", "right"), ("hit 5s", "right"), ("hit all", "right"), ("done", "right"),
                              ("idle", "right")):
            reps.add_column(name, justify=justify)
        for name in sorted(self.replicas):
            v = self.replicas[name]
            s = v.status
            age = now - v.seen
            if age >= LIVE_FOR:
                state = f"[red]down {fmt_duration(age)}[/]"
            elif not s.ready:
                state = "[yellow]not ready[/]"
            else:
                state = "[green]live[/]"
            p_rate, g_rate, hit = v.rates(now)
            reps.add_row(
                name, state, f"{s.inflight}/{s.window}", f"{s.outstanding_tokens:,}", str(s.running), str(s.waiting),
                f"{s.kv_usage:.0%}", f"{p_rate:,.0f}", f"{g_rate:,.0f}",
                "-" if hit is None else f"{hit:.1%}",
                f"{s.cached_tokens / s.prompt_tokens:.1%}" if s.prompt_tokens else "-",
                f"{s.completed:,}", fmt_duration(s.idle_seconds),
            )
        if not self.replicas:
            reps.add_row("[dim](no engine status yet)[/]")

        bucks = Table(box=None, header_style="bold", pad_edge=False)
        for name, justify in (("bucketer", "left"), ("state", "left"), ("buffered prompts", "right")):
            bucks.add_column(name, justify=justify)
        for node in sorted(self.bucketers):
            hb, seen = self.bucketers[node]
            age = now - seen
            state = "[green]live[/]" if age < LIVE_FOR else f"[red]silent {fmt_duration(age)}[/]"
            bucks.add_row(node, state, f"{hb.buffered:,}")
        if not self.bucketers:
            bucks.add_row("[dim](no heartbeat yet)[/]")

        jobs = Table(box=None, header_style="bold", pad_edge=False)
        for name, justify in (("job", "left"), ("progress", "left"), ("rows", "right"), ("errors", "right"),
                              ("rows/s", "right"), ("hit rate", "right"), ("ETA", "right")):
            jobs.add_column(name, justify=justify)
        for st in self.shown_jobs():
            total = st.total or 0
            bar = ProgressBar(total=max(total, st.rows, 1), completed=st.rows, width=30)
            if st.failed:
                eta = "[red]failed[/]"
            elif st.paused and not st.done:
                eta = "[red]paused[/]"
            elif st.done:
                eta = "[green]done[/]"
            else:  # by the model of the remaining work, an output token at what the engines measured
                eta = f"ETA {fmt_duration(st.eta_seconds(self.decode_cost()))}"
            jobs.add_row(
                st.job, bar, f"{st.rows:,}/{'?' if st.total is None else f'{total:,}'}", f"{st.errors:,}",
                f"{st.rate:,.1f}", f"{st.hit_rate:.1%}" if st.prompt_tokens else "-", eta,
            )
        if not self.shown_jobs():
            jobs.add_row(f"[dim](no job in progress{'; ' + self.jobs_note if self.jobs_note else ''})[/]")
        return Group(header, Text(""), reps, Text(""), bucks, Text(""), jobs)

    async def follow(self, nc) -> list:
        """Subscribe to statuses and heartbeats, and follow the job bucket; returns the
        tasks and subscriptions to stop."""

        async def on_status(msg) -> None:
            try:
                self.on_status(m.engine_status_decoder.decode(msg.data), time.monotonic())
            except msgspec.DecodeError:
                pass

        async def on_hb(msg) -> None:
            try:
                self.on_heartbeat(m.heartbeat_decoder.decode(msg.data), time.monotonic())
            except msgspec.DecodeError:
                pass

        subs = [await nc.subscribe(subjects.ALL_STATUS, cb=on_status),
                await nc.subscribe(subjects.ALL_BUCKETER_HEARTBEATS, cb=on_hb)]
        kv = None

        async def bucket():
            nonlocal kv
            while kv is None:
                try:
                    kv = await nc.jetstream().key_value(subjects.JOB_STATUS_KV)
                except (NotFoundError, nats.errors.Error, asyncio.TimeoutError):
                    self.jobs_note = "no job-status bucket yet"
                    await asyncio.sleep(1.0)
            self.jobs_note = ""
            return kv

        async def poll_one() -> None:
            kv = await bucket()
            while True:
                try:
                    self.on_job(m.job_status_decoder.decode((await kv.get(self.job)).value))
                except (KeyNotFoundError, msgspec.DecodeError, nats.errors.Error, asyncio.TimeoutError):
                    pass
                await asyncio.sleep(1.0)

        async def watch_all() -> None:
            kv = await bucket()
            try:
                watcher = await kv.watchall(ignore_deletes=True)
            except Exception as exc:  # noqa: BLE001 - a user that may not watch: say so
                self.jobs_note = f"cannot watch the job statuses ({exc!r}): pass --job"
                return
            async for entry in watcher:
                if entry is None or entry.value is None:
                    continue
                try:
                    self.on_job(m.job_status_decoder.decode(entry.value))
                except msgspec.DecodeError:
                    pass

        task = asyncio.create_task(poll_one() if self.job else watch_all())
        return [task, *subs]


def cmd_top(args) -> None:
    from rich.console import Console
    from rich.live import Live

    console = Console()

    async def main() -> None:
        try:
            nc = await connect(args.nats, "prefixflow-top", wait=args.connect_timeout)
        except Exception as exc:  # noqa: BLE001
            raise CommandError(f"cannot reach NATS at {args.nats}: {exc}", Exit.FAILED) from None
        top = Top(args.nats, args.job)
        stops = await top.follow(nc)
        try:
            if args.once:
                await asyncio.sleep(max(args.interval, 1.5))
                console.print(top.render())
                return
            with Live(top.render(), console=console, refresh_per_second=4, transient=False) as live:
                while True:
                    await asyncio.sleep(args.interval)
                    live.update(top.render())
        finally:
            for s in stops:
                if isinstance(s, asyncio.Task):
                    s.cancel()
            await close(nc)

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass


def add_parsers(sub, default_nats: str) -> None:
    p = sub.add_parser("status", help="jobs with rows done, errors, rate, hit rate and ETA (from NATS)")
    p.add_argument("job", nargs="?", default=None, help="one job (default: all, most recent first)")
    p.add_argument("--nats", default=default_nats, help="NATS URL (env PFX_NATS_URL)")
    p.add_argument("--limit", type=int, default=20, help="show at most this many jobs (0: all; default 20)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for NATS (default 5)")
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("jobs", help=f"list the jobs with their state ({', '.join(JobState)}), rows, errors, age "
                                    "(from NATS; docs/outcomes.md)")
    p.add_argument("--nats", default=default_nats, help="NATS URL (env PFX_NATS_URL)")
    p.add_argument("--limit", type=int, default=50, help="show at most this many jobs (0: all; default 50)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for NATS (default 5)")
    p.set_defaults(fn=cmd_status, job=None)

    p = sub.add_parser("top", help="live view of the replicas, bucketers and jobs (rich)")
    p.add_argument("--nats", default=default_nats, help="NATS URL (env PFX_NATS_URL)")
    p.add_argument("--job", default=None, help="follow this job only (default: the jobs in progress)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between screen updates (default 1)")
    p.add_argument("--once", action="store_true", help="print one screen after --interval seconds and exit")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to wait for NATS (default 5)")
    p.set_defaults(fn=cmd_top)
