"""`prefixflow bench lora`: LoRA adapters sharing system prompts, on two replicas whose
engines run two adapters at once (`--max-loras 2`), routed by prefix and adapter
(prefixflow's default) against round-robin (issue #27).

The job: `--prefixes` system prompts, each under each of `--adapters` random adapters of
the local model (`prefixflow make-model --lora`), `--rows` rows in all (a `lora` column;
the same system prompt under two adapters is two prefixes: vLLM's cache is per adapter).
Each method runs the same job through `prefixflow run` in interleaved rounds (with
`--buffer-prompts` below the job's size, it streams through the bucketer in pieces, as a
job larger than the buffer does); reported:
the job's time without start-up (from the last replica ready, as `bench peers`), its
hit rate against the ideal, the requests vLLM preempted. JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.bench.common import machine_info, write_report
from prefixflow.bench.peer_runs import machine_lock, parse_prefixflow, run_logged
from prefixflow.shared.process import config as cfgmod

METHODS = {"prefix-aware": [], "round-robin": ["--policy", "round-robin"]}
"""Method -> `prefixflow run` flags."""


def lora_job(path: Path, model: str, *, adapters: list[str], rows: int, prefixes: int, prefix_len: int,
             suffix_len: int, seed: int) -> float:
    """Write the job (a Parquet file with a `lora` column); returns its ideal hit rate
    (each (adapter, system prompt) group computed once)."""
    from prefixflow.datagen.dataset import dataset_metadata, prefix_repetition

    table = prefix_repetition(tokenizer_dir=model, num_prompts=rows, prefix_len=prefix_len, suffix_len=suffix_len,
                              num_prefixes=prefixes, seed=seed)
    lora = [adapters[i % len(adapters)] for i in range(rows)]
    groups = len(set(zip(table.column("prefix_id").to_pylist(), lora, strict=True)))
    shared = dataset_metadata(table)["shared_prefix_tokens"] // 128 * 128
    ideal = (rows - groups) * shared / sum(table.column("prompt_len").to_pylist())
    pq.write_table(table.select(["id", "prompt"]).append_column("lora", pa.array(lora).dictionary_encode()), path)
    return ideal


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from prefixflow.datagen.make_lora import make_adapters
    from prefixflow.datagen.make_model import make_model

    work = Path(args.workdir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    if args.model == cfgmod.DEFAULT_MODEL:
        make_model(args.model)
    names = [f"lora{i}" for i in range(args.adapters)]
    paths = make_adapters(names, model_dir=args.model)
    ideal = lora_job(work / "job.parquet", args.model, adapters=names, rows=args.rows, prefixes=args.prefixes,
                     prefix_len=args.prefix_len, suffix_len=args.suffix_len, seed=args.seed)
    engine = ["--lora-modules", *(f"{n}={p}" for n, p in paths.items()), "--max-loras", str(args.max_loras)]
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for method in args.methods.split(","):
            out, cluster = work / "out" / method, work / "cluster" / method
            cmd = [sys.executable, "-m", "prefixflow.cli.main", "run", str(work / "job.parquet"), "--out", str(out),
                   "--overwrite", "--model", args.model, "--replicas", "2", "--workdir", str(cluster), "--no-progress",
                   "--no-report", "--job", f"lora-{method}-{round_}-{int(time.time())}", "--max-tokens",
                   str(args.output_len), "--min-tokens", str(args.output_len), *METHODS[method]]
            if args.kv_cache_blocks:
                cmd += ["--kv-cache-blocks", str(args.kv_cache_blocks)]
            env = {"PFX_BUFFER_PROMPTS": str(args.buffer_prompts)} if args.buffer_prompts else None
            with machine_lock(args.lock):
                stdout, wall = run_logged([*cmd, "--", *engine], work / "logs" / f"{method}-{round_}.log", args.timeout,
                                          env=env)
            summary = json.loads((out / "_summary.json").read_text())
            run = {"method": method, "round": round_, "wall_seconds": round(wall, 3), **parse_prefixflow(summary, stdout)}
            runs.append(run)
            print(f"round {round_} {method}: {run['run_seconds']:.1f} s, hit rate {run['hit_rate']:.3f}, "
                  f"preempted {run['preemptions']}", flush=True)
    med = {}
    for method in args.methods.split(","):
        mine = [r for r in runs if r["method"] == method]
        med[method] = {k: statistics.median(r[k] for r in mine) for k in ("run_seconds", "hit_rate", "preemptions")
                       if all(r[k] is not None for r in mine)}
    return {"machine": machine_info(), "args": vars(args) | {"fn": None}, "ideal_hit_rate": round(ideal, 4),
            "medians": med, "runs": runs}


def print_table(report: dict[str, Any]) -> None:
    med = report["medians"]
    base = med.get("round-robin", {}).get("run_seconds")
    print(f"\nideal hit rate {report['ideal_hit_rate']:.3f}")
    print(f"{'method':14} {'run s':>8} {'hit rate':>9} {'preempted':>10} {'vs round-robin':>15}")
    for method, row in med.items():
        ratio = f"{row['run_seconds'] / base:.2f}x" if base else ""
        print(f"{method:14} {row['run_seconds']:8.1f} {row['hit_rate']:9.3f} {row.get('preemptions', ''):>10} {ratio:>15}")


def cmd_lora(args: argparse.Namespace) -> None:
    report = bench(args)
    print_table(report)
    write_report(report, args.json)


def add_lora_parser(sub) -> None:
    p = sub.add_parser("lora", help="LoRA adapters x shared system prompts: prefix-and-adapter routing vs round-robin")
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL)
    p.add_argument("--adapters", type=int, default=4, help="random adapters of the model (default 4)")
    p.add_argument("--max-loras", type=int, default=2, help="adapters an engine runs at once (default 2)")
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--prefixes", type=int, default=4, help="system prompts, each used under every adapter")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--kv-cache-blocks", type=int, default=80, help="KV blocks per replica (0: what fits)")
    p.add_argument("--buffer-prompts", type=int, default=0,
                   help="the bucketer's buffer (0: its default): a job larger than it streams through in pieces")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=27)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--lock", default=None, help="a lock file held while a run uses the machine")
    p.add_argument("--workdir", default=".prefixflow/bench-lora")
    p.add_argument("--json", default=None)
    p.set_defaults(fn=cmd_lora)
