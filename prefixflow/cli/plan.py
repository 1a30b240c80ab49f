"""`prefixflow plan INPUT --fleet 16xL4 [--fleet 8xH100 ...] [--price 0.80/h] [--json]`:
how long and how much a job would take on each fleet, before running it (docs/plan.md).

    prefixflow plan prompts.parquet --fleet 16xL4 --fleet 128xL4 --price 0.80/h
    prefixflow plan prompts.parquet --calibrate --fleet 2xCPU       # fit this machine first

The command's arguments; what it does is `prefixflow/planner/predict.py`.
"""

from __future__ import annotations

import argparse
import os

from prefixflow.shared.process import config as cfgmod

SAMPLE_ROWS = 6000
"""Rows simulated at most per fleet by default (`--sample-rows`): a 200k-row input at
128 x L4 answers in about a minute on two cores."""


def add_parser(sub) -> None:
    from prefixflow.cli.options import add_sampling_args

    p = sub.add_parser(
        "plan", help="predict a job's wall time, GPU-hours and cost on fleets before running it",
        description="Predict, for each --fleet and method (prefix-aware: prefixflow; sorted: a global sort first; "
        "naive: vLLM's offline batches), the wall time, GPU-hours, cost and prefix-cache hit rate of INPUT as a job, "
        "and the workload's limit (ideal hit rate, perfect balance), by simulating the product's own decisions over "
        "the GPU's profile. Large inputs are sampled: the output says how. docs/plan.md.")
    p.add_argument("input", help="the job's input, as `run` takes it (file, directory, glob or URI)")
    p.add_argument("--fleet", action="append", default=[], metavar="COUNTxGPU",
                   help="a fleet, e.g. 16xL4, 128xL4, 8xH100, 2xCPU (repeatable; default 16xL4)")
    p.add_argument("--price", action="append", default=[], metavar="PRICE/h",
                   help="price per GPU-hour, e.g. 0.80/h: one for every fleet, or one per --fleet in order")
    p.add_argument("--model", default=os.environ.get("PFX_MODEL", cfgmod.DEFAULT_MODEL),
                   help="the job's model: its tokenizer counts the prompts' tokens (default: as run's)")
    p.add_argument("--sample-rows", type=int, default=SAMPLE_ROWS, metavar="N",
                   help=f"simulate at most N rows per fleet: a uniform sample, with the fleet cut in the same "
                        f"proportion (default {SAMPLE_ROWS})")
    p.add_argument("--sample-seed", type=int, default=0, help="the sample's seed (default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8"],
                   help="the fleets' vLLM KV cache dtype (fp8: twice the KV blocks; every method alike)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="the fleets' vLLM share of GPU memory (default 0.9; every method alike)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an argument of the input's file system (as run's)")
    p.add_argument("--endpoint-url", default=None, metavar="URL", help="an S3-compatible server (as run's)")
    p.add_argument("--task", choices=("generate",), default="generate", help=argparse.SUPPRESS)
    cal = p.add_argument_group("calibration on this machine (--calibrate)")
    cal.add_argument("--calibrate", action="store_true",
                     help="first run a short real job here (`prefixflow run` on a sample of INPUT with mixed output "
                          "lengths) to fit this machine's profile, then predict the full job run here")
    cal.add_argument("--calibrate-rows", type=int, default=None, metavar="N",
                     help="rows of the calibration job (default: 192 per replica, at most half the input's rows and "
                          "at least 96): enough for the engines to run as many requests at once as the full job will")
    cal.add_argument("--replicas", type=int, default=2, help="replicas of the calibration job and of the predicted run (default 2)")
    cal.add_argument("--engine", choices=cfgmod.ENGINES, default="vllm", help="engine of the calibration job (default vllm)")
    cal.add_argument("--kv-cache-blocks", type=int, default=0,
                     help="each replica's KV blocks in the calibration job and the prediction, as the run to predict "
                          "will cap them (default: uncapped, taken as 4,096 blocks)")
    cal.add_argument("--nats", default=None, metavar="URL",
                     help="calibrate on this running cluster instead (`prefixflow submit` the calibration job to it; "
                          "the prediction is for its replicas)")
    cal.add_argument("--workdir", default=None, help="where the calibration job runs and writes (default: a temporary directory)")
    add_sampling_args(p)
    p.set_defaults(fn=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from prefixflow.cli.options import chat_from, sampling_from, storage_options
    from prefixflow.planner.predict import plan_job

    plan_job(args, sampling=sampling_from(args), chat=chat_from(args), storage_options=storage_options(args))
