"""The options every job takes, shared by `run`, `submit`, `plan` and the Python API
(`prefixflow.api`): their argparse definitions and what they build (a `SamplingSpec`,
the chat options, the input file system's arguments, a default job id)."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import msgspec

from prefixflow.client.window import IN_FLIGHT_ROWS
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process import config as cfgmod
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
