"""`prefixflow bench pipeline`: prompts per second through every service with the `echo`
engine (no model), and each service's peak RSS and CPU time."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec

from bench.common import machine_info
from shared.process import config as cfgmod
from shared.wire import messages as m


def peak_rss_mib(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of a live process, MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return None


async def bench_pipeline_once(args, num_prompts: int) -> dict[str, Any]:
    from client.submit import Submitter
    from launch.local_cluster import LocalCluster, processes
    from datagen.dataset import prefix_repetition, prefix_repetition_ids, shape_args
    from datagen.make_model import make_model
    from shared.prefix.tokenize import load_tokenizer

    model = str(make_model(args.model) if args.model == cfgmod.DEFAULT_MODEL else Path(args.model))
    t_data = time.monotonic()
    shape = shape_args(args) | {"num_prompts": num_prompts}  # the pipeline bench has no --output-len
    if args.pretokenized:  # the dataset's token ids, no text round trip
        _, ids = prefix_repetition_ids(load_tokenizer(model), **shape)
        rows = [{"id": i, "prompt_token_ids": t} for i, t in enumerate(ids.tolist())]
    else:
        table = prefix_repetition(tokenizer_dir=model, output_len=1, **shape)
        rows = [{"id": r["id"], "prompt": r["prompt"]} for r in table.select(["id", "prompt"]).to_pylist()]
    print(f"{num_prompts} prompts generated in {time.monotonic() - t_data:.1f} s", flush=True)
    job = f"pipeline-{num_prompts}"
    shutil.rmtree(Path(args.work_dir) / job, ignore_errors=True)  # a rerun must not resume the last run
    cluster = LocalCluster(
        processes(args.replicas, engine=args.engine),
        workdir=Path(args.work_dir) / job,
        env={"PFX_MODEL": model, "PFX_LOG_LEVEL": "warning"},
    )
    cluster.start()
    try:
        await cluster.wait_ready([f"r{i}" for i in range(args.replicas)], timeout=600)
        async with Submitter(cluster.url) as client:
            spec = m.JobSpec(job=job, out_dir=str(Path(args.work_dir) / job / "out"), sampling=m.SamplingSpec(max_tokens=1))
            await client.create(spec)
            t0 = time.monotonic()
            await client.publish_rows(job, rows)
            published = time.monotonic() - t0
            await client.create(msgspec.structs.replace(spec, total=len(rows)))
            status = await client.wait(job, len(rows), progress=False, timeout=3600)
            wall = time.monotonic() - t0
        rss = {name: peak_rss_mib(p.pid) for name, p in cluster.running.items()}
        cpu = {name: cpu_seconds(p.pid) for name, p in cluster.running.items()}
    finally:
        cluster.stop()
    assert status.rows == num_prompts and status.errors == 0, status
    return {
        "num_prompts": num_prompts,
        "wall_seconds": round(wall, 2),
        "publish_seconds": round(published, 2),
        "prompts_per_second": round(num_prompts / wall, 1),
        "peak_rss_mib": rss,
        "cpu_seconds": cpu,
    }


def cmd_pipeline(args) -> None:
    counts = [args.num_prompts] + ([args.compare] if args.compare else [])
    runs = [asyncio.run(bench_pipeline_once(args, n)) for n in sorted(counts)]
    print()
    names = list(runs[0]["peak_rss_mib"])
    print(f"{'prompts':>9} {'wall s':>8} {'prompts/s':>10}  peak RSS MiB: " + " ".join(f"{n:>9}" for n in names))
    for r in runs:
        print(f"{r['num_prompts']:>9} {r['wall_seconds']:>8} {r['prompts_per_second']:>10}  {'':14}"
              + " ".join(f"{r['peak_rss_mib'][n]!s:>9}" for n in names))
        print(f"{'':>30}  CPU seconds:  " + " ".join(f"{r['cpu_seconds'][n]!s:>9}" for n in names))
    report = {"config": {k: v for k, v in vars(args).items() if k != "fn"}, "machine": machine_info(), "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


def add_pipeline_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="prompts/s through every service with no model, and each service's peak RSS")
    p.add_argument("--engine", choices=("echo",), default="echo", help="echo: no model (measures orchestration only)")
    p.add_argument("--num-prompts", type=int, default=200_000)
    p.add_argument("--compare", type=int, default=0, help="also run this many prompts (e.g. 20000) to compare RSS")
    p.add_argument(
        "--pretokenized", action=argparse.BooleanOptionalAction, default=True,
        help="send prompt_token_ids (measures orchestration; tokenization scales with ingestors) or text",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=64, help="128-token prompts by default (64 + 64)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL, help="tokenizer source")
    p.add_argument("--work-dir", default=".prefixflow/bench")
    p.add_argument("--json", help="write the report here")
    p.set_defaults(fn=cmd_pipeline)
