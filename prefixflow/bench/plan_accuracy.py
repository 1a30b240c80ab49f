"""`prefixflow bench plan`: how right `prefixflow plan --calibrate` is about a real run on
this machine (docs/plan.md, issue 43 must-show 2).

Per shape (`prefixflow dataset SHAPE`, `--rows` rows): `prefixflow plan FILE --calibrate
--json` (its own short real calibration job, then the full file predicted on
`--replicas` replicas here: the `prefix-aware` row of the `Nxhere` fleet), then the real
`prefixflow run FILE` with the same replicas, engine and KV cap. The error is the
prediction against the run's own wall time (`_summary.json`'s `wall_seconds`, the figure
the prediction is of: first replica starting to the last row written). Shapes run one
after the other; with `--rounds` > 1 the shapes are interleaved round by round and each
shape's median error is reported.

    prefixflow bench plan --shapes seed,zipf,hierarchical --json plan-accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixflow.shared.outcomes import CommandError, Exit

TOLERANCE = 0.15
"""The issue's bound on |predicted / measured - 1|."""


def add_plan_accuracy_parser(sub) -> None:
    p = sub.add_parser("plan", help="`plan --calibrate`'s prediction against a real `prefixflow run` of the same file")
    p.add_argument("--shapes", default="seed,zipf,hierarchical", help="`prefixflow dataset` shapes, comma-separated")
    p.add_argument("--rows", type=int, default=512, help="rows per shape's file (the dataset's default)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per row (min_tokens = max_tokens)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--engine", choices=("vllm", "echo"), default="vllm")
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="each replica's KV blocks (0: uncapped)")
    p.add_argument("--calibrate-rows", type=int, default=None, help="default: `plan`'s own")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(fn=cmd_plan_accuracy)


def cli(*argv: str, capture: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "prefixflow.cli.main", *argv]
    done = subprocess.run(cmd, capture_output=capture, text=True)
    if done.returncode != 0:
        raise CommandError(f"`prefixflow {' '.join(argv[:2])} ...` failed (exit {done.returncode}): "
                           f"{(done.stderr or '').strip()[-800:]}", Exit.FAILED)
    return done


def here_prediction(plan: dict) -> float:
    """The plan's prediction of `prefixflow run FILE --replicas N` here."""
    fleet = next(f for f in plan["fleets"] if f["fleet"].endswith("xhere"))
    return float(next(m for m in fleet["methods"] if m["method"] == "prefix-aware")["wall_seconds"])


def one(shape: str, rnd: int, args: argparse.Namespace, model: str, work: Path) -> dict:
    d = work / f"{shape}-{rnd}"
    d.mkdir(parents=True, exist_ok=True)
    data = d / "input.parquet"
    cli("dataset", shape, "--num-prompts", str(args.rows), "--output-len", str(args.output_len), "--seed", str(rnd),
        "--model", model, "--out", str(data))
    common = ["--replicas", str(args.replicas), "--engine", args.engine, "--model", model]
    if args.kv_cache_blocks:
        common += ["--kv-cache-blocks", str(args.kv_cache_blocks)]
    t0 = time.monotonic()
    own = ["--calibrate-rows", str(args.calibrate_rows)] if args.calibrate_rows else []
    plan = json.loads(cli("plan", str(data), "--calibrate", *own, "--json", "--workdir", str(d / "plan"), *common).stdout)
    plan_s = time.monotonic() - t0
    predicted = here_prediction(plan)
    out = d / "out"
    t0 = time.monotonic()
    cli("run", str(data), "--out", str(out), "--no-progress", "--no-report", "--workdir", str(d / "cluster"), *common)
    run_s = time.monotonic() - t0
    summary = json.loads((out / "_summary.json").read_text())
    measured = float(summary["wall_seconds"])
    cal = plan["calibration"]
    row = {
        "shape": shape, "round": rnd, "rows": args.rows, "replicas": args.replicas, "engine": args.engine,
        "predicted_wall_seconds": round(predicted, 1), "measured_wall_seconds": round(measured, 1),
        "error": round(predicted / measured - 1, 4),
        "measured_hit_rate": summary.get("prefix_cache_hit_rate"),
        "calibration": {k: cal[k] for k in ("rows", "measured_wall_seconds", "predicted_wall_seconds", "job_seconds")},
        "plan_seconds": round(plan_s, 1), "run_command_seconds": round(run_s, 1),
    }
    print(f"{shape} (round {rnd}): predicted {predicted:.1f} s, measured {measured:.1f} s, "
          f"error {row['error']:+.1%} (calibration job {cal['rows']} rows: {cal['measured_wall_seconds']} s measured, "
          f"{cal['predicted_wall_seconds']} s fitted)", flush=True)
    return row


def cmd_plan_accuracy(args: argparse.Namespace) -> None:
    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.process.config import DEFAULT_MODEL

    model = str(make_model(os.environ.get("PFX_MODEL", DEFAULT_MODEL)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pfx-bench-plan-"))
    shapes = [s for s in args.shapes.split(",") if s]
    rows = [one(shape, rnd, args, model, work) for rnd in range(args.rounds) for shape in shapes]
    per_shape = {}
    for shape in shapes:
        errs = [r["error"] for r in rows if r["shape"] == shape]
        per_shape[shape] = {"median_error": round(statistics.median(errs), 4), "errors": errs,
                            "within": abs(statistics.median(errs)) <= TOLERANCE}
    report = {"runs": rows, "per_shape": per_shape, "tolerance": TOLERANCE, "load_average": os.getloadavg(),
              "cores": os.cpu_count(), "workdir": str(work)}
    for shape, s in per_shape.items():
        print(f"{shape}: median error {s['median_error']:+.1%} ({'within' if s['within'] else 'OUTSIDE'} "
              f"±{TOLERANCE:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
