"""`prefixflow bench fairness`: jobs sharing one cluster, through `prefixflow submit`.

On one long-running local cluster (the echo engine with a per-prompt delay, or real vLLM
on the local model), every job submitted as a user would (`prefixflow submit` as a
subprocess), rounds interleaved, medians reported:

1. **small beside large**: a small job alone (its wall time, submit to exit), then a large
   job and, once that has written `--head` of its rows, the same small job again. Reported:
   the small job's time beside the large one over its time alone (target <= 2x; FIFO
   makes it wait for the large job's last row) and the share of the large job still to
   do when the small one finished.
2. **weights**: two jobs of the same shape submitted together with priorities 1 and
   `--weight`. Reported: rows each wrote while both ran (until the first finished) and
   the high-priority job's rate over the other's (target: the weight within 20 %).
3. **publishing** (`--publishing`): the large job submitted and, `--lag` seconds later
   while it is still being published (not sealed: checked and reported), the small job.
   Reported: the small job's time over its time alone (target <= 2x) and the share of
   the large job left then (target: more than half).
4. **many** (`--many N`, off by default): N jobs of `--many-rows` prompts created at once
   (through the Python API, `prefixflow.Client.submit`, whose rows go out in the
   background) as tenant "a" (`Client(tenant="a")`), then the small job as tenant "b"
   (`PFX_TENANT=b prefixflow submit`). Reported: its time over its time alone (target
   <= 2x) and how many of the N were unfinished when it finished (target: at least 90 %).
   Tenants share first (each half the release), then a tenant's jobs by rows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prefixflow.shared.process import config as cfgmod

SUBMIT = [str(Path(sys.executable).parent / "prefixflow"), "submit"]


def dataset(path: Path, model: str, n: int, seed: int, prefix_len: int, suffix_len: int) -> Path:
    from prefixflow.datagen.dataset import write_prefix_repetition

    if not path.exists():
        write_prefix_repetition(path, tokenizer_dir=model, num_prompts=n, prefix_len=prefix_len, suffix_len=suffix_len,
                                num_prefixes=max(1, n // 64), output_len=4, seed=seed)
    return path


class Watch:
    """Job statuses, polled every `every` seconds while a scenario runs."""

    def __init__(self, url: str, every: float = 0.25) -> None:
        self.url, self.every = url, every
        self.samples: list[tuple[float, dict[str, int]]] = []

    async def rows(self, client, jobs: list[str]) -> dict[str, int]:
        out = {}
        for job in jobs:
            st = await client.status(job)
            out[job] = st.rows if st is not None else 0
        return out

    async def until(self, client, jobs: list[str], done: asyncio.Future) -> None:
        while not done.done():
            self.samples.append((time.monotonic(), await self.rows(client, jobs)))
            await asyncio.sleep(self.every)


def phases(out: Path, submitted: float, exited: float) -> dict[str, float]:
    """Where a job's time went, from its rows' `started_at`/`finished_at` (wall clock):
    submit to its first prompt entering an engine (the client's start-up and upload,
    ingest, bucketing, the queue ahead of it), first start to last finish, last finish to
    the client's exit."""
    import pyarrow.parquet as pq

    t = pq.read_table(out, columns=["started_at", "finished_at"])
    first, last = min(t.column("started_at").to_pylist()), max(t.column("finished_at").to_pylist())
    return {"to_first_start_s": round(first - submitted, 2), "engines_s": round(last - first, 2),
            "to_exit_s": round(exited - last, 2)}


async def submit(url: str, path: Path, out: Path, job: str, max_tokens: int, priority: int = 1,
                 times: dict | None = None, tenant: str = "") -> float:
    """`prefixflow submit` as a subprocess: its wall seconds (RuntimeError if it fails);
    `times` gets its wall-clock start and exit."""
    t0 = time.monotonic()
    if times is not None:
        times["submitted"] = time.time()
    proc = await asyncio.create_subprocess_exec(
        *SUBMIT, str(path), "--out", str(out), "--nats", url, "--job", job, "--no-progress", "--no-report",
        "--max-tokens", str(max_tokens), "--priority", str(priority),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "PFX_TENANT": tenant} if tenant else None)
    text, _ = await proc.communicate()
    if proc.returncode:
        raise RuntimeError(f"submit {job} exited {proc.returncode}: {text.decode()[-2000:]}")
    if times is not None:
        times["exited"] = time.time()
    return time.monotonic() - t0


async def small_beside_large(url: str, small: Path, large: Path, out: Path, tag: str, max_tokens: int,
                             head: float, n_large: int) -> dict[str, Any]:
    """Scenario 1; returns the small job's times alone and beside the large one."""
    from prefixflow.client.submit import Submitter

    t_alone: dict[str, float] = {}
    t_beside: dict[str, float] = {}
    alone = await submit(url, small, out / f"alone-{tag}", f"alone-{tag}", max_tokens, times=t_alone)
    big_job = f"large-{tag}"
    big = asyncio.create_task(submit(url, large, out / big_job, big_job, max_tokens))
    async with Submitter(url) as client:
        while True:
            st = await client.status(big_job)
            if st is not None and st.rows >= head * n_large:
                break
            if big.done():
                big.result()  # raises what failed
                raise RuntimeError("the large job ended before the small one started: make it larger")
            await asyncio.sleep(0.1)
        beside = await submit(url, small, out / f"beside-{tag}", f"beside-{tag}", max_tokens, times=t_beside)
        st = await client.status(big_job)
        left = 1 - (st.rows if st else 0) / n_large
    large_s = await big
    return {"small_alone_s": round(alone, 2), "small_beside_s": round(beside, 2), "ratio": round(beside / alone, 2),
            "large_left_at_small_done": round(left, 3), "large_s": round(large_s, 1),
            "alone_phases": phases(out / f"alone-{tag}", t_alone["submitted"], t_alone["exited"]),
            "beside_phases": phases(out / f"beside-{tag}", t_beside["submitted"], t_beside["exited"])}


async def small_while_publishing(url: str, small: Path, large: Path, out: Path, tag: str, max_tokens: int,
                                 lag: float, n_large: int) -> dict[str, Any]:
    """Scenario 3; the small job's times alone and while the large one is still published."""
    from prefixflow.client.submit import Submitter

    alone = await submit(url, small, out / f"alone-p-{tag}", f"alone-p-{tag}", max_tokens)
    big_job = f"large-p-{tag}"
    big = asyncio.create_task(submit(url, large, out / big_job, big_job, max_tokens))
    await asyncio.sleep(lag)
    async with Submitter(url) as client:
        st = await client.status(big_job)
        sealed = st is not None and st.total is not None
        if big.done():
            big.result()
            raise RuntimeError("the large job ended before the small one started: make it larger")
        beside = await submit(url, small, out / f"publishing-{tag}", f"publishing-{tag}", max_tokens)
        st = await client.status(big_job)
        left = 1 - (st.rows if st else 0) / n_large
    large_s = await big
    return {"small_alone_s": round(alone, 2), "small_beside_s": round(beside, 2), "ratio": round(beside / alone, 2),
            "large_sealed_at_small_start": sealed, "large_left_at_small_done": round(left, 3),
            "large_s": round(large_s, 1)}


async def small_beside_many(url: str, small: Path, many: Path, out: Path, tag: str, max_tokens: int,
                            jobs: int) -> dict[str, Any]:
    """Scenario 4; the small job's times alone and beside `jobs` jobs created just before
    (those tenant "a"'s, the small one tenant "b"'s)."""
    import prefixflow

    # A tenant's outputs live under the sink's output root's directory of its name.
    a_out, b_out = out.parent / "a", out.parent / "b"
    alone = await submit(url, small, b_out / f"alone-m-{tag}", f"alone-m-{tag}", max_tokens, tenant="b")
    client = prefixflow.Client(url, tenant="a")
    try:
        t0 = time.monotonic()
        handles = [await client.submit_async(many, out=a_out / f"many-{tag}-{i}", job=f"many-{tag}-{i}",
                                             max_tokens=max_tokens) for i in range(jobs)]
        created_s = time.monotonic() - t0
        beside = await submit(url, small, b_out / f"many-small-{tag}", f"many-small-{tag}", max_tokens, tenant="b")
        unfinished = sum(not h.done() for h in handles)
        t1 = time.monotonic()
        await asyncio.gather(*(h.wait_async() for h in handles))
        many_s = time.monotonic() - t1
    finally:
        client.close()
    return {"small_alone_s": round(alone, 2), "small_beside_s": round(beside, 2), "ratio": round(beside / alone, 2),
            "jobs": jobs, "created_s": round(created_s, 1), "unfinished_at_small_done": unfinished,
            "many_rest_s": round(many_s, 1)}


async def weighted(url: str, a: Path, b: Path, out: Path, tag: str, max_tokens: int, weight: int, n: int) -> dict[str, Any]:
    """Scenario 2: jobs `a` (priority 1) and `b` (priority `weight`) together."""
    from prefixflow.client.submit import Submitter

    lo, hi = f"w1-{tag}", f"w{weight}-{tag}"
    watch = Watch(url)
    runs = [asyncio.create_task(submit(url, a, out / lo, lo, max_tokens, 1)),
            asyncio.create_task(submit(url, b, out / hi, hi, max_tokens, weight))]
    first = asyncio.get_running_loop().create_future()
    async with Submitter(url) as client:
        poll = asyncio.create_task(watch.until(client, [lo, hi], first))
        done, _ = await asyncio.wait(runs, return_when=asyncio.FIRST_COMPLETED)
        first.set_result(True)
        await poll
        for t in done:
            t.result()
        await asyncio.gather(*runs)
    # The interval where both ran at full speed: from the first sample where each has
    # written 5 % of its rows (start-up behind it) to the first where either has 90 %
    # (before its tail, where the other takes over the replicas).
    both = [(t, r) for t, r in watch.samples if r[lo] >= 0.05 * n and r[hi] >= 0.05 * n]
    end = next(((t, r) for t, r in both if r[lo] >= 0.9 * n or r[hi] >= 0.9 * n), both[-1] if both else None)
    if not both or end is None or end[0] <= both[0][0]:
        # One job was 90 % done before the other had 5 %: what the replicas held already
        # (their queues) decided it, not the shares. Make the jobs larger.
        last = watch.samples[-1][1] if watch.samples else {}
        return {"weight": weight, "seconds_together": 0.0, "rows_lo": last.get(lo, 0), "rows_hi": last.get(hi, 0),
                "rate_ratio": None, "share_hi": None, "share_want": round(weight / (1 + weight), 3)}
    (t0, r0), (t1, r1) = both[0], end
    d_lo, d_hi = r1[lo] - r0[lo], r1[hi] - r0[hi]
    return {"weight": weight, "seconds_together": round(t1 - t0, 2), "rows_lo": d_lo, "rows_hi": d_hi,
            "rate_ratio": round(d_hi / max(d_lo, 1), 2), "share_hi": round(d_hi / max(d_hi + d_lo, 1), 3),
            "share_want": round(weight / (1 + weight), 3)}


def summarize(runs: list[dict[str, Any]], key: str) -> float | None:
    """Median of `key` over the runs that measured it (None: none did)."""
    values = [r[key] for r in runs if r[key] is not None]
    return round(statistics.median(values), 3) if values else None


def cmd_fairness(args: argparse.Namespace) -> None:
    from prefixflow.datagen.make_model import make_model
    from prefixflow.launch.local_cluster import LocalCluster, processes

    model = str(make_model(args.model) if args.model == cfgmod.DEFAULT_MODEL else Path(args.model).resolve())
    work = Path(args.work_dir).resolve()
    data = work / "data"
    data.mkdir(parents=True, exist_ok=True)
    shape = dict(model=model, prefix_len=args.prefix_len, suffix_len=args.suffix_len)
    small = dataset(data / f"small-{args.small}.parquet", n=args.small, seed=1, **shape)
    large = dataset(data / f"large-{args.large}.parquet", n=args.large, seed=2, **shape)
    pair = [dataset(data / f"pair-{args.pair}-{k}.parquet", n=args.pair, seed=3 + k, **shape) for k in (0, 1)]
    engine_args = ["--echo-delay", str(args.echo_delay), "--window", str(args.window)] if args.engine == "echo" else []
    cluster = LocalCluster(processes(args.replicas, engine=args.engine, extra_engine_args=engine_args),
                           workdir=work / f"cluster-{int(time.time())}",
                           env={"PFX_MODEL": model, "PFX_LOG_LEVEL": "warning", "PFX_OUT_ROOT": str(work)})
    cluster.start()
    many = dataset(data / f"many-{args.many_rows}.parquet", n=args.many_rows, seed=5, **shape) if args.many else None
    beside: list[dict[str, Any]] = []
    weights: list[dict[str, Any]] = []
    publishing: list[dict[str, Any]] = []
    crowd: list[dict[str, Any]] = []
    try:
        asyncio.run(cluster.wait_ready([f"r{i}" for i in range(args.replicas)], timeout=600))
        for k in range(args.rounds):
            # Interleaved: each round runs both scenarios, alternating which goes first.
            tag = f"{k}-{int(time.time())}"
            scenarios = [x for x in ("beside", "weights", "publishing", "many") if args.only is None or x in args.only]
            scenarios = scenarios if k % 2 == 0 else scenarios[::-1]
            for s in scenarios:
                if s == "publishing":
                    r = asyncio.run(small_while_publishing(cluster.url, small, large, work / "out", tag, args.max_tokens,
                                                           args.lag, args.large))
                    publishing.append(r)
                elif s == "many":
                    if many is None:
                        continue
                    r = asyncio.run(small_beside_many(cluster.url, small, many, work / "out", tag, args.max_tokens,
                                                      args.many))
                    crowd.append(r)
                elif s == "beside":
                    r = asyncio.run(small_beside_large(cluster.url, small, large, work / "out", tag, args.max_tokens,
                                                       args.head, args.large))
                    beside.append(r)
                else:
                    r = asyncio.run(weighted(cluster.url, pair[0], pair[1], work / "out", tag, args.max_tokens,
                                             args.weight, args.pair))
                    weights.append(r)
                print(f"round {k} {s:<8} {json.dumps(r)}", flush=True)
    finally:
        cluster.stop()
    report = {
        "engine": args.engine, "replicas": args.replicas, "small": args.small, "large": args.large,
        "pair": args.pair, "weight": args.weight, "max_tokens": args.max_tokens,
        "prefix_len": args.prefix_len, "suffix_len": args.suffix_len,
        "echo": {"delay": args.echo_delay, "window": args.window} if args.engine == "echo" else None,
        "median": {
            "small_alone_s": summarize(beside, "small_alone_s"), "small_beside_s": summarize(beside, "small_beside_s"),
            "ratio": summarize(beside, "ratio"), "large_left_at_small_done": summarize(beside, "large_left_at_small_done"),
            "rate_ratio": summarize(weights, "rate_ratio"), "share_hi": summarize(weights, "share_hi"),
        },
        "beside": beside, "weights": weights,
    }
    if publishing:
        report["median"] |= {"publishing_ratio": summarize(publishing, "ratio"),
                             "publishing_large_left": summarize(publishing, "large_left_at_small_done")}
        report["publishing"] = publishing
    if crowd:
        report["median"] |= {"many_ratio": summarize(crowd, "ratio"),
                             "many_unfinished": summarize(crowd, "unfinished_at_small_done")}
        report["many"] = crowd
    med = report["median"]
    if beside:
        print(f"small job alone {med['small_alone_s']} s, beside the large job {med['small_beside_s']} s "
              f"({med['ratio']}x; target <= 2x); {med['large_left_at_small_done']:.0%} of the large job left then")
    if weights:
        print(f"priority {args.weight} vs 1: rate ratio {med['rate_ratio']} (target {args.weight} +- 20 %), "
              f"share {med['share_hi']} (want {args.weight / (1 + args.weight):.3f})")
    if publishing:
        print(f"small job while the large one is still published: {med['publishing_ratio']}x its time alone "
              f"(target <= 2x); {med['publishing_large_left']:.0%} of the large job left then")
    if crowd:
        print(f"small job beside {args.many} jobs: {med['many_ratio']}x its time alone (target <= 2x); "
              f"{med['many_unfinished']} of them unfinished then (target >= {int(0.9 * args.many)})")
    from prefixflow.bench.common import machine_info, write_report

    report["machine"] = machine_info()
    write_report(report, args.json)


def add_fairness_parser(sub) -> None:
    p = sub.add_parser("fairness", help="jobs sharing one cluster: a small job beside a large one, priorities",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("echo", "vllm"), default="echo")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--small", type=int, default=200, help="prompts of the small job")
    p.add_argument("--large", type=int, default=20000, help="prompts of the large job")
    p.add_argument("--head", type=float, default=0.1, help="the small job starts once the large one wrote this share")
    p.add_argument("--pair", type=int, default=4000, help="prompts of each of the two weighted jobs")
    p.add_argument("--weight", type=int, default=3, help="priority of the second weighted job (the first has 1)")
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--echo-delay", type=float, default=0.02, help="echo engine: seconds per prompt")
    p.add_argument("--window", type=int, default=8, help="echo engine: prompts in flight per replica")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--publishing", dest="lag", type=float, default=3.0,
                   help="scenario 3: seconds after the large job's submit that the small one starts")
    p.add_argument("--many", type=int, default=100,
                   help="scenario 4: tenant a's jobs created before tenant b's small one (0: skip)")
    p.add_argument("--many-rows", type=int, default=200, help="scenario 4: prompts of each of those jobs")
    p.add_argument("--only", nargs="+", choices=("beside", "weights", "publishing", "many"),
                   help="run only these scenarios (default: all)")
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL)
    p.add_argument("--work-dir", default=".prefixflow/bench-fairness")
    p.add_argument("--json", help="write the runs and medians here")
    p.set_defaults(fn=cmd_fairness)
