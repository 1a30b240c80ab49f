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

import msgspec

from prefixflow.client.window import IN_FLIGHT_ROWS
from prefixflow.shared.outcomes import CommandError, Exit, reported, usage_error
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.limits import ROW_TIMEOUT
from prefixflow.shared.wire.messages import SamplingSpec

def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="generated tokens per prompt, at most (default 128)")
    g.add_argument("--min-tokens", type=int, default=0, help="generated tokens per prompt, at least (default 0)")
    g.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1.0)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (per prompt: seed + id)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s = p.add_argument_group("structured output (one of; rows may give their own: docs/jobs.md)")
    s.add_argument("--json-schema", default=None, help="JSON Schema the output must satisfy (file or JSON text)")
    s.add_argument("--regex", default=None, help="regular expression the output must match")
    s.add_argument("--choice", default=None, help="comma-separated strings; the output is exactly one of them")
    s.add_argument("--grammar", default=None, help="grammar the output must follow (EBNF/GBNF or Lark; file or text)")
    s.add_argument("--response-format", default=None, help="OpenAI response_format object (file or JSON text)")
    c = p.add_argument_group("chat (rows with 'messages')")
    c.add_argument("--chat-template", default="", help="chat template overriding the model's (file or Jinja text)")
    c.add_argument("--chat-template-kwargs", default=None, help="extra template variables, a JSON object")


def sampling_from(args: argparse.Namespace) -> SamplingSpec:
    raw = dict(
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        stop=args.stop or [],
    )
    from prefixflow.shared.wire.sampling import compile_structured, job_structured, user_sampling

    try:
        forms = ("json_schema", "regex", "choice", "grammar", "response_format")
        structured = job_structured({k: getattr(args, k) for k in forms})
        if structured is not None:
            raw["structured"] = structured
        spec = user_sampling(raw)  # strict: the wire's SamplingSpec ignores unknown fields
        compile_structured(spec.structured)  # as vLLM would: refused now, not in an engine
        return spec
    except (msgspec.ValidationError, ValueError, OSError) as exc:
        raise usage_error(f"bad sampling parameters: {exc}") from None


def chat_from(args: argparse.Namespace) -> dict[str, Any]:
    """The job's chat template override and template variables (and its task)."""
    from prefixflow.services.ingestor.chat import load_template

    try:
        kwargs = json.loads(args.chat_template_kwargs) if args.chat_template_kwargs else {}
    except ValueError as exc:
        raise usage_error(f"--chat-template-kwargs is not JSON: {exc}") from None
    if not isinstance(kwargs, dict):
        raise usage_error("--chat-template-kwargs wants a JSON object")
    return {"chat_template": load_template(args.chat_template), "chat_template_kwargs": kwargs, "task": args.task}


JOB_HELP = {
    "run": "job id (default: the job whose output OUT holds, per OUT/_job.json, if it was asked the same input "
           "and spec: resumed if unfinished, its summary printed if done; asked another: exit code 2 unless "
           "--overwrite; else a new id from INPUT's name and the time)",
    "submit": "job id; submitting the same id again (the same input and spec) resumes it (only the rows the "
              "cluster has not written are sent) or, if done, prints its summary; another input or spec under "
              "it: exit code 2 (default: the job bound to OUT if it was asked the same, as for run; else a new id "
              "from INPUT's name and the time)",
}


def weight(text: str) -> int:
    """A job's priority: a whole number from 1 to MAX_PRIORITY."""
    from prefixflow.shared.wire.messages import MAX_PRIORITY

    value = int(text)
    if not 1 <= value <= MAX_PRIORITY:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_PRIORITY}, got {value}")
    return value


def row_timeout(text: str) -> float:
    """A job's row deadline in seconds: 0 (none) or more."""
    value = float(text)
    if not value >= 0:  # NOTE: also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 (no deadline) or more seconds, got {text}")
    return value


def add_job_args(p: argparse.ArgumentParser, command: str) -> None:
    p.add_argument("input", help="the prompts: a Parquet, JSONL or CSV file with a 'prompt' (or 'messages') column "
                   "and optionally 'id'; a directory or a glob of such files (rows numbered across them in name "
                   "order); or a URI: s3://bucket/prefix/, gs://..., hf://..., file://... (docs/inputs.md)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an argument of the input's file system (pyarrow.fs.S3FileSystem / GcsFileSystem), e.g. "
                        "region=eu-west-1 or anonymous=true; repeatable. Credentials otherwise come from the "
                        "environment (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws, GCS application-default). Used on "
                        "this machine only, never sent to the cluster")
    p.add_argument("--endpoint-url", default=None, metavar="URL",
                   help="an S3-compatible server for s3:// inputs (MinIO, Ceph...; as AWS_ENDPOINT_URL)")
    p.add_argument("--out", required=True, help="output directory (part-*.parquet, _summary.json, _job.json), or an "
                   "object store prefix (s3://bucket/prefix/, gs://...) the sink writes with its own credentials "
                   "and must allow (PFX_OUT_ROOT); "
                   "bound to one job, and to the input and spec it was asked: another job or another input or "
                   "spec into it fails (exit code 2, naming the difference) unless --overwrite")
    p.add_argument("--job", default=None, help=JOB_HELP[command])
    p.add_argument("--overwrite", action="store_true",
                   help="OUT holds another job's output (or one of another input or spec): delete it and write this "
                        "job there instead of failing")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds")
    p.add_argument("--max-in-flight", type=int, default=IN_FLIGHT_ROWS, metavar="ROWS",
                   help="publish no further ahead of the written output than this many rows (bounds what the job "
                        f"holds in the cluster's streams) (default {IN_FLIGHT_ROWS})")
    p.add_argument("--expires-in", type=float, default=None, metavar="SECONDS",
                   help="the cluster cancels the job as expired if it is not done this many seconds after it is "
                        "submitted; the rows written stay (default: never)")
    p.add_argument("--priority", type=weight, default=1, metavar="WEIGHT",
                   help="the job's weight while other jobs share the cluster: a job of weight 3 gets three times "
                        "the engine work of a job of weight 1 (default 1)")
    p.add_argument("--row-timeout", type=row_timeout, default=ROW_TIMEOUT, metavar="SECONDS",
                   help="a row not finished this many seconds after an engine first took it becomes an error row "
                        "(time queued before that does not count); 0: no deadline (docs/limits.md) "
                        f"(default {ROW_TIMEOUT:g})")
    p.add_argument("--no-dedupe", action="store_true",
                   help="generate every row on its own; by default rows with the same prompt and sampling are "
                        "generated once: deterministic ones (temperature 0, or the same seed) get a copy of the "
                        "output, sampled ones one completion each of a request with n = their count "
                        "(the summary's deduplicated_rows, merged_rows)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--json", action="store_true", help="print the job's summary as JSON instead of a table")
    p.add_argument("--no-report", action="store_true",
                   help="no end-of-job report in OUT/_report (write it later: `prefixflow report OUT`)")
    p.add_argument("--task", choices=("generate", "embed"), default="generate",
                   help="generate text, or embed (an `embedding` column; `run` starts pooling engines) (default generate)")
    add_sampling_args(p)


def add_run_args(p: argparse.ArgumentParser) -> None:
    """`run`'s own options (its local cluster), beside the job's (`add_job_args`)."""
    p.add_argument("--model", default=os.environ.get("PFX_MODEL", cfgmod.DEFAULT_MODEL), help="model directory or hub id")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--engine", choices=cfgmod.ENGINES, default="vllm", help="engine (default vllm)")
    p.add_argument(
        "--policy", default="prefix-aware", choices=cfgmod.POLICIES, help="routing policy"
    )
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="cap each replica's KV cache (blocks; a context longer than they hold is fitted to them)")
    p.add_argument(
        "--tensor-parallel-size", type=int, default=1,
        help="GPUs per replica (CUDA_VISIBLE_DEVICES; on CPU each replica gets its share of the cores)",
    )
    p.add_argument(
        "--stagger", type=float, default=0.0, metavar="SECONDS",
        help="start replica i's engine i x SECONDS after the first, as a fleet's GPUs come up apart (default 0)",
    )
    p.add_argument("--workdir", default=None, help="cluster directory: logs/, JetStream store, pids.json (default: a new temporary directory)")


def default_job_id(input_path: str) -> str:
    from prefixflow.client.sources import stem_of

    stem = "".join(c if c.isalnum() or c in "-_" else "-" for c in stem_of(input_path))[:40]
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


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
        from prefixflow.launch.local_cluster import exec_nats

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


def storage_options(args: argparse.Namespace) -> dict[str, Any]:
    """`--storage-option KEY=VALUE` and `--endpoint-url` as the input file system's arguments."""
    from prefixflow.client.sources import InputError, parse_options

    try:
        options = parse_options(args.storage_option)
    except InputError as exc:
        raise usage_error(str(exc)) from None
    if args.endpoint_url:
        options["endpoint_override"] = args.endpoint_url
    return options


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
        from prefixflow.report.job_report import auto_report

        auto_report(args.out, status.rows)  # when the output directory is on this machine


def build_parser() -> argparse.ArgumentParser:
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

    p = sub.add_parser("make-model", help="build the local random-weight model (deterministic, seconds)")
    p.add_argument("--out", default=cfgmod.DEFAULT_MODEL, help=f"model directory (default {cfgmod.DEFAULT_MODEL})")
    p.add_argument("--seed", type=int, default=0, help="weights and tokenizer seed (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if the model exists")
    p.add_argument("--lora", default="", metavar="NAME,...",
                   help="also build random LoRA adapters of these names beside the model (DIR-lora/NAME)")
    p.add_argument("--lora-rank", type=int, default=8, help="rank of those adapters (default 8)")
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
    from prefixflow.datagen.dataset import add_shape_parsers

    add_shape_parsers(dsub)  # seed, zipf, hierarchical, variable, no-sharing (docs/datasets.md)

    from prefixflow.launch.local_cluster import add_nats_parser
    from prefixflow.services.registry import add_parsers

    p = sub.add_parser("serve", help="run one service process")
    ssub = p.add_subparsers(dest="service", required=True)
    add_parsers(ssub)
    add_nats_parser(ssub)
    from prefixflow.batchapi.service import add_parser as add_api_parser

    add_api_parser(ssub)
    p.set_defaults(fn=cmd_serve)

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

    from prefixflow.bench.commands import add_parsers as add_bench_parsers

    p = sub.add_parser("bench", help="benchmarks (methods comparison on vLLM; pipeline throughput)")
    add_bench_parsers(p.add_subparsers(dest="bench", required=True))

    from prefixflow.sim.commands import add_parser as add_simulate_parser
    from prefixflow.torture.commands import add_parser as add_torture_parser

    add_torture_parser(sub)  # prefixflow torture (docs/torture.md)

    add_simulate_parser(sub)  # prefixflow simulate (docs/simulator.md)

    from prefixflow.cli.plan import add_parser as add_plan_parser

    add_plan_parser(sub)  # prefixflow plan (docs/plan.md)

    from prefixflow.launch.fleet_config import add_parsers as add_cluster_parsers

    p = sub.add_parser("cluster", help="bring up a fleet: NATS cluster configs and env files for N nodes")
    add_cluster_parsers(p.add_subparsers(dest="cluster", required=True))

    p = sub.add_parser("submit", help="submit INPUT to a running cluster and wait for it")
    add_job_args(p, "submit")
    p.add_argument("--nats", default=os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"), help="NATS URL")
    p.set_defaults(fn=cmd_submit)

    from prefixflow.report.job_report import add_parser as add_report_parser
    from prefixflow.client.lifecycle import add_parsers as add_cancel_parser
    from prefixflow.client.status import add_parsers as add_status_parsers

    add_status_parsers(sub, os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"))  # status, jobs, top
    add_cancel_parser(sub, os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222"))
    add_report_parser(sub)
    return parser


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
    parser = build_parser()
    args, loose = parser.parse_known_args(argv)
    if loose:  # only the engine-worker takes arguments it does not define (vLLM's)
        if not (args.command == "serve" and getattr(args, "service", None) == "engine-worker"):
            parser.error(f"unrecognized arguments: {' '.join(loose)}")
        args.vllm_args = loose + list(getattr(args, "vllm_args", None) or [])
    args.engine_argv = engine_argv
    return args


if __name__ == "__main__":
    main(sys.argv[1:])
