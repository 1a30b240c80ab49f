"""`prefixflow plan --calibrate`: fit this machine's profile on a short real job, then
predict the full job on this machine (docs/plan.md).

1. A calibration input: `--calibrate-rows` rows of the plan's sample (uniform; default
   `calibration_rows`: 192 per replica, so the engines run as many requests at once as
   in the full job), each given
   one of two output lengths (the job's `max_tokens` and a quarter of it, as many rows
   of each: `prefixflow.sim.calibrate.with_output_lengths`): with one output length a
   decode step's cost cannot be told from a prefill token's.
2. A real `prefixflow run` of it here (`--replicas`, `--engine`, `--kv-cache-blocks`, the
   job's model), a local cluster as `run` always starts one; or, with `--nats URL`, a
   `prefixflow submit` of it to that running cluster (the machine is then that cluster,
   with the replicas the job ran on).
3. The `cpu-tiny` profile's step costs fitted to that run's per-row engine timelines, its
   start-up and tail measured (`prefixflow.sim.calibrate.calibrate`, as `prefixflow simulate
   --calibrate` does), and the fit checked by predicting the calibration run itself.
4. The full job predicted with it on `--replicas` replicas of this machine.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from prefixflow.shared.outcomes import CommandError, Exit

ROWS_PER_REPLICA = 192
"""Calibration rows per replica by default: a replica then runs about as many requests at once
as in a long job (the engine-worker's window, up to vLLM's `max_num_seqs`, fills), so the step
costs are fitted where the full job will run. A 96-row job (48 at a time per replica) fitted
costs that over-predicted a 2,048-row run by up to 33 % of its engine time (`prefixflow bench
plan`, docs/plan.md)."""
MIN_ROWS = 96

UNCAPPED_KV_BLOCKS = 4096
"""KV blocks per replica assumed when the run caps none (`--kv-cache-blocks 0`): vLLM's CPU
backend then holds far more than a calibration job or a plan's sample needs."""


def here_options():
    """The simulated product as `prefixflow run` runs it here: one bucketer, and the
    engine-worker's adaptive window with its first-result probe (its default), for the fit
    and for the prediction alike. (Without the probe the fitted profile under-predicted
    its own calibration job by 10-14 %, with it by about 7 %.)"""
    from prefixflow.sim.cluster import Options

    return Options(nodes=1, window_probe=True)


def calibration_rows(replicas: int, input_rows: int) -> int:
    """The calibration job's default size: ROWS_PER_REPLICA per replica, at most half the
    input (the full job is predicted, not run twice), at least MIN_ROWS."""
    return max(min(ROWS_PER_REPLICA * replicas, input_rows // 2), min(MIN_ROWS, input_rows))


def calibration_input(rows: list[dict[str, Any]], n: int, max_tokens: int, seed: int, workdir: Path) -> Path:
    import pyarrow.parquet as pq

    from prefixflow.client.readers import table_of
    from prefixflow.sim.calibrate import with_output_lengths

    pick = sorted(np.random.default_rng(seed).choice(len(rows), size=min(n, len(rows)), replace=False))
    base = workdir / "calibration-rows.parquet"
    table = table_of([{k: v for k, v in rows[i].items() if k != "sampling"} for i in pick])
    pq.write_table(table, base)
    out = workdir / "calibration.parquet"
    with_output_lengths(base, out, sorted({max(1, max_tokens // 4), max_tokens}), seed)
    return out


def calibrated_fleet(args: argparse.Namespace, rows: list[dict[str, Any]], wl, model: str):
    """(the machine as a fleet, its calibrated profile, what the calibration measured)."""
    from prefixflow.sim.calibrate import calibrate, compare
    from prefixflow.sim.cost import load_profile
    from prefixflow.sim.plan import Fleet
    from prefixflow.sim.timeline import read_run

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pfx-plan-calibrate-"))
    workdir.mkdir(parents=True, exist_ok=True)
    max_tokens = int(np.median(wl.output_len))
    n = args.calibrate_rows or calibration_rows(args.replicas, len(rows))
    src = calibration_input(rows, n, max_tokens, args.sample_seed, workdir)
    out = workdir / "out"
    job = f"plan-calibrate-{time.strftime('%Y%m%d-%H%M%S')}"
    if args.nats:  # a running cluster: submit to it
        cmd = [sys.executable, "-m", "prefixflow.cli.main", "submit", str(src), "--out", str(out), "--overwrite",
               "--nats", args.nats, "--job", job, "--no-progress", "--no-report"]
    else:
        cmd = [sys.executable, "-m", "prefixflow.cli.main", "run", str(src), "--out", str(out), "--overwrite",
               "--job", job, "--replicas", str(args.replicas), "--engine", args.engine, "--model", model,
               "--no-progress", "--no-report", "--workdir", str(workdir / "cluster")]
        if args.kv_cache_blocks:
            cmd += ["--kv-cache-blocks", str(args.kv_cache_blocks)]
    print(f"calibrating: a real job of {n} rows ({' '.join(cmd[3:])})", file=sys.stderr, flush=True)
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    job_seconds = time.monotonic() - started
    if done.returncode != 0:
        raise CommandError(f"the calibration job failed (exit {done.returncode}; its work directory: {workdir}): "
                           f"{done.stderr.strip()[-600:]}", Exit.FAILED)
    kv = args.kv_cache_blocks or UNCAPPED_KV_BLOCKS
    opts = here_options()
    run = read_run(out, model)
    replicas = len(run.replicas)
    profile, fit = calibrate([run], [kv], load_profile("cpu-tiny"), "prefix-aware", opts)
    profile.kv_blocks = kv
    profile.name = "calibrated-here"
    profile.save(workdir / "profile.json")
    check = compare(profile, run, kv, "prefix-aware", opts)
    detail = {
        "job": job, "job_seconds": round(job_seconds, 1), "rows": len(run.workload), "replicas": replicas, "engine": args.engine, "kv_blocks": kv,
        "output_lens": check["output_lens"], "measured_wall_seconds": check["measured_wall_seconds"],
        "predicted_wall_seconds": check["predicted_wall_seconds"], "fit": fit,
        "profile": str(workdir / "profile.json"), "run": str(out),
    }
    return Fleet(replicas, "here", "calibrated-here"), profile, detail
