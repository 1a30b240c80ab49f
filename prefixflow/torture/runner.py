"""`prefixflow torture`: seeded rounds on real processes, each checked against the
contract (docs/torture.md). The round's plan is `rounds.plan_round`; this carries it out:

1. write the input (or keep the rows to publish), mount a small tmpfs for `--out` if the
   plan has a full disk;
2. run the entry point while the injector carries out the faults (on the harness's
   long-lived cluster, which it supervises itself, or on `prefixflow run`'s own);
3. a paused job (exit 75) is run again by the same command once the space is back;
4. check: exit code and status, ids, columns, summary;
5. another input into the same --out (exit 2, output untouched; then --overwrite);
6. the cluster: every process alive and ready (the batch API too, once started), and a
   clean job through it.

A `batch` round (`play_batch`) uploads its file to the batch API the harness keeps
beside its cluster, creates the batch, waits for its end while the faults (an API
restart among them) land, and checks its files (`prefixflow/torture/batches.py`).
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from prefixflow.shared.outcomes import Exit
from prefixflow.torture import batches, checkers, entries, faults
from prefixflow.torture.api import ApiProcess
from prefixflow.torture.checkers import Outcome, Violation
from prefixflow.torture.datasets import Dataset, write
from prefixflow.torture.known import known_for
from prefixflow.torture.rounds import (CLUSTER_PROCESSES, RoundPlan, RoundResult, plan_round, replay_command,
                                       summarize)

log = structlog.get_logger()

ALIVE_WAIT = 90.0
"""Seconds the cluster has after a round to have every process running and ready."""
CLEAN_ROWS = 8
ECHO_ENV = {"PFX_ECHO_DELAY": "0.1", "PFX_WINDOW": "4"}
"""Echo engines at ~40 prompts/s: a round's job lasts seconds, long enough for its faults."""


class Torture:
    def __init__(self, seed: int, workdir: Path, *, rounds: int | None = None, minutes: float | None = None,
                 first_round: int = 0, entry_points: tuple[str, ...] = entries.ENTRIES, cluster=None,
                 model: str = "", say: Callable[[str], None] = print, max_rows: int = 200,
                 job_timeout: float = entries.JOB_TIMEOUT) -> None:
        self.seed, self.workdir = seed, workdir
        self.rounds, self.minutes, self.first_round = rounds, minutes, first_round
        self.entry_points, self.say, self.max_rows = entry_points, say, max_rows
        self.model = model
        self.job_timeout = job_timeout
        """Seconds a round's job may take (then: a hang, a violation)."""
        self.cluster = cluster
        self.own_cluster = cluster is None
        self.api: ApiProcess | None = None
        """The batch API, started at the first batch round."""
        self.broken: Exception | None = None
        self.fault_counts: Counter = Counter()
        self.results: list[RoundResult] = []
        self.disk = faults.can_mount()
        self.env = {**ECHO_ENV, **({"PFX_MODEL": model} if model else {})}

    # -- the long-lived cluster ---------------------------------------------------------------

    async def ensure_cluster(self):
        from prefixflow.launch.local_cluster import LocalCluster, processes

        if self.cluster is None:
            self.cluster = LocalCluster(processes(1, engine="echo"), workdir=self.workdir / "cluster",
                                        env={**self.env, "PFX_OUT_ROOT": str(self.workdir)},
                                        on_event=lambda text: self.say(f"  cluster: {text}"))
            self.cluster.start()
            await self.cluster.wait_ready(["r0"], 120)
            self.own_cluster = True
        return self.cluster

    async def supervise(self) -> None:
        from prefixflow.launch.local_cluster import ClusterFailed

        while True:
            if self.cluster is not None:
                try:
                    self.cluster.supervise()
                except ClusterFailed as exc:
                    self.broken = exc
                except Exception as exc:  # noqa: BLE001 - this loop must not die silently: the round reports it
                    self.broken = exc
                    log.exception("supervising failed")
            await asyncio.sleep(0.25)

    def cluster_pids(self) -> dict[str, int]:
        running = self.cluster.running if self.cluster is not None else {}
        return {name: proc.pid for name, proc in running.items() if proc.poll() is None}

    async def check_alive(self, result: RoundResult) -> None:
        """Every process running and ready again (the supervisor restarted what a fault
        killed), then a clean job through the cluster."""
        from prefixflow.launch.local_cluster import wait_replicas_ready

        c = self.cluster
        deadline = time.monotonic() + ALIVE_WAIT
        while time.monotonic() < deadline and self.broken is None:
            if all(n in c.ready_now and n not in c.due and c.running[n].poll() is None for n in CLUSTER_PROCESSES):
                break
            await asyncio.sleep(0.25)
        else:
            down = [n for n in CLUSTER_PROCESSES if n not in c.ready_now or c.running[n].poll() is not None]
            why = f"the supervisor gave up: {self.broken}" if self.broken else f"not back in {ALIVE_WAIT:.0f} s: {down}"
            result.record("alive", [Violation("alive", why)])
            await self.restart_cluster()
            return
        try:
            await wait_replicas_ready(c.url, ["r0"], ALIVE_WAIT)
        except TimeoutError as exc:
            result.record("alive", [Violation("alive", str(exc))])
            await self.restart_cluster()
            return
        result.passed("alive")
        clean = Dataset("raw", [{"id": i, "prompt": f"clean row {i}"} for i in range(CLEAN_ROWS)])
        out = self.workdir / "rounds" / f"r{result.round}" / "clean"
        outcome = await entries.publish_raw(c.url, f"clean-{self.seed}-{result.round}", out, clean,
                                            random.Random(0), 60.0)
        found = checkers.check_exit(outcome, CLEAN_ROWS)
        if outcome.code == 0:
            found += checkers.check_ids(clean, checkers.read_output(out))
        result.record("clean-job", [Violation("clean-job", str(v)) for v in found])

    async def ensure_api(self) -> ApiProcess:
        cluster = await self.ensure_cluster()
        if self.api is None or self.api.url != cluster.url:
            await self.stop_api()
            self.api = ApiProcess(cluster.url, self.workdir / "api.log", self.env)
            await self.api.start()
        return self.api

    async def stop_api(self) -> None:
        if self.api is not None:
            await self.api.stop()
            self.api = None

    async def check_api(self, result: RoundResult) -> None:
        """The batch API (once started) is running and answers: it died only by a fault."""
        if self.api is None:
            return
        why = await self.api.unanswered()
        result.record("alive", [Violation("alive", why)] if why else [])
        if why:  # the next rounds need an API: a new one
            await self.stop_api()

    async def restart_cluster(self) -> None:
        await self.stop_api()
        if self.cluster is not None and self.own_cluster:
            self.cluster.stop()
            self.cluster = None
            self.broken = None
            await self.ensure_cluster()

    # -- a round --------------------------------------------------------------------------------

    async def job(self, plan: RoundPlan, ds: Dataset, out: Path, *, job: str | None, overwrite: bool,
                  name: str, mount: Path | None = None) -> Outcome:
        """One job of the round through its entry point, with the plan's faults (only
        for the round's first job: `name == "job"`)."""
        rdir = out.parent if mount is None else mount.parent
        plan_faults = plan.faults if name == "job" else []
        if plan.entry == "raw":
            work = entries.publish_raw(self.cluster.url, plan.job, out, ds, plan.rng, self.job_timeout)
            pids = self.cluster_pids
        else:
            input_path = rdir / f"{name}{ds.suffix()}"
            write(ds, input_path)
            workdir = rdir / f"{name}-cluster"
            argv = entries.job_argv(plan.entry, input_path, out, job, url=self.cluster.url if self.cluster else "",
                                    workdir=workdir, overwrite=overwrite, timeout=self.job_timeout)
            env = {**self.env, "PFX_OUT_ROOT": str(self.workdir)} if plan.entry == "run" else self.env
            (rdir / f"{name}.cmd").write_text("prefixflow " + " ".join(argv) + "\n")
            work = entries.command(argv, rdir / f"{name}.log", env, self.job_timeout + 30)
            pids = self.cluster_pids if plan.entry == "submit" else lambda: entries.pids_of_run(workdir)
        ready = (lambda: entries.run_submitted(rdir / f"{name}.log")) if plan.entry == "run" else None
        result = await self.with_faults(work, plan_faults, pids, mount, ready)
        if isinstance(result, Outcome):
            return result
        code, stderr = result
        if plan.entry == "run" or job is None:  # `run` stopped its cluster; no --job: the id is the CLI's
            return entries.outcome_of_run(code, stderr, out)
        return entries.outcome_of(code, stderr, await entries.status_of(self.cluster.url, job or plan.job))

    def forgive(self, name: str) -> None:
        """A process of the harness's cluster killed on purpose: its supervisor does not
        count the exit against the process's restart budget (a long run kills each
        process more often than the budget allows a crash loop)."""
        supervisor = getattr(self.cluster, "supervisor", None)
        if supervisor is not None:
            supervisor.forgive(name)

    async def with_faults(self, work, plan_faults: list[faults.Fault], pids, mount: Path | None,
                          ready: Callable[[], bool] | None = None):
        """`work`'s result, the faults injected while it runs (from when `ready()` holds:
        `run` supervises its processes only once it has submitted). The injected faults
        are left in `self.last_faults`."""
        restart = self.api.restart if self.api is not None else None
        own = pids == self.cluster_pids  # the harness's cluster (else `run`'s: its supervisor counts them)
        inj = faults.Injector(self.fault_counts, restart_api=restart, killed=self.forgive if own else None)
        task = asyncio.ensure_future(work)
        if plan_faults:
            while ready is not None and not task.done() and not ready():
                await asyncio.sleep(0.1)
            injecting = asyncio.ensure_future(inj.run(plan_faults, pids, mount))
            await asyncio.wait({task}, return_when=asyncio.ALL_COMPLETED)
            injecting.cancel()
            await asyncio.gather(injecting, return_exceptions=True)
            if mount is not None:
                faults.grow(mount)  # the space comes back in any case before the rerun
            if inj.restarting and self.api is not None:  # a restart the round's end cut short (the
                await self.api.stop()  # harness's doing, not a finding): stopped, started, ready
                await self.api.start()
                inj.done.append("api_restart cut short by the round's end: started again")
        self.last_faults = inj.done
        return await task

    async def play_batch(self, plan: RoundPlan, result: RoundResult) -> None:
        """A batch round: the batch through the API while the faults land, then its checks."""
        assert isinstance(plan.dataset, batches.BatchSet)
        api = await self.ensure_api()
        rdir = self.workdir / "rounds" / f"r{plan.round}"
        work = batches.run_batch(api, plan.dataset, rdir / "batch.jsonl", self.job_timeout)
        res = await self.with_faults(work, plan.faults, self.cluster_pids, None)
        result.faults_done = self.last_faults
        if res.batch is None and res.job:  # whose fault: the cluster's job, or the API that follows it?
            st = await entries.status_of(self.cluster.url, res.job)
            res.problem += ("; its job is done on the cluster" if st is not None and st.done else
                            f"; its job on the cluster: {st.rows if st else '?'} rows, not done")
        if res.batch is not None:
            (rdir / "batch.json").write_text(res.batch.model_dump_json(indent=1))
        for invariant, found in batches.check(plan.dataset, res).items():
            result.record(invariant, found)

    async def play(self, plan: RoundPlan) -> RoundResult:
        result = RoundResult(plan.seed, plan.round, plan.entry, plan.describe())
        rdir = self.workdir / "rounds" / f"r{plan.round}"
        rdir.mkdir(parents=True, exist_ok=True)
        if plan.entry == "batch":
            await self.play_batch(plan, result)
            await self.check_api(result)
            await self.check_alive(result)
            return result
        if plan.entry != "run":
            await self.ensure_cluster()
        mount = None
        if any(f.kind == "disk_full" for f in plan.faults):
            mount = rdir / "disk"
            if (why := faults.mount_small(mount)) is not None:
                self.say(f"note: no full-disk fault this round (cannot mount a tmpfs: {why})")
                mount = None
            else:
                self.fault_counts["disk_full"] += 1
        out = (mount or rdir) / "out"
        try:
            outcome = await self.job(plan, plan.dataset, out, job=plan.job, overwrite=False, name="job", mount=mount)
            result.faults_done = self.last_faults
            if outcome.code == 75 and mount is not None:  # paused for its disk: space is back, the same again
                result.record("exit", checkers.check_exit(outcome, len(plan.dataset.ids())))
                # `mount`: its input and cluster beside the first job's, not on the small disk
                outcome = await self.job(plan, plan.dataset, out, job=plan.job, overwrite=False, name="again", mount=mount)
                result.paused = outcome.code
                tail = " | ".join(outcome.stderr.strip().splitlines()[-2:])
                result.record("resume", [] if outcome.code == 0 else [Violation(
                    "resume", f"the same command, the space back, exited {outcome.code} instead of completing: {tail}")])
            self.check_output(result, plan.dataset, out, outcome)
            if plan.second and outcome.code == 0:
                await self.second_input(plan, result, out)
        finally:
            if mount is not None:
                if result.violations and out.is_dir():  # the evidence outlives the small disk
                    shutil.copytree(out, rdir / "out-kept", dirs_exist_ok=True)
                faults.unmount(mount)
        if plan.entry != "run":
            await self.check_api(result)
            await self.check_alive(result)
        return result

    def check_output(self, result: RoundResult, ds: Dataset, out: Path, outcome: Outcome) -> None:
        expected = len(ds.ids())
        result.record("exit", checkers.check_exit(outcome, expected))
        if outcome.code != 0:
            return
        found = checkers.read_output(out)
        result.record("ids", checkers.check_ids(ds, found))
        result.record("columns", checkers.check_columns(ds, found))
        result.record("summary", checkers.check_summary(out, found))

    async def second_input(self, plan: RoundPlan, result: RoundResult, out: Path) -> None:
        """Another input into the finished job's --out: refused (exit 2), the output
        untouched; with --overwrite (plan `overwrite`) the new job's rows."""
        assert plan.second_dataset is not None
        before = checkers.tree_digest(out)
        refused = await self.job(plan, plan.second_dataset, out, job=None, overwrite=False, name="second")
        found = checkers.check_exit(refused, 0, refused=True)
        if checkers.tree_digest(out) != before:
            found.append(Violation("refusal", "the refused input changed the first job's output"))
        result.record("refusal", found)
        if plan.second == "overwrite":
            again = await self.job(plan, plan.second_dataset, out, job=None, overwrite=True, name="overwrite")
            self.check_output(result, plan.second_dataset, out, again)

    # -- the whole run ---------------------------------------------------------------------------

    async def main(self) -> dict[str, Any]:
        watcher = asyncio.ensure_future(self.supervise())
        t0 = time.monotonic()
        r = self.first_round
        try:
            while True:
                if self.rounds is not None and r - self.first_round >= self.rounds:
                    break
                if self.minutes is not None and time.monotonic() - t0 > self.minutes * 60:
                    break
                plan = plan_round(self.seed, r, self.entry_points, disk=self.disk, max_rows=self.max_rows)
                self.say(f"round {r}: {plan.describe()}")
                started = time.monotonic()
                try:
                    result = await self.play(plan)
                except Exception as exc:  # noqa: BLE001 - the harness's own failure is a round's failure, reported
                    result = RoundResult(plan.seed, plan.round, plan.entry, plan.describe())
                    result.violations.append(Violation("crash", f"{type(exc).__name__}: {exc}"))
                    log.exception("round crashed", round=r)
                result.seconds = time.monotonic() - started
                self.results.append(result)
                self.report_round(result)
                r += 1
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self.stop_api()
            if self.cluster is not None and self.own_cluster:
                self.cluster.stop()
        return summarize(self.seed, self.results, self.entry_points, self.fault_counts, self.disk,
                         time.monotonic() - t0)

    def report_round(self, result: RoundResult) -> None:
        checks = sum(result.checks.values())
        self.say(f"round {result.round}: {result.verdict} ({checks} checks passed, {result.seconds:.1f} s)"
                 + "".join(f"\n  fault: {f}" for f in result.faults_done))
        for v in result.violations:
            k = known_for(str(v))
            self.say(f"  {'known' if k else 'VIOLATION'} {v}" + (f" (belongs to {k.belongs_to})" if k else ""))
        if result.violations:
            self.say(f"  replay: {replay_command(result.seed, result.round, self.entry_points)}")


def main(args) -> None:
    """`prefixflow torture` (arguments: `prefixflow/torture/commands.py`)."""
    import tempfile

    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.process import config as cfgmod

    model = str(Path(args.model).resolve()) if args.model else ""
    if not model:
        model = str(Path(make_model(cfgmod.DEFAULT_MODEL)).resolve())
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="prefixflow-torture-")).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    entry_points = tuple(e for e in args.entries.split(",") if e)
    rounds = args.rounds if args.rounds is not None else (None if args.minutes else 10)
    print(f"torture: seed {args.seed}, rounds from {args.round}"
          + (f", at most {rounds}" if rounds is not None else "") + (f", {args.minutes:g} minutes" if args.minutes else "")
          + f", entries {','.join(entry_points)}; workdir {workdir}", flush=True)
    if not faults.can_mount():
        print("note: not root: the full-disk fault (a small tmpfs) is skipped", flush=True)
    torture = Torture(args.seed, workdir, rounds=rounds, minutes=args.minutes, first_round=args.round,
                      entry_points=entry_points, model=model, say=lambda text: print(text, flush=True),
                      max_rows=args.max_rows)
    def interrupted(signum, frame):  # SIGTERM as Ctrl-C: rounds cancelled, subprocesses killed, cluster stopped
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    summary = asyncio.run(torture.main())
    text = json.dumps(summary, indent=1)
    (workdir / "torture.json").write_text(text)
    if args.json:
        print(text)
    print(f"torture: {summary['rounds']} rounds in {summary['seconds']:.0f} s: {summary['ok']} ok, "
          f"{summary['known']} known, {summary['failed']} failed; faults {summary['faults']}; "
          f"paused for the disk {summary['disk_pauses']['paused']}, completed again {summary['disk_pauses']['completed_again']}; "
          f"{summary['checks_passed_total']} checks passed; report {workdir / 'torture.json'}", flush=True)
    for f in summary["failures"]:
        if f["verdict"] == "FAILED":
            print(f"FAILED seed {f['seed']} round {f['round']}: {f['violations'][0]}\n  replay: {f['replay']}", flush=True)
    if summary["failed"]:
        raise SystemExit(Exit.FAILED)
