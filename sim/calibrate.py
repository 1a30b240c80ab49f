"""Calibrating the cost model on a real `prefixflow run`, and predicting other runs.

Everything comes from what a run already writes in its output directory:
- `_summary.json`: wall seconds, replicas, token totals, hit rate;
- the Parquet parts: every row with its `id`, `prompt` (re-tokenized with the run's
  model, as the ingestor did), `prompt_tokens`, `cached_tokens`, `output_tokens` and
  `replica`; each part's modification time is when the sink wrote it, so parts give a
  per-replica timeline of completed rows (at the sink's flush granularity, <= 0.5 s).

Not in the output: the run's `--kv-cache-blocks` and policy, passed on the command line.

The fit: simulate the run at speed 1 with no start-up delay, then fit wall-clock
completion times T(q) = start + speed x t_sim(q) over the quantiles q of completed rows
(least squares); repeated over a grid of fixed step costs `c0`, keeping the best. Three
parameters: `c0` (the fixed cost of an engine step: scheduling, sampling, the forward
pass's overhead), `speed` (how fast this machine runs the model: the scale of every
step cost) and `start` (what the pipeline spends before the engines finish anything
beyond the simulated work: ingest, tokenizing, first routing). Predictions reuse them.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np

from sim.cluster import Options, simulate
from sim.cost import Profile
from sim.workload import Workload


def read_run(out_dir: str | Path, model: str | None = None) -> tuple[Workload, dict, np.ndarray]:
    """(workload in id order with real output lengths, summary, real completion offsets
    in seconds from the job's start, one per row)."""
    import pyarrow.parquet as pq

    out = Path(out_dir)
    summary = json.loads((out / "_summary.json").read_text())
    parts = sorted(out.glob("part-*.parquet"))
    if not parts:
        raise SystemExit(f"{out}: no part-*.parquet")
    mtimes = [os.path.getmtime(p) for p in parts]
    finished = max(mtimes)
    start = finished - summary["wall_seconds"]
    ids, prompts, out_tokens, when, prompt_tokens = [], [], [], [], []
    for p, mt in zip(parts, mtimes):
        t = pq.read_table(p, columns=["id", "prompt", "output_tokens", "prompt_tokens", "error"])
        ok = [e is None for e in t.column("error").to_pylist()]
        for i, pr, o, n, good in zip(t.column("id").to_pylist(), t.column("prompt").to_pylist(),
                                     t.column("output_tokens").to_pylist(), t.column("prompt_tokens").to_pylist(), ok):
            if good:
                ids.append(i)
                prompts.append(pr)
                out_tokens.append(o)
                prompt_tokens.append(n)
                when.append(mt - start)
    order = np.argsort(np.asarray(ids))
    import pyarrow as pa

    tmp = out / "_calibration_input.parquet"
    pq.write_table(pa.table({"prompt": [prompts[k] for k in order], "output_len": [out_tokens[k] for k in order]}), tmp)
    from sim.workload import from_file

    wl = from_file(tmp, model=model)
    tmp.unlink()
    wl.name = out.name
    got = np.array([wl.prompt_len(k) for k in range(len(wl))])
    want = np.asarray(prompt_tokens)[order]
    if not np.array_equal(got, want):
        raise SystemExit(f"{out}: re-tokenized prompts differ from the run's prompt_tokens ({int(np.sum(got != want))} rows): wrong --model?")
    return wl, summary, np.sort(np.asarray(when))


QUANTILES = np.linspace(0.05, 1.0, 20)


C0_GRID = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032)
"""Candidate fixed step costs (seconds, before `speed`) for the fit."""


def fit(profile: Profile, wl: Workload, summary: dict, real_times: np.ndarray, method: str, opts: Options) -> tuple[Profile, dict]:
    """Fit `c0` (the fixed cost of a step, over `C0_GRID`), `speed` and the start offset
    to the run's completion timeline, by least squares over its quantiles."""
    real_q = np.quantile(real_times, QUANTILES)
    best = None
    for c0 in C0_GRID:
        p = Profile.from_dict(asdict(profile))
        p.speed, p.startup_s, p.c0 = 1.0, 0.0, c0
        r = simulate(wl, p, len(summary["replicas"]), method, opts)
        sim_q = np.quantile(r.finish_times, QUANTILES)
        (speed, start), res, *_ = np.polyfit(sim_q, real_q, 1, full=True)
        err = float(res[0]) if len(res) else 0.0
        if speed > 0 and (best is None or err < best[0]):
            best = (err, c0, float(speed), float(start), sim_q)
    err, c0, speed, start, sim_q = best
    fitted = Profile.from_dict(asdict(profile))
    fitted.c0, fitted.speed, fitted.startup_s = c0, speed, max(start, 0.0)
    fitted.notes = f"calibrated on {summary.get('job')} ({len(wl)} prompts, {len(summary['replicas'])} replicas)"
    return fitted, {"c0": c0, "speed": round(speed, 4), "start_s": round(start, 3), "residual_s2": round(err, 4),
                    "sim_quantiles_s": np.round(sim_q, 2).tolist(), "real_quantiles_s": np.round(real_q, 2).tolist()}


def compare(profile: Profile, wl: Workload, summary: dict, real_times: np.ndarray, method: str, opts: Options) -> dict:
    """Simulate a real run with a calibrated profile: predicted vs measured."""
    r = simulate(wl, profile, len(summary["replicas"]), method, opts)
    real_wall = summary["wall_seconds"]
    real_hit = summary["prefix_cache_hit_rate"]
    return {
        "run": summary.get("job"),
        "prompts": len(wl),
        "measured_wall_seconds": real_wall,
        "predicted_wall_seconds": round(r.wall_seconds, 2),
        "wall_error": round(r.wall_seconds / real_wall - 1, 4),
        "measured_hit_rate": real_hit,
        "predicted_hit_rate": round(r.hit_rate, 4),
        "hit_error_points": round(100 * (r.hit_rate - real_hit), 2),
        "preemptions": r.preemptions,
    }
