"""Benchmarks: `prefixflow bench methods` and `prefixflow bench pipeline`.

`methods` reproduces the reference comparison on one prefix-repetition dataset against
the same R engine-worker processes (real vLLM, KV cache constrained so the dataset does
not fit), each method from a cold prefix cache (`reset_prefix_cache`), engine start-up
and a short warm-up outside every timed region, in `--repeat` interleaved rounds (each
method reports its median-wall run: this machine's run-to-run noise is ~10 %):

1. naive       fixed batches sent round-robin; a replica gets its next batch only when
               its whole current batch is done (the straggler tail idles it);
2. continuous  streamed to the replicas in dataset order with a bounded in-flight window
               (the worker's `--window`), no grouping;
3. sorted      global sort by token ids first (its time counted), then the sorted order
               cut into R contiguous ranges, each streamed to its replica;
4. bucketing-daft  the full service pipeline with the reference (`daft`) routing;
5. bucketing   the full service pipeline with the defaults (`prefix-aware` routing,
               eager release, prefix-group scheduling);
   bucketing-round-robin  (extra) method 5 with `round-robin` routing: what routing
               alone is worth.
Methods 1-3 publish work batches straight to `pfx.work.<replica>`; 4-5 publish prompts
to the ingest subject like any client. Methods 1-4 run vLLM's FCFS order (the reference
used vanilla vLLM); 5 and bucketing-round-robin use prefix-group priorities. Every
method's wall time includes tokenizing the dataset (methods 1-3 in one batch call, 4-5
in the ingestor) and runs from then to the last result; hit rate is cached / prompt
tokens over the job's results.

`pipeline` pushes prompts through every service with the `echo` engine (no model) and
reports prompts per second end to end and each service's peak RSS.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from prefixflow.bench.common import machine_info, write_report
from prefixflow.report.analysis import group_stats
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.bus import control
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.bus.provision import provision
from prefixflow.shared.bus.publish import publish

WARMUP_PROMPTS = 64
METHODS = ("naive", "continuous", "sorted", "bucketing-daft", "bucketing")
EXTRA_METHODS = ("bucketing-round-robin",)
WORK_BATCH = 16


@dataclass
class MethodResult:
    method: str
    wall_seconds: float
    rows: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    hit_rate: float
    output_tokens_per_second: float
    idle_fraction: dict[str, float]
    groups_split: int = 0
    """Prefix groups whose prompts ran on more than one replica."""
    prefix_misses: int = 0
    """Prompts that did not find their group's whole (block-aligned) prefix cached; the
    ideal is one per group."""
    extra: dict[str, Any] = field(default_factory=dict)


class Observer:
    """Watches a job's results and the replicas' status on core NATS subscriptions."""

    check = staticmethod(lambda: None)
    """Called while waiting: raises if a cluster process died (set by the bench)."""

    def __init__(self, nc, job: str) -> None:
        self.nc, self.job = nc, job
        self.results: dict[Any, m.Result] = {}
        self.arrivals: list[tuple[float, str, int]] = []
        """(time, replica, results) of each result batch: the per-replica timeline."""
        self.last_result_at = 0.0
        self.changed = asyncio.Event()

    async def __aenter__(self) -> Observer:
        async def on_results(msg) -> None:
            batch = m.result_batch_decoder.decode(msg.data).results
            for r in batch:
                self.results.setdefault(r.id, r)
            self.last_result_at = time.monotonic()
            if batch:
                self.arrivals.append((self.last_result_at, batch[0].replica, len(batch)))
            self.changed.set()

        self.sub = await self.nc.subscribe(subjects.results(subjects.ANY_ORIGIN, self.job), cb=on_results)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.sub.unsubscribe()

    async def wait_for(self, ids, timeout: float = 3600) -> None:
        deadline = time.monotonic() + timeout
        pending = set(ids)
        while pending:
            pending -= self.results.keys()
            if not pending:
                break
            Observer.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(pending)} results missing")
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


async def prepare_engines(nc, replicas: list[str], scheduling: str) -> None:
    for r in replicas:
        for _ in range(60):  # reset refuses while requests run: wait them out
            if (await control.reset_prefix_cache(nc, r)).ok:
                break
            await asyncio.sleep(0.5)
        reply = await control.set_scheduling(nc, r, scheduling)  # ControlError for a mode it does not know
        assert reply.ok and reply.detail == scheduling, reply


def to_prompts(job: str, table, max_tokens: int, tokenizer) -> list[m.Prompt]:
    texts = table.column("prompt").to_pylist()
    ids = table.column("id").to_pylist()
    enc = tokenizer.encode_batch(texts)
    enc_columns = msgspec.msgpack.Encoder()
    return [
        m.Prompt(job, i, tk.pack(e.ids), enc_columns.encode({"prompt": t}), max_tokens) for i, t, e in zip(ids, texts, enc)
    ]


async def publish_work(js, replica: str, prompts: list[m.Prompt], tag: str) -> None:
    for i in range(0, len(prompts), WORK_BATCH):
        await publish(js, subjects.work(replica), m.encode(m.WorkBatch(f"{tag}-{i}", prompts[i : i + WORK_BATCH])))


async def run_direct(
    method: str, nc, js, job: str, make_prompts: Callable[[], list[m.Prompt]], replicas: list[str], naive_batch: int
) -> dict:
    """Methods 1-3: tokenize (timed, as the pipeline's ingestor is), then feed the
    engine-workers directly. Returns timing extras."""
    extra: dict[str, Any] = {}
    async with Observer(nc, job) as obs:
        t0 = time.monotonic()
        prompts = make_prompts()
        extra["tokenize_seconds"] = round(time.monotonic() - t0, 3)
        if method == "naive":
            batches = [prompts[i : i + naive_batch] for i in range(0, len(prompts), naive_batch)]

            async def lane(k: int, replica: str) -> None:
                for b in batches[k :: len(replicas)]:
                    await publish_work(js, replica, b, f"naive-{replica}")
                    await obs.wait_for([p.id for p in b])

            await asyncio.gather(*(lane(k, r) for k, r in enumerate(replicas)))
        else:
            order = prompts
            if method == "sorted":
                ts = time.monotonic()
                order = sorted(prompts, key=lambda p: p.tokens)
                extra["sort_seconds"] = round(time.monotonic() - ts, 4)
                n = len(order)
                lanes = [order[k * n // len(replicas) : (k + 1) * n // len(replicas)] for k in range(len(replicas))]
            else:  # continuous: dataset order, round-robin in small batches
                lanes = [[] for _ in replicas]
                for i in range(0, len(order), WORK_BATCH):
                    lanes[(i // WORK_BATCH) % len(replicas)].extend(order[i : i + WORK_BATCH])
            await asyncio.gather(*(publish_work(js, r, lane, method) for r, lane in zip(replicas, lanes)))
            await obs.wait_for([p.id for p in prompts])
        extra["wall"] = obs.last_result_at - t0
        extra["results"] = list(obs.results.values())
        extra["timeline"] = timeline(obs, t0)
    return extra


async def run_pipeline(nc, url: str, job: str, rows: list[dict], out_dir: Path, sampling: m.SamplingSpec) -> dict:
    """Methods 4-5: through ingestor, bucketer, router, engine-workers and sink."""
    from prefixflow.client.submit import Submitter

    async with Observer(nc, job) as obs, Submitter(url) as client:
        spec = m.JobSpec(job=job, out_dir=str(out_dir), sampling=sampling, created_at=time.time())
        await client.create(spec)
        t0 = time.monotonic()
        await client.publish_rows(job, rows)
        await client.create(msgspec.structs.replace(spec, total=len(rows)))
        await obs.wait_for([r["id"] for r in rows])
        wall = obs.last_result_at - t0
        await client.wait(job, len(rows), progress=False, timeout=600)
        return {"wall": wall, "results": list(obs.results.values()), "timeline": timeline(obs, t0)}


def timeline(obs: Observer, t0: float) -> dict[str, dict[str, float]]:
    """Per replica: first and last result (seconds from the start) and rows."""
    out: dict[str, dict[str, float]] = {}
    for t, replica, n in obs.arrivals:
        d = out.setdefault(replica, {"first": round(t - t0, 2), "last": 0.0, "rows": 0})
        d["last"] = round(t - t0, 2)
        d["rows"] += n
    return out


def summarize(method: str, extra: dict, idle: dict[str, float], group_of: dict[Any, int], prefix_tokens: int) -> MethodResult:
    results: list[m.Result] = extra.pop("results")
    wall = extra.pop("wall")
    ok = [r for r in results if r.error is None]
    split, misses = group_stats(results, group_of, prefix_tokens)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return MethodResult(
        method=method,
        wall_seconds=round(wall, 3),
        rows=len(results),
        errors=len(results) - len(ok),
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        hit_rate=round(cached / prompt, 4) if prompt else 0.0,
        output_tokens_per_second=round(output / wall, 2) if wall else 0.0,
        idle_fraction={r: round(v / wall, 4) for r, v in idle.items()} if wall else {},
        groups_split=split,
        prefix_misses=misses,
        extra=extra,
    )


async def bench_methods_async(args) -> dict[str, Any]:
    from prefixflow.launch.local_cluster import LocalCluster, processes
    from prefixflow.datagen.dataset import dataset_metadata, ideal_hit_rate, prefix_repetition, shape_args
    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.prefix.tokenize import load_tokenizer

    model = str(make_model(args.model) if args.model == cfgmod.DEFAULT_MODEL else Path(args.model))
    out_root = Path(args.work_dir)
    out_root.mkdir(parents=True, exist_ok=True)
    table = prefix_repetition(tokenizer_dir=model, **shape_args(args))
    group_of = dict(zip(table["id"].to_pylist(), table["prefix_id"].to_pylist()))
    sampling = m.SamplingSpec(max_tokens=args.output_len, min_tokens=args.output_len, ignore_eos=True, temperature=1.0)
    replicas = [f"r{i}" for i in range(args.replicas)]
    engine_args = ["--kv-cache-blocks", str(args.kv_cache_blocks), "--window", str(args.window)]
    # The sink writes only under its output root: the work dir, wherever --work-dir puts it.
    env = {"PFX_MODEL": model, "PFX_LOG_LEVEL": "warning", "PFX_OUT_ROOT": str(out_root.resolve())}
    if args.buffer_prompts:
        env["PFX_BUFFER_PROMPTS"] = str(args.buffer_prompts)
    cluster = LocalCluster(
        processes(args.replicas, engine="vllm", extra_engine_args=engine_args), workdir=out_root / "cluster", env=env
    )
    t0 = time.monotonic()
    cluster.start()
    Observer.check = staticmethod(cluster.check_alive)
    results: list[MethodResult] = []
    try:
        startup = await cluster.wait_ready(replicas, timeout=600)
        print(f"engines ready in {startup:.1f} s (not timed)", flush=True)
        nc = await connect(cluster.url, "bench")
        js = nc.jetstream()
        await provision(js)
        # Hits come in whole KV blocks of the engine's own size (reported in its status).
        block_size = (await control.engine_status(nc, replicas[0])).block_size
        ideal = ideal_hit_rate(table, block_size=block_size)
        prefix_tokens = dataset_metadata(table)["shared_prefix_tokens"] // block_size * block_size
        jobs_kv = await js.key_value(subjects.JOBS_KV)
        tokenizer = load_tokenizer(model)
        rows = [{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]
        # Warm-up (not timed): the engines' first requests pay one-off costs (kernel
        # selection, allocator growth) that would otherwise land on the first method.
        warm = f"bench-warmup-{int(time.time())}"
        warm_prompts = to_prompts(warm, table.slice(0, min(WARMUP_PROMPTS, table.num_rows)), args.output_len, tokenizer)
        spec = m.JobSpec(job=warm, out_dir=str(out_root / "warmup"), sampling=sampling, created_at=time.time(), total=len(warm_prompts))
        await jobs_kv.put(warm, m.encode_json(spec))
        shutil.rmtree(out_root / "warmup", ignore_errors=True)
        await prepare_engines(nc, replicas, "fcfs")
        ts = time.monotonic()
        await run_direct("continuous", nc, js, warm, lambda: warm_prompts, replicas, args.naive_batch)
        warmup = time.monotonic() - ts
        print(f"warm-up: {len(warm_prompts)} prompts in {warmup:.1f} s (not timed)", flush=True)
        for round_, method in [(k, meth) for k in range(args.repeat) for meth in args.methods]:
            job = f"bench-{method}-{round_}-{int(time.time())}"
            out_dir = out_root / method
            shutil.rmtree(out_dir, ignore_errors=True)  # the last run's rows would be taken as done
            await prepare_engines(nc, replicas, "prefix-groups" if method in ("bucketing", "bucketing-round-robin") else "fcfs")
            before = {r: (await control.engine_status(nc, r)).idle_seconds for r in replicas}
            if method in ("naive", "continuous", "sorted"):
                spec = m.JobSpec(job=job, out_dir=str(out_dir), sampling=sampling, created_at=time.time(), total=len(rows))
                await jobs_kv.put(job, m.encode_json(spec))
                make = functools.partial(to_prompts, job, table, args.output_len, tokenizer)
                extra = await run_direct(method, nc, js, job, make, replicas, args.naive_batch)
            else:
                policy = {"bucketing-daft": "daft", "bucketing": "prefix-aware", "bucketing-round-robin": "round-robin"}[method]
                assert (await control.set_policy(nc, policy)).detail == policy  # ControlError for an unknown one
                extra = await run_pipeline(nc, cluster.url, job, rows, out_dir, sampling)
            after = {r: (await control.engine_status(nc, r)).idle_seconds for r in replicas}
            res = summarize(method, extra, {r: after[r] - before[r] for r in replicas}, group_of, prefix_tokens)
            results.append(res)
            print(
                f"{method:>22}: {res.wall_seconds:8.2f} s  hit {res.hit_rate:6.1%}  out tok/s {res.output_tokens_per_second:8.1f}"
                f"  split groups {res.groups_split}  misses {res.prefix_misses}  idle {res.idle_fraction}",
                flush=True,
            )
        await close(nc)
    finally:
        cluster.stop()
    medians = [median_run([r for r in results if r.method == meth]) for meth in args.methods]
    naive = next((r for r in medians if r.method == "naive"), None)
    report = {
        "config": {k: v for k, v in vars(args).items() if k not in ("fn",)},
        "machine": machine_info(),
        "engine_startup_seconds": round(startup, 1),
        "warmup_seconds": round(warmup, 1),
        "ideal_hit_rate": round(ideal, 4),
        "groups": len(set(group_of.values())),
        "total_seconds": round(time.monotonic() - t0, 1),
        "methods": [
            asdict(r)
            | {
                "vs_naive": round(naive.wall_seconds / r.wall_seconds, 3) if naive else None,
                "runs": [
                    {"wall_seconds": x.wall_seconds, "hit_rate": x.hit_rate, "groups_split": x.groups_split, "prefix_misses": x.prefix_misses}
                    for x in results
                    if x.method == r.method
                ],
            }
            for r in medians
        ],
    }
    return report


def median_run(runs: list[MethodResult]) -> MethodResult:
    """The run with the median wall time (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r.wall_seconds)[(len(runs) - 1) // 2]


def print_methods_table(report: dict[str, Any]) -> None:
    print()
    print(
        f"{'method':>22} {'wall s':>9} {'vs naive':>9} {'hit rate':>9} {'out tok/s':>10} {'split':>6} {'misses':>7}"
        "  idle fraction per replica"
    )
    for r in report["methods"]:
        vs = f"{r['vs_naive']:.2f}x" if r["vs_naive"] else "-"
        idle = " ".join(f"{k}={v:.0%}" for k, v in r["idle_fraction"].items())
        print(
            f"{r['method']:>22} {r['wall_seconds']:9.2f} {vs:>9} {r['hit_rate']:9.1%} {r['output_tokens_per_second']:10.1f}"
            f" {r['groups_split']:6d} {r['prefix_misses']:7d}  {idle}"
        )
    print(f"{'ideal':>22} {'':9} {'':9} {report['ideal_hit_rate']:9.1%} {'':10} {0:6d} {report['groups']:7d}")
    print("(split: prefix groups run on more than one replica; misses: prompts that missed their prefix)")
    rounds = len(report["methods"][0]["runs"]) if report["methods"] else 0
    if rounds > 1:
        print(f"(each method: the median-wall run of {rounds} interleaved rounds; all runs in the JSON)")
    print(f"(engine start-up {report['engine_startup_seconds']} s and a {WARMUP_PROMPTS}-prompt warm-up {report.get('warmup_seconds')} s, not timed)")


def plot_methods(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [r["method"] for r in report["methods"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(methods, [r["wall_seconds"] for r in report["methods"]], color="#4477aa")
    ax1.set_ylabel("wall seconds (lower is better)")
    ax1.set_title("Wall time")
    ax2.bar(methods, [100 * r["hit_rate"] for r in report["methods"]], color="#228833")
    ax2.axhline(100 * report["ideal_hit_rate"], color="black", linestyle="--", label="analytic ideal")
    ax2.set_ylabel("prefix-cache hit rate, %")
    ax2.set_title("Prefix-cache hit rate")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=30)
    cfg = report["config"]
    fig.suptitle(
        f"{cfg['num_prompts']} prompts ({cfg['prefix_len']}+{cfg['suffix_len']} tokens, {cfg['num_prefixes']} prefixes), "
        f"{cfg['output_len']} output tokens, {cfg['replicas']} vLLM replicas"
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def cmd_methods(args) -> None:
    if args.quick:
        args.num_prompts = args.num_prompts or 1024
        args.num_prefixes = args.num_prefixes or 128
        args.output_len = args.output_len or 32
        args.naive_batch = args.naive_batch or 128
        args.repeat = args.repeat or 3
    else:
        args.num_prompts = args.num_prompts or 200_000
        args.num_prefixes = args.num_prefixes or 512
        args.output_len = args.output_len or 128
        args.naive_batch = args.naive_batch or 512
    args.repeat = args.repeat or 1
    args.methods = [s.strip() for s in args.methods.split(",")]
    unknown = set(args.methods) - set(METHODS) - set(EXTRA_METHODS)
    if unknown:
        raise usage_error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS + EXTRA_METHODS)}")
    report = asyncio.run(bench_methods_async(args))
    print_methods_table(report)
    write_report(report, args.json, args.plot, plot_methods)


def add_methods_parser(sub) -> None:
    p = sub.add_parser("methods", help="compare naive / continuous / sorted / bucketing on real vLLM replicas")
    p.add_argument("--quick", action="store_true", help="1024 prompts, 128 prefixes, 32 output tokens (minutes on a CPU)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=0, help="default 200000 (1024 with --quick)")
    p.add_argument("--num-prefixes", type=int, default=0, help="default 512 (128 with --quick)")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=0, help="fixed output tokens (default 128; 32 with --quick)")
    p.add_argument("--naive-batch", type=int, default=0, help="naive batch size (default 512; 128 with --quick)")
    p.add_argument(
        "--kv-cache-blocks", type=int, default=128,
        help="KV blocks per replica (128 tokens each on CPU): less than the prefixes need, as on the reference's GPUs",
    )
    p.add_argument("--window", type=int, default=256, help="engine-worker in-flight window (prompts)")
    p.add_argument(
        "--buffer-prompts", type=int, default=0,
        help="bucketer buffer bound in prompts (default: the bucketer's own); far below the number of prompts, "
        "prefix groups leave in fragments and routing decides the hit rate",
    )
    p.add_argument(
        "--repeat", type=int, default=0,
        help="rounds over all methods, interleaved; each method reports its median-wall run (default 1; 3 with --quick)",
    )
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS + EXTRA_METHODS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL)
    p.add_argument("--work-dir", default=".prefixflow/bench", help="outputs and cluster logs")
    p.add_argument("--json", help="write the full report here")
    p.add_argument("--plot", help="write a bar chart PNG here")
    p.set_defaults(fn=cmd_methods)
