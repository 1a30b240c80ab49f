"""`prefixflow`: the one command-line entry point.

    prefixflow make-model [--out DIR]               build the local random-weight model
    prefixflow dataset prefix-repetition ...        write a prefix-repetition dataset
    prefixflow serve NAME [flags]                   run one service (see --help of each)
    prefixflow run INPUT --out DIR [...]            all-in-one: local cluster + job + summary
    prefixflow submit INPUT --out DIR [--nats URL]  submit a job to a running cluster
    prefixflow bench methods|pipeline ...          benchmarks (docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from shared.process import config as cfgmod
from shared.wire.messages import SamplingSpec


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt, at most (default 128)")
    g.add_argument("--min-tokens", type=int, default=0, help="generated tokens per prompt, at least (default 0)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per prompt: seed + id)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")


def sampling_from(args: argparse.Namespace) -> SamplingSpec:
    raw = dict(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    try:
        return msgspec.convert(raw, SamplingSpec)
    except (msgspec.ValidationError, ValueError) as exc:
        raise SystemExit(f"bad sampling parameters: {exc}") from None


def add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("input", help="Parquet or JSONL file with a 'prompt' column (and optionally 'id')")
    p.add_argument("--out", required=True, help="output directory (part-*.parquet, _summary.json)")
    p.add_argument("--job", default=None, help="job id; re-submitting the same id resumes it (default: new id)")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    add_sampling_args(p)


def default_job_id(input_path: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in Path(input_path).stem)[:40]
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def print_summary(summary: dict[str, Any]) -> None:
    cols = ("rows", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "prefix_cache_hit_rate", "output_tokens_per_second")
    header = f"{'':8}" + "".join(f"{c:>26}" for c in cols)
    print(header)
    scopes = [("all", summary), *summary.get("replicas", {}).items()]
    for name, s in scopes:
        print(f"{name:8}" + "".join(f"{s.get(c, ''):>26}" for c in cols))
    print(f"wall seconds: {summary.get('wall_seconds')}")


def cmd_make_model(args: argparse.Namespace) -> None:
    from cli.make_model import make_model

    t0 = time.perf_counter()
    out = make_model(args.out, seed=args.seed, force=args.force)
    print(f"model ready at {out} ({time.perf_counter() - t0:.1f} s)")


def cmd_dataset(args: argparse.Namespace) -> None:
    from cli.dataset import shape_args, write_prefix_repetition
    from cli.make_model import make_model

    model = args.model
    if model == cfgmod.DEFAULT_MODEL:
        make_model(model)
    table = write_prefix_repetition(args.out, tokenizer_dir=model, **shape_args(args))
    print(f"wrote {table.num_rows} prompts to {args.out}")


def cmd_serve(args: argparse.Namespace) -> None:
    if args.service == "nats":
        from cli.local_cluster import exec_nats

        exec_nats(args.nats_url, args.store_dir)
        return
    from services.registry import serve

    serve(args.service, args)


def cmd_submit(args: argparse.Namespace) -> None:
    from cli.submit import submit

    job = args.job or default_job_id(args.input)
    status = asyncio.run(
        submit(
            args.input,
            nats_url=args.nats,
            job=job,
            out_dir=args.out,
            sampling=sampling_from(args),
            progress=not args.no_progress,
            timeout=args.timeout,
        )
    )
    print(f"job {job}: {status.rows} rows ({status.errors} errors) in {args.out}")
    if status.summary:
        print_summary(status.summary)


def cmd_run(args: argparse.Namespace) -> None:
    from cli.submit import submit
    from cli.local_cluster import LocalCluster, processes
    from cli.make_model import make_model

    sampling = sampling_from(args)
    if args.model == cfgmod.DEFAULT_MODEL:
        make_model(args.model)
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    extra = ["--kv-cache-blocks", str(args.kv_cache_blocks)] if args.kv_cache_blocks else []
    cluster = LocalCluster(
        processes(args.replicas, engine=args.engine, extra_engine_args=extra),
        env={"PFX_MODEL": model, "PFX_POLICY": args.policy},
    )
    job = args.job or default_job_id(args.input)
    print(f"starting local cluster (logs: {cluster.workdir / 'logs'}) ...", flush=True)
    cluster.start()
    try:
        replicas = [f"r{i}" for i in range(args.replicas)]
        startup = asyncio.run(cluster.wait_ready(replicas))
        print(f"{len(replicas)} replicas ready in {startup:.1f} s (not counted in the job's wall time)", flush=True)
        status = asyncio.run(
            submit(
                args.input,
                nats_url=cluster.url,
                job=job,
                out_dir=args.out,
                sampling=sampling,
                model=model,
                progress=not args.no_progress,
                timeout=args.timeout,
                check=cluster.check_alive,
            )
        )
    finally:
        cluster.stop()
    print(f"job {job}: {status.rows} rows ({status.errors} errors) in {args.out}")
    if status.summary:
        print_summary(status.summary)
        print(json.dumps(status.summary, indent=2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixflow", description="Distributed batch LLM inference with prefix bucketing.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-model", help="build the local random-weight model (deterministic, seconds)")
    p.add_argument("--out", default=cfgmod.DEFAULT_MODEL, help=f"model directory (default {cfgmod.DEFAULT_MODEL})")
    p.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    p.set_defaults(fn=cmd_make_model)

    p = sub.add_parser("dataset", help="generate datasets")
    dsub = p.add_subparsers(dest="kind", required=True)
    d = dsub.add_parser("prefix-repetition", help="P random prefixes, each shared by N/P prompts (vLLM's shape)")
    d.add_argument("--num-prompts", type=int, default=256)
    d.add_argument("--prefix-len", type=int, default=256, help="shared prefix tokens")
    d.add_argument("--suffix-len", type=int, default=256, help="unique suffix tokens")
    d.add_argument("--num-prefixes", type=int, default=8)
    d.add_argument("--output-len", type=int, default=128, help="recorded in the output_len column")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--model", default=cfgmod.DEFAULT_MODEL, help="model whose tokenizer turns token ids into text")
    d.add_argument("--out", required=True, help="output .parquet file")
    d.set_defaults(fn=cmd_dataset)

    from cli.local_cluster import add_nats_parser
    from services.registry import add_parsers

    p = sub.add_parser("serve", help="run one service process")
    ssub = p.add_subparsers(dest="service", required=True)
    add_parsers(ssub)
    add_nats_parser(ssub)
    p.set_defaults(fn=cmd_serve)

    p = sub.add_parser("run", help="start a local cluster, run INPUT through it, print the summary, stop")
    add_job_args(p)
    p.add_argument("--model", default=os.environ.get("PFX_MODEL", cfgmod.DEFAULT_MODEL), help="model directory or hub id")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--engine", choices=cfgmod.ENGINES, default="vllm", help="engine (default vllm)")
    p.add_argument(
        "--policy", default="prefix-aware", choices=cfgmod.POLICIES, help="routing policy"
    )
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="cap each replica's KV cache (blocks)")
    p.set_defaults(fn=cmd_run)

    from cli.bench import add_parsers as add_bench_parsers

    p = sub.add_parser("bench", help="benchmarks (methods comparison on vLLM; pipeline throughput)")
    add_bench_parsers(p.add_subparsers(dest="bench", required=True))

    p = sub.add_parser("submit", help="submit INPUT to a running cluster and wait for it")
    add_job_args(p)
    p.add_argument("--nats", default=os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
    p.set_defaults(fn=cmd_submit)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command != "serve":
        # Client commands: only warnings and errors (the services log at their own level).
        from shared.process.logs import setup_logging

        setup_logging("prefixflow", fmt="console", level="warning")
    args.fn(args)


if __name__ == "__main__":
    main(sys.argv[1:])
