"""What `prefixflow plan` predicts (docs/plan.md): the input read as `run` reads it,
sampled (`planner/sample.py`), tokenized with the job's model and simulated by `prefixflow
simulate`'s cluster (the product's own bucketer, router and feeder classes over the GPU's
profile) for each fleet and method; each fleet's row of the workload's limit comes from
`prefixflow/sim/limit.py`. `--calibrate` fits this machine's profile first
(`planner/calibrate.py`)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import messages as m


def plan_job(args: argparse.Namespace, *, sampling: m.SamplingSpec, chat: dict[str, Any],
             storage_options: dict[str, Any]) -> None:
    """`prefixflow plan`: the plan of `args.input` printed (a table, or JSON with `--json`)."""
    from prefixflow.client.sources import InputError, resolve
    from prefixflow.launch.run import model_of
    from prefixflow.sim import plan as P
    from prefixflow.planner.sample import sample_rows, tokenize

    t0 = time.perf_counter()
    fleets = [P.parse_fleet(f) for f in args.fleet or ["16xL4"]]
    prices = P.prices_for(fleets, [P.parse_price(x) for x in args.price])
    if args.sample_rows < 1:
        raise usage_error("--sample-rows wants at least 1")
    model = model_of(args.model)
    if args.model == cfgmod.DEFAULT_MODEL:
        from prefixflow.datagen.make_model import make_model

        make_model(args.model)
    try:
        source = resolve(args.input, storage_options)
        rows, total = sample_rows(source, args.sample_rows, args.sample_seed)
    except InputError as exc:
        raise usage_error(str(exc)) from None
    tok = tokenize(rows, model, sampling, chat, name="input")
    wl = tok.workload
    if not len(wl):
        raise usage_error(f"{args.input}: no row the job could run ({tok.reasons or 'empty input'})")
    ok_rows = round(total * len(wl) / len(rows))
    report: dict[str, Any] = {
        "input": str(source), "rows": total, "sampled_rows": len(rows), "error_rows_in_sample": tok.errors,
        "error_reasons": tok.reasons, "model": model,
        "prompt_tokens_per_row": round(wl.total_prompt_tokens() / len(wl), 1),
        "output_tokens_per_row": round(float(np.mean(wl.output_len)), 1),
    }
    if args.calibrate:
        from prefixflow.planner.calibrate import calibrated_fleet

        fleet, profile, fit = calibrated_fleet(args, rows, wl, model)
        report["calibration"] = fit
        from prefixflow.planner.calibrate import here_options

        report["fleets"] = [plan_fleet(fleet, profile, wl, ok_rows, args.sample_rows, None, args.sample_seed, here_options())]
        if not args.fleet:
            fleets, prices = [], []  # only this machine, unless fleets were asked too
    else:
        report["fleets"] = []
    from prefixflow.sim.cost import with_memory

    memory = (getattr(args, "gpu_memory_utilization", None), getattr(args, "kv_cache_dtype", None))
    report["fleets"] += [plan_fleet(f, with_memory(f.load(), *memory), wl, ok_rows, args.sample_rows, price,
                                    args.sample_seed) for f, price in zip(fleets, prices)]
    report["plan_seconds"] = round(time.perf_counter() - t0, 1)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_plan(report)


def uniform(wl, n: int, seed: int):
    """A uniform subsample of `n` of the workload's prompts, in order."""
    from prefixflow.sim.workload import Workload

    if n >= len(wl):
        return wl
    keep = np.sort(np.random.default_rng(seed).choice(len(wl), size=n, replace=False))
    return Workload(f"{wl.name}[{n}]", [wl.tokens[i] for i in keep], wl.output_len[keep], None, dict(wl.meta),
                    [wl.lora[i] for i in keep] if wl.lora else None)


def plan_fleet(fleet, profile, wl, rows: int, sample_rows: int, price: float | None, seed: int,
               opts=None) -> dict[str, Any]:
    """The plan of one fleet: each method's prediction and the workload's limit (`opts`: the
    simulated product's knobs, default its services' defaults)."""
    from prefixflow.sim import plan as P
    from prefixflow.sim.cluster import Options
    from prefixflow.sim.limit import workload_limit
    from prefixflow.sim.runner import run_many

    sc = P.scale(rows, min(sample_rows, len(wl)), fleet.replicas)
    sub = uniform(wl, sc.sample_rows, seed)
    sub.name = f"{wl.name}@{fleet}"
    profile = P.scaled_profile(profile, sc)
    jobs = [(sub, m, sc.sample_replicas, profile, opts or Options()) for m in P.PLAN_METHODS]
    results = run_many(jobs)
    preds = [P.predict(fleet, r["method"], r["wall_seconds"], r["hit_rate"], price) for r in results]
    limit = workload_limit(sub, profile, sc.sample_replicas)
    hours = limit.wall_seconds * fleet.replicas / 3600
    return {
        "fleet": str(fleet), "gpus": fleet.replicas, "profile": profile.name, "price_per_gpu_hour": price,
        "sample": sc.describe(), "sample_rows": sc.sample_rows, "sample_replicas": sc.sample_replicas,
        "methods": [p.row() for p in preds],
        "limit": {**limit.row(), "gpu_hours": round(hours, 4), "cost": None if price is None else round(hours * price, 4)},
    }


def fmt_seconds(s: float) -> str:
    from prefixflow.client.fmt import fmt_duration

    return fmt_duration(s)


def print_plan(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{report['input']}[/]: {report['rows']:,} rows, {report['prompt_tokens_per_row']:,} prompt and "
                  f"{report['output_tokens_per_row']:,} output tokens per row (tokenized with {report['model']}; "
                  "output: each row's max_tokens)")
    if report["error_rows_in_sample"]:
        console.print(f"[yellow]{report['error_rows_in_sample']} sampled rows would be error rows[/]: "
                      f"{report['error_reasons']}")
    if cal := report.get("calibration"):
        console.print(f"calibrated on a real job ({cal['job']}): {cal['rows']} rows on {cal['replicas']} replicas in "
                      f"{cal['measured_wall_seconds']} s (the fitted profile predicts {cal['predicted_wall_seconds']} s "
                      f"of it; profile: {cal['profile']}). The full job as `prefixflow run` runs it here: the "
                      "prefix-aware row of the first table.")
    for f in report["fleets"]:
        t = Table(title=f"{f['fleet']} ({f['profile']}): {f['sample']}", title_justify="left", header_style="bold")
        for col in ("method", "wall time", "wall s", "GPU-hours", "cost", "hit rate"):
            t.add_column(col, justify="left" if col == "method" else "right")
        lim = f["limit"]
        for r in [*f["methods"], {"method": "limit", "wall_seconds": lim["wall_seconds"], "gpu_hours": lim["gpu_hours"],
                                  "cost": lim["cost"], "hit_rate": lim["ideal_hit_rate"]}]:
            t.add_row(r["method"], fmt_seconds(r["wall_seconds"]), f"{r['wall_seconds']:,.1f}", f"{r['gpu_hours']:,.2f}",
                      "-" if r["cost"] is None else f"{r['cost']:,.2f}", f"{r['hit_rate']:.1%}")
        console.print(t)
    console.print("limit: the workload's lower bound (ideal hit rate, work spread perfectly; docs/plan.md). "
                  f"({report['plan_seconds']} s)")
