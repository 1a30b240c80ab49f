"""Calibrating the cost model on real `prefixflow run`s, and predicting other runs.

Everything comes from what a run writes in its output directory (`prefixflow.sim.timeline.read_run`):
the summary (wall seconds, hit rate) and every row's replica, token counts and engine
timeline (`started_at`, `finished_at`). Not in the output: the run's
`--kv-cache-blocks` and policy, given on the command line.

Calibration, in two parts:

1. **The engine's step costs** (`c0`, `c_pf`, `c_dec`, `c_ctx`): each replica's requests
   are replayed into the engine model at their real start times and the coefficients
   fitted to the real finish times of every row (`prefixflow.sim.timeline.fit_costs`). The bench's
   calibration run mixes output lengths (`with_output_lengths`): with one output length
   the time of a decode step cannot be told from the time of prefill tokens (both grow
   with the prompt count), and a fit on such a run mispredicts a run with other outputs.
2. **The pipeline's own time**, which the engines do not see: `startup_s`, what the
   real run spent from the job's creation to its first prompt in an engine beyond what
   the simulated pipeline spends (ingest, tokenizing, first bucket), and `tail_s`, from
   the last engine finish to the summary (the sink's last flush). Both measured on the
   calibration run(s), not fitted.

A prediction simulates the whole pipeline (the product's sharding, bucketer, router and
feeding, as `prefixflow simulate` does) with the calibrated profile and compares wall
time and hit rate with the real run's summary. It also replays the real run's own
arrivals into the engine model (`engine_*` fields), which splits an error into the
engine model's share and the pipeline simulation's share.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np

from prefixflow.sim.cluster import Options, simulate
from prefixflow.sim.cost import Profile
from prefixflow.sim.timeline import COEFFICIENTS, Run, fit_costs, read_run, replay

__all__ = ["calibrate", "compare", "read_run", "with_output_lengths"]


def calibrate(runs: list[Run], kv_blocks: list[int], profile: Profile, method: str, opts: Options) -> tuple[Profile, dict]:
    """A profile fitted to `runs` (their engines' KV blocks in `kv_blocks`)."""
    scheduling = scheduling_of(method, opts)
    fitted, detail = fit_costs(runs, profile, kv_blocks, scheduling)
    fitted.startup_s = fitted.tail_s = 0.0
    starts, tails = [], []
    for run, kv in zip(runs, kv_blocks):
        p = Profile.from_dict(asdict(fitted))
        p.kv_blocks = kv
        r = simulate(run.workload, p, len(run.replicas), method, opts)
        starts.append(run.first_start() - r.extra["first_start_seconds"])
        tails.append(run.tail())
    fitted.startup_s = max(float(np.mean(starts)), 0.0)
    fitted.tail_s = max(float(np.mean(tails)), 0.0)
    fitted.notes = (f"calibrated on {', '.join(r.name for r in runs)} ({sum(len(r.workload) for r in runs)} prompts, "
                    f"{len(runs[0].replicas)} replicas): step costs from the per-row timelines, start-up and tail measured")
    detail |= {"startup_s": round(fitted.startup_s, 3), "tail_s": round(fitted.tail_s, 3)}
    return fitted, detail


def scheduling_of(method: str, opts: Options) -> str:
    """How the run's engine-workers ordered their engines' queues."""
    return "fcfs" if method == "daft" else opts.worker.scheduling


def compare(profile: Profile, run: Run, kv_blocks: int, method: str, opts: Options) -> dict:
    """Simulate a real run with a calibrated profile: predicted vs measured, plus the
    engine-only replay of the run's real arrivals."""
    p = Profile.from_dict(asdict(profile))
    p.kv_blocks = kv_blocks
    r = simulate(run.workload, p, len(run.replicas), method, opts)
    rp = replay(run, p, scheduling_of(method, opts))
    span = run.finished.max() - run.first_start()
    prompt = run.workload.total_prompt_tokens()
    outs = sorted({int(x) for x in run.workload.output_len})
    return {
        "run": run.name,
        "prompts": len(run.workload),
        "kv_blocks": kv_blocks,
        "output_lens": outs if len(outs) <= 4 else [outs[0], outs[-1]],
        "measured_wall_seconds": round(run.wall_seconds, 3),
        "predicted_wall_seconds": round(r.wall_seconds, 3),
        "wall_error": round(r.wall_seconds / run.wall_seconds - 1, 4),
        "measured_hit_rate": run.hit_rate,
        "predicted_hit_rate": round(r.hit_rate, 4),
        "hit_error_points": round(100 * (r.hit_rate - run.hit_rate), 2),
        "preemptions": r.preemptions,
        "measured_first_start_s": round(run.first_start(), 3),
        "predicted_first_start_s": round(r.extra["first_start_seconds"], 3),
        "engine_span_measured_s": round(float(span), 3),
        "engine_span_replayed_s": round(float(rp.finished.max() - run.first_start()), 3),
        "engine_replay_error": round(float((rp.finished.max() - run.first_start()) / span - 1), 4),
        "engine_replay_rmse_s": round(float(np.sqrt(np.mean((rp.finished - run.finished) ** 2))), 3),
        "engine_replay_hit_rate": round(float(rp.cached.sum() / prompt), 4),
        "other_cores_during_run": None if run.other_cores is None else round(run.other_cores, 3),
        "solo_rows": solo_rows(run),
        "rows_per_replica_measured": [int(np.sum(run.replica == n)) for n in run.replicas],
        "rows_per_replica_predicted": [int(np.sum(r.replica_of == k)) for k in range(len(run.replicas))],
    }


def solo_rows(run: Run) -> list[dict]:
    """Rows that ran alone on their engine (the worker's first-result probe): the
    cleanest measurement a run has of one request's prefill and decode steps."""
    out = []
    for name in run.replicas:
        rows = np.flatnonzero(run.replica == name)
        for i in rows:
            others = rows[rows != i]
            if not np.any((run.started[others] < run.finished[i]) & (run.finished[others] > run.started[i])):
                out.append({"replica": name, "output_tokens": int(run.workload.output_len[i]),
                            "prompt_tokens": run.workload.prompt_len(int(i)), "cached_tokens": int(run.cached[i]),
                            "seconds": round(float(run.finished[i] - run.started[i]), 4)})
    return out


def coefficients(profile: Profile) -> dict:
    return {c: getattr(profile, c) * profile.speed for c in COEFFICIENTS}


def with_output_lengths(src: str | Path, dst: str | Path, lengths: list[int], seed: int = 0) -> dict[int, int]:
    """Copy a prompt file, giving each row one of `lengths` as its own output length (a
    `sampling` column with `max_tokens` = `min_tokens`, which the pipeline honours per
    row, and `output_len`): as many rows of each length, shuffled with `seed`
    independently of the rows' prefixes. Returns rows per length."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(src)
    n = table.num_rows
    per_row = np.resize(np.asarray(lengths, dtype=np.int32), n)
    np.random.default_rng(seed).shuffle(per_row)
    sampling = pa.array([{"max_tokens": int(x), "min_tokens": int(x)} for x in per_row],
                        type=pa.struct([("max_tokens", pa.int64()), ("min_tokens", pa.int64())]))
    for name, col in (("output_len", pa.array(per_row)), ("sampling", sampling)):
        if name in table.column_names:
            table = table.set_column(table.column_names.index(name), name, col)
        else:
            table = table.append_column(name, col)
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, dst)
    return {int(k): int(v) for k, v in zip(*np.unique(per_row, return_counts=True))}
