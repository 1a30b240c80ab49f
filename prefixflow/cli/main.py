"""`prefixflow`: the one command-line entry point.

    prefixflow make-model [--out DIR] [--lora A,B]  build the local random-weight model (and LoRA adapters)
    prefixflow dataset SHAPE ...                    write a dataset (prefix-repetition, seed, zipf,
                                                    hierarchical, variable, no-sharing)
    prefixflow serve NAME [flags]                   run one service (see --help of each)
    prefixflow run INPUT --out DIR [...]            all-in-one: local cluster + job + summary
    prefixflow submit INPUT --out DIR [--nats URL]  submit a job to a running cluster
    prefixflow bench methods|pipeline|router|batching ...   benchmarks (docs/benchmarks.md)
    prefixflow cluster config --out DIR ...        NATS configs, certificates and env files for a fleet
    prefixflow cluster provision                    create the fleet's streams and buckets (admin)
    prefixflow status [JOB] [--nats URL]            jobs: rows, errors, rate, hit rate, ETA
    prefixflow top [--nats URL]                     live view of replicas, bucketers, jobs
    prefixflow report OUTDIR                        plots of a job (OUTDIR/_report/)
    prefixflow torture --seed N [--minutes M]       seeded torture rounds, checked (docs/torture.md)
    prefixflow plan INPUT --fleet 16xL4 [...]       predicted wall time, GPU-hours and cost per fleet (docs/plan.md)
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import sys
import time
from typing import Any

from prefixflow.shared.outcomes import CommandError, Exit, reported, usage_error
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import subjects
from prefixflow.cli.options import add_job_args, add_run_args, chat_from, default_job_id, sampling_from, storage_options

def print_summary(summary: dict[str, Any], as_json: bool = False) -> None:
    """The job's summary: a table per replica, or (`--json`) the summary itself as JSON."""
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    cols = ("rows", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "prefix_cache_hit_rate", "output_tokens_per_second")
    header = f"{'':8}" + "".join(f"{c:>26}" for c in cols)
    print(header)
    scopes = [("all", summary), *summary.get("replicas", {}).items()]
    for name, s in scopes:
        print(f"{name:8}" + "".join(f"{s.get(c, ''):>26}" for c in cols))
    if summary.get("deduplicated_rows") or summary.get("merged_rows"):
        print(f"generated once for several rows: {summary.get('deduplicated_rows', 0)} deduplicated rows (a copy of an "
              f"identical row's output), {summary.get('merged_rows', 0)} merged rows (one completion each of a shared "
              "request)")
    print(f"wall seconds: {summary.get('wall_seconds')}")


def cmd_make_model(args: argparse.Namespace) -> None:
    from prefixflow.datagen.make_model import make_model

    t0 = time.perf_counter()
    out = make_model(args.out, seed=args.seed, force=args.force)
    print(f"model ready at {out} ({time.perf_counter() - t0:.1f} s)")
    if args.lora:
        from prefixflow.datagen.make_lora import make_adapters

        names = [n for n in args.lora.split(",") if n]
        paths = make_adapters(names, model_dir=out, rank=args.lora_rank, force=args.force)
        modules = " ".join(f"{name}={path}" for name, path in paths.items())
        print(f"LoRA adapters ready ({', '.join(names)}); serve them with:\n  -- --lora-modules {modules}")


def cmd_dataset(args: argparse.Namespace) -> None:
    from prefixflow.datagen.dataset import shape_args, write_prefix_repetition
    from prefixflow.datagen.make_model import make_model

    model = args.model
    if model == cfgmod.DEFAULT_MODEL:
        make_model(model)
    table = write_prefix_repetition(args.out, tokenizer_dir=model, **shape_args(args))
    print(f"wrote {table.num_rows} prompts to {args.out}")


def cmd_serve(args: argparse.Namespace) -> None:
    if args.service == "nats":
        from prefixflow.launch.nats_server import exec_nats

        exec_nats(args.nats_url, args.store_dir)
        return
    if args.service == "api":
        from prefixflow.batchapi.service import serve as serve_api

        serve_api(args)
        return
    from prefixflow.services.registry import serve

    serve(args.service, args)


def cmd_run(args: argparse.Namespace) -> None:
    from prefixflow.launch.run import run_local

    run_local(args, sampling=sampling_from(args), chat=chat_from(args), storage_options=storage_options(args),
              print_summary=functools.partial(print_summary, as_json=args.json),
              new_job=default_job_id(args.input))


def cmd_submit(args: argparse.Namespace) -> None:
    from prefixflow.client.sources import InputError
    from prefixflow.client.submit import ENDINGS, AlreadyDone, ending, submit
    from prefixflow.shared.bus.connection import NatsRefused

    job = args.job or subjects.qualify(default_job_id(args.input), getattr(args, "tenant", ""))
    try:
        status = asyncio.run(
            submit(
                args.input,
                nats_url=args.nats,
                job=job,
                out_dir=args.out,
                sampling=sampling_from(args),
                progress=not args.no_progress,
                timeout=args.timeout,
                overwrite=args.overwrite,
                max_in_flight=args.max_in_flight,
                expires_in=args.expires_in,
                priority=args.priority,
                adopt=args.job is None,
                row_timeout=args.row_timeout,
                dedupe=not args.no_dedupe,
                storage_options=storage_options(args),
                **chat_from(args),
            )
        )
    except InputError as exc:  # before anything was created: missing, no data files, no access, not its format
        raise usage_error(str(exc)) from None
    except ENDINGS as exc:  # failed, cancelled, expired; paused; OUT or the id bound to another job
        raise ending(exc, cluster_stays=True) from None
    except (TimeoutError, NatsRefused) as exc:  # --timeout passed; no NATS (or it refused us)
        raise CommandError(str(exc) or f"cannot reach NATS at {args.nats}", Exit.FAILED) from None
    except AlreadyDone as done:
        print(f"{done} in {args.out}: nothing to send")
        if done.status.summary:
            print_summary(done.status.summary, args.json)
        return
    print(f"job {status.job}: {status.rows} rows ({status.errors} errors) in {args.out}")
    if status.summary:
        print_summary(status.summary, args.json)
    if not args.no_report:
        from prefixflow.report.auto import auto_report

        auto_report(args.out, status.rows)  # when the output directory is on this machine


COMMANDS = ("make-model", "dataset", "serve", "run", "bench", "torture", "simulate", "plan", "cluster", "submit",
            "status", "jobs", "top", "cancel", "report")
"""Every command, in `--help`'s order (a test holds it to the parser's)."""
SERVED = ("ingestor", "bucketer", "router", "engine-worker", "sink", "nats", "api")
"""What `prefixflow serve` runs."""


def build_parser(command: str | None = None, service: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or with `command` only that command's part: each command's
    flags come from its own modules, and a service process (`prefixflow serve NAME`, started
    by the hundred in a fleet's life and at every `run`) imports only its own, not the
    API's web framework or the simulator."""

    def want(*names: str) -> bool:
        return command is None or command in names

    parser = argparse.ArgumentParser(
        prog="prefixflow", description="Distributed batch LLM inference with prefix bucketing.",
        epilog=f"Exit codes: {Exit.OK} done; {Exit.FAILED} failed (the job failed, was cancelled or expired; a "
               f"timeout; NATS or the cluster unreachable or gave up); {Exit.USAGE} refused before anything ran (a "
               "bad flag or input, an invalid or unknown job id, an output directory bound to another job or "
               f"input); {Exit.PAUSED} the job is paused (its output lacks a resource: run the same command again "
               f"once that is fixed); {Exit.INTERRUPTED}+N a signal N stopped it. Every command's codes and every "
               "job state: docs/outcomes.md.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    if want("make-model"):
        add_make_model(sub)
    if want("dataset"):
        add_dataset(sub)
    if want("serve"):
        add_serve(sub, service if command == "serve" else None)
    if want("run"):
        add_run(sub)
    if want("bench"):
        from prefixflow.bench.commands import add_parsers as add_bench_parsers

        p = sub.add_parser("bench", help="benchmarks (methods comparison on vLLM; pipeline throughput)")
        add_bench_parsers(p.add_subparsers(dest="bench", required=True))
    if want("torture"):
        from prefixflow.torture.commands import add_parser as add_torture_parser

        add_torture_parser(sub)  # prefixflow torture (docs/torture.md)
    if want("simulate"):
        from prefixflow.sim.commands import add_parser as add_simulate_parser

        add_simulate_parser(sub)  # prefixflow simulate (docs/simulator.md)
    if want("plan"):
        from prefixflow.cli.plan import add_parser as add_plan_parser

        add_plan_parser(sub)  # prefixflow plan (docs/plan.md)
    if want("cluster"):
        from prefixflow.launch.fleet_config import add_parsers as add_cluster_parsers

        p = sub.add_parser("cluster", help="bring up a fleet: NATS cluster configs and env files for N nodes")
        add_cluster_parsers(p.add_subparsers(dest="cluster", required=True))
    if want("submit"):
        p = sub.add_parser("submit", help="submit INPUT to a running cluster and wait for it")
        add_job_args(p, "submit")
        p.add_argument("--nats", default=os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
        p.set_defaults(fn=cmd_submit)
    if want("status", "jobs", "top"):
        from prefixflow.client.status import add_parsers as add_status_parsers

        add_status_parsers(sub, os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"))  # status, jobs, top
    if want("cancel"):
        from prefixflow.client.lifecycle import add_parsers as add_cancel_parser

        add_cancel_parser(sub, os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"))
    if want("report"):
        from prefixflow.report.job_report import add_parser as add_report_parser

        add_report_parser(sub)
    return parser


def add_make_model(sub) -> None:
    p = sub.add_parser("make-model", help="build the local random-weight model (deterministic, seconds)")
    p.add_argument("--out", default=cfgmod.DEFAULT_MODEL, help=f"model directory (default {cfgmod.DEFAULT_MODEL})")
    p.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    p.add_argument("--lora", default="", metavar="NAME,...",
                   help="also build random LoRA adapters of these names beside the model (DIR-lora/NAME)")
    p.add_argument("--lora-rank", type=int, default=8, help="rank of those adapters (default 8)")
    p.set_defaults(fn=cmd_make_model)


def add_dataset(sub) -> None:
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
    from prefixflow.datagen.dataset import add_shape_parsers

    add_shape_parsers(dsub)  # seed, zipf, hierarchical, variable, no-sharing (docs/datasets.md)


def add_serve(sub, service: str | None = None) -> None:
    """`serve`'s services; with `service` (one of them) only that one's parser: each of the
    others imports modules of its own (the API's, nats-server's, the engine-worker's vLLM
    help), and a service process starts on every node and after every restart."""
    from prefixflow.services.registry import SERVICES, add_parsers

    p = sub.add_parser("serve", help="run one service process")
    ssub = p.add_subparsers(dest="service", required=True)
    if service is None or service in SERVICES:
        add_parsers(ssub, service)  # a process starts faster with only its own parser
    if service in (None, "nats"):
        from prefixflow.launch.nats_server import add_nats_parser

        add_nats_parser(ssub)
    if service in (None, "api"):
        from prefixflow.batchapi.service import add_parser as add_api_parser

        add_api_parser(ssub)
    p.set_defaults(fn=cmd_serve)


def add_run(sub) -> None:
    p = sub.add_parser(
        "run",
        help="start a local cluster, run INPUT through it, print the summary, stop",
        description="Start a local cluster (nats-server and the five services), submit INPUT as soon as the "
        "services are up while the engines load their model (each replica takes work as it becomes ready; "
        "the run gives up if none is ready within 300 s), write the output and its report, print the "
        "summary, stop.",
    )
    add_job_args(p, "run")
    add_run_args(p)
    p.set_defaults(fn=cmd_run)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command != "serve":
        # Client commands: only warnings and errors (the services log at their own level).
        from prefixflow.shared.process.logs import setup_logging

        setup_logging("prefixflow", fmt="console", level="warning")
        if (tenant := os.environ.get("PFX_TENANT", "")) and args.command in ("submit", "status", "cancel", "top"):
            args.tenant = tenant  # a tenant's credentials (`cluster config --tenant`): its jobs are TENANT.JOB
            if getattr(args, "job", None):
                args.job = subjects.qualify(args.job, tenant)
    reported(lambda: args.fn(args))  # a CommandError: `error: <message>`, its exit code (docs/outcomes.md)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; vLLM engine arguments go to the engine-worker (loose or after
    `--`) and to `run`'s replicas (after `--`: `args.engine_argv`)."""
    argv = list(argv)
    engine_argv: list[str] = []
    if argv[:1] == ["run"] and "--" in argv:  # `prefixflow run ... -- <vLLM engine arguments>`
        cut = argv.index("--")
        argv, engine_argv = argv[:cut], argv[cut + 1 :]
    command = argv[0] if argv[:1] and argv[0] in COMMANDS else None
    parser = build_parser(command, argv[1] if command == "serve" and len(argv) > 1 and argv[1] in SERVED else None)
    args, loose = parser.parse_known_args(argv)
    if loose:  # only the engine-worker takes arguments it does not define (vLLM's)
        if not (args.command == "serve" and getattr(args, "service", None) == "engine-worker"):
            parser.error(f"unrecognized arguments: {' '.join(loose)}")
        args.vllm_args = loose + list(getattr(args, "vllm_args", None) or [])
    args.engine_argv = engine_argv
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
