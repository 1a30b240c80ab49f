"""`prefixflow bench batching`: the self-sizing window against static windows, side by side.

Each setting runs its own local cluster (`prefixflow run`'s processes, real vLLM replicas)
with the engine-workers configured for it: `adaptive` (the default: one prompt alone on a
quiet engine, then twice what the engine runs at once) or `static-W` (`--no-adaptive
--window W`: W prompts in flight from the start). Every shape's job runs on every
setting, settings interleaved round by round. Reported per run, from the job's start
(when it was submitted):
- first progress: the progress line first shows work under way (`prefixflow/client/progress.py`);
- first result: an engine finished the first prompt (`_summary.json`'s
  `first_result_seconds`; the row lands within the sink's flush interval);
- throughput: output tokens per second of wall time (start-up excluded).
Ratios are against the best static setting of the same shape and round set (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec

from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import messages as m

SHAPES: dict[str, dict[str, Any]] = {
    # The seed's shape scaled down (256-token prefix from 32, 256-token suffix, 128 output
    # tokens), with a KV cache that holds half the prefixes (64 blocks of 128 tokens).
    "seed": dict(num_prompts=512, prefix_len=256, suffix_len=256, num_prefixes=32, output_len=128, kv_cache_blocks=64),
    # Long outputs: 2000 tokens per prompt (a fixed window makes the first result wait for a
    # whole wave of them).
    "long-output": dict(num_prompts=128, prefix_len=256, suffix_len=256, num_prefixes=16, output_len=2000, kv_cache_blocks=0),
}
DEFAULT_SETTINGS = "adaptive,adaptive-30,static-64,static-256"


def setting_args(setting: str) -> list[str]:
    """Engine-worker arguments of a setting name: `adaptive` (the defaults),
    `adaptive-<seconds>` (a first-result budget of that many seconds) or `static-<window>`."""
    if setting == "adaptive":
        return []
    kind, _, value = setting.partition("-")
    if kind == "adaptive" and value.replace(".", "", 1).isdigit() and float(value) > 0:
        return ["--first-result-seconds", value]
    if kind == "static" and value.isdigit() and int(value) >= 1:
        return ["--no-adaptive", "--window", value]
    raise ValueError(f"unknown setting {setting!r} (adaptive, adaptive-<seconds> or static-<window>)")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians per (shape, setting), with ratios against the best static setting of the
    shape: times as adaptive / static (below 1: sooner), throughput as adaptive / static
    (above 1: faster)."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        cells.setdefault((r["shape"], r["setting"]), []).append(r)
    rows = []
    for (shape, setting), rs in cells.items():
        rows.append(dict(
            shape=shape, setting=setting, rounds=len(rs),
            first_progress_seconds=statistics.median(r["first_progress_seconds"] for r in rs),
            first_result_seconds=statistics.median(r["first_result_seconds"] for r in rs),
            wall_seconds=statistics.median(r["wall_seconds"] for r in rs),
            output_tokens_per_second=statistics.median(r["output_tokens_per_second"] for r in rs),
            hit_rate=statistics.median(r["hit_rate"] for r in rs),
        ))
    for shape in {r["shape"] for r in rows}:
        static = [r for r in rows if r["shape"] == shape and r["setting"].startswith("static")]
        if not static:
            continue
        best = max(static, key=lambda r: r["output_tokens_per_second"])
        for r in rows:
            if r["shape"] == shape:
                r["vs_best_static"] = best["setting"]
                r["throughput_ratio"] = round(r["output_tokens_per_second"] / best["output_tokens_per_second"], 3)
                r["first_result_ratio"] = round(r["first_result_seconds"] / best["first_result_seconds"], 3)
                r["first_progress_ratio"] = round(r["first_progress_seconds"] / best["first_progress_seconds"], 3)
    return sorted(rows, key=lambda r: (r["shape"], r["setting"]))


def print_table(rows: list[dict[str, Any]]) -> None:
    head = f"{'shape':<12} {'setting':<12} {'1st progress':>12} {'1st result':>10} {'tok/s':>8} {'hit':>6}  ratios vs best static (progress, result, throughput)"
    print(head)
    for r in rows:
        ratios = (f"{r['first_progress_ratio']:.2f}, {r['first_result_ratio']:.2f}, {r['throughput_ratio']:.3f} ({r['vs_best_static']})"
                  if "throughput_ratio" in r else "-")
        print(f"{r['shape']:<12} {r['setting']:<12} {r['first_progress_seconds']:11.1f}s {r['first_result_seconds']:9.1f}s "
              f"{r['output_tokens_per_second']:8.1f} {r['hit_rate']:6.1%}  {ratios}")


async def run_shape(url: str, shape: str, rows: list[dict], out_dir: Path, output_len: int, tag: str) -> dict[str, Any]:
    """One job through the running cluster, timed as a user would see it."""
    from prefixflow.client.submit import Submitter

    job = f"bench-{shape}-{tag}"
    shutil.rmtree(out_dir, ignore_errors=True)
    sampling = m.SamplingSpec(max_tokens=output_len, min_tokens=output_len, ignore_eos=True)
    async with Submitter(url) as client:
        spec = m.JobSpec(job=job, out_dir=str(out_dir.resolve()), sampling=sampling, created_at=time.time())
        await client.create(spec)
        await client.publish_rows(job, rows)
        await client.create(msgspec.structs.replace(spec, total=len(rows)))
        status = await client.wait(job, len(rows), progress=False, timeout=3600)
    summary = status.summary or json.loads((out_dir / "_summary.json").read_text())
    return dict(
        shape=shape,
        first_progress_seconds=round((client.first_progress or spec.created_at) - spec.created_at, 3),
        first_result_seconds=summary["first_result_seconds"],
        wall_seconds=summary["wall_seconds"],
        output_tokens_per_second=summary["output_tokens_per_second"],
        hit_rate=summary["prefix_cache_hit_rate"],
        errors=summary["errors"],
    )


def cmd_batching(args: argparse.Namespace) -> None:
    from prefixflow.datagen.dataset import prefix_repetition
    from prefixflow.launch.local_cluster import LocalCluster, processes
    from prefixflow.datagen.make_model import make_model

    model = str(make_model(args.model) if args.model == cfgmod.DEFAULT_MODEL else Path(args.model).resolve())
    work = Path(args.work_dir)
    (work / "out").mkdir(parents=True, exist_ok=True)
    shapes = args.shapes.split(",")
    settings = args.settings.split(",")
    for s in settings:
        setting_args(s)  # fail before any cluster starts
    tables = {}
    for shape in shapes:
        p = SHAPES[shape]
        t = prefix_repetition(tokenizer_dir=model, num_prompts=max(1, round(p["num_prompts"] * args.scale)), prefix_len=p["prefix_len"],
                              suffix_len=p["suffix_len"], num_prefixes=p["num_prefixes"], output_len=p["output_len"], seed=0)
        tables[shape] = [{"id": r["id"], "prompt": r["prompt"]} for r in t.select(["id", "prompt"]).to_pylist()]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        # Rotate the order each round: no setting always runs first on a cold machine.
        order = settings[round_ % len(settings):] + settings[: round_ % len(settings)]
        for setting in order:
            for shape in shapes:
                p = SHAPES[shape]
                engine_args = setting_args(setting) + (["--kv-cache-blocks", str(p["kv_cache_blocks"])] if p["kv_cache_blocks"] else [])
                cluster = LocalCluster(processes(args.replicas, engine="vllm", extra_engine_args=engine_args),
                                       workdir=work / "cluster" / f"{setting}-{shape}-{round_}",
                                       env={"PFX_MODEL": model, "PFX_LOG_LEVEL": "warning",
                                            "PFX_OUT_ROOT": str((work / "out").resolve())})
                cluster.start()
                try:
                    startup = asyncio.run(cluster.wait_ready([f"r{i}" for i in range(args.replicas)], timeout=600))
                    r = asyncio.run(run_shape(cluster.url, shape, tables[shape], work / "out" / f"{shape}-{setting}",
                                              p["output_len"], f"{setting}-{round_}-{int(time.time())}"))
                finally:
                    cluster.stop()
                r.update(setting=setting, round=round_, startup_seconds=round(startup, 1))
                runs.append(r)
                print(f"round {round_} {shape:<12} {setting:<12} progress {r['first_progress_seconds']:5.1f} s  "
                      f"result {r['first_result_seconds']:6.1f} s  wall {r['wall_seconds']:6.1f} s  "
                      f"{r['output_tokens_per_second']:7.1f} tok/s  hit {r['hit_rate']:.1%}", flush=True)
    rows = summarize(runs)
    print_table(rows)
    from prefixflow.bench.common import machine_info, write_report

    write_report(dict(machine=machine_info(), shapes={s: SHAPES[s] for s in shapes}, replicas=args.replicas,
                      rows=rows, runs=runs), args.json)


def add_batching_parser(sub) -> None:
    p = sub.add_parser("batching", help="self-sizing engine window against static windows (real vLLM replicas)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--settings", default=DEFAULT_SETTINGS,
                   help="comma-separated: adaptive, adaptive-<first-result seconds>, static-<window>")
    p.add_argument("--rounds", type=int, default=3, help="rounds over all settings, interleaved (medians reported)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--scale", type=float, default=1.0, help="multiply every shape's number of prompts (a quick look: 0.25)")
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL)
    p.add_argument("--work-dir", default=".prefixflow/bench-batching", help="outputs and cluster logs")
    p.add_argument("--json", help="write the runs and medians here")
    p.set_defaults(fn=cmd_batching)
