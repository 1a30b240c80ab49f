"""A real run's per-replica timeline, replayed through the engine model to fit step costs.

Every output row of `prefixflow run` says when its prompt entered its replica's engine
(`started_at`) and when it finished (`finished_at`), with its `replica`,
`prompt_tokens`, `cached_tokens` and `output_tokens`. Replaying each replica's
requests into the simulated engine (`prefixflow.sim.engine`) at their real `started_at` times
isolates the engine from the rest of the pipeline: the simulated finish time of every
request depends only on the step-cost coefficients. A run of 400 prompts gives 400
residuals, taken at every point of the run: while prefill dominates (admission waves),
in decode-only stretches, at the tail as the batch drains.

The fit compares completion curves, not single rows: for each replica and output length,
the k-th of its rows to finish in the replay against the k-th to finish in the real run
(the engine's queue order is chaotic: a 0.2 % change of every coefficient can reorder
it). Given a schedule, finish times are linear in the coefficients (the start of the
busy period plus the sum of `c0 + c_pf x prefill + c_dec x decoding + c_ctx x context`
over the steps up to the row's last), which gives least-squares starting points; the
schedule itself moves with the coefficients, so the answer comes from a Nelder-Mead
search on the replay itself (400 replays of a 400-row run: seconds).

The cost model is what `prefixflow.sim.cost.Profile.step_seconds` computes; the replay uses the
same `Engine` the cluster simulation uses, with the worker's prefix-group priorities
computed by the product's `EngineOrder` in submission order.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from prefixflow.services.engine_worker.grouping import EngineOrder
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process.config import EngineWorkerConfig
from prefixflow.sim.cost import Profile
from prefixflow.sim.engine import Engine, EngineConfig, Req
from prefixflow.sim.workload import Workload

COEFFICIENTS = ("c0", "c_pf", "c_dec", "c_ctx")
"""The step-cost coefficients the timeline fit solves for (seconds per step, per prefill
token, per decoding request, per context token)."""


@dataclass
class Run:
    """What a real `prefixflow run` wrote, in id order (ok rows only)."""

    name: str
    summary: dict
    workload: Workload
    """The prompts (re-tokenized as the ingestor did) with their real output lengths."""
    replica: np.ndarray
    """Replica name per row."""
    started: np.ndarray
    """Seconds from the job's creation until the prompt entered its engine."""
    finished: np.ndarray
    """Seconds from the job's creation until the engine finished it."""
    cached: np.ndarray
    """vLLM's `num_cached_tokens` per row."""
    other_cores: float | None = None
    """Mean CPU cores other processes used during the job (`_cpu.json` from
    `python -m prefixflow.sim.cpuwatch`, when the run was measured with it)."""

    @property
    def wall_seconds(self) -> float:
        return float(self.summary["wall_seconds"])

    @property
    def hit_rate(self) -> float:
        return float(self.summary["prefix_cache_hit_rate"])

    @property
    def replicas(self) -> list[str]:
        return sorted(self.summary["replicas"])

    def first_start(self) -> float:
        """Job creation to the first prompt in an engine: ingest, tokenizing, bucketing,
        routing (the pipeline's latency)."""
        return float(self.started.min())

    def tail(self) -> float:
        """Last engine finish to the summary: the sink's last flush and the summary."""
        return float(self.wall_seconds - self.finished.max())


def read_run(out_dir: str | Path, model: str | None = None) -> Run:
    """Read a run's `_summary.json` and Parquet parts; re-tokenize prompts with `model`
    (default: the local tiny model) and check them against the run's `prompt_tokens`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prefixflow.sim.workload import from_file

    out = Path(out_dir)
    summary = json.loads((out / "_summary.json").read_text())
    parts = sorted(out.glob("part-*.parquet"))
    if not parts:
        raise usage_error(f"{out}: no part-*.parquet")
    cols = ["id", "prompt", "prompt_tokens", "cached_tokens", "output_tokens", "replica", "started_at", "finished_at", "error"]
    t = pa.concat_tables([pq.read_table(p, columns=cols) for p in parts]).to_pydict()
    if any(s is None for s in t["started_at"]):
        raise usage_error(f"{out}: rows without started_at (a run from before per-row timelines)")
    keep = [k for k, e in enumerate(t["error"]) if e is None]
    keep.sort(key=lambda k: t["id"][k])
    col = {c: [t[c][k] for k in keep] for c in cols}
    tmp = out / "_timeline_input.parquet"
    pq.write_table(pa.table({"prompt": col["prompt"], "output_len": col["output_tokens"]}), tmp)
    try:
        wl = from_file(tmp, model=model)
    finally:
        tmp.unlink()
    wl.name = out.name
    got = np.array([wl.prompt_len(k) for k in range(len(wl))])
    want = np.asarray(col["prompt_tokens"])
    if not np.array_equal(got, want):
        raise usage_error(f"{out}: re-tokenized prompts differ from the run's prompt_tokens ({int(np.sum(got != want))} rows): wrong --model?")
    created = summary["created_at"]
    other = None
    if (out / "_cpu.json").exists():
        from prefixflow.sim.cpuwatch import others_between

        other = others_between(json.loads((out / "_cpu.json").read_text()), created, summary["finished_at"])
    return Run(
        name=summary.get("job") or out.name,
        summary=summary,
        workload=wl,
        replica=np.asarray(col["replica"]),
        started=np.asarray(col["started_at"], dtype=float) - created,
        finished=np.asarray(col["finished_at"], dtype=float) - created,
        cached=np.asarray(col["cached_tokens"], dtype=np.int64),
        other_cores=other,
    )


RELEASE_EPS = 0.02
"""A prompt that entered its engine within this many seconds after another prompt of the
same replica finished was let in by that completion (the worker's window was full)."""


@dataclass
class Feed:
    """How one replica's worker fed its engine in the real run, in start order: for
    each row the in-flight limit it started under (the rows in flight right after it
    started) and the earliest time it may start in a replay."""

    rows: np.ndarray
    limit: np.ndarray
    available: np.ndarray
    """`started_at` for a row that started while the window had room (it had only just
    arrived); -inf for a row a completion let in (it was waiting at the worker, so in a
    replay it starts as soon as the replayed engine frees a place)."""


def feeds(run: Run) -> list[Feed]:
    """The real feeding of every replica (`Feed`), from the rows' start and finish times."""
    out = []
    for name in run.replicas:
        rows = np.flatnonzero(run.replica == name)
        rows = rows[np.argsort(run.started[rows], kind="stable")]
        st, fi = run.started[rows], run.finished[rows]
        limit = np.empty(len(rows), dtype=np.int64)
        available = st.copy()
        fin_sorted = np.sort(fi)
        for k in range(len(rows)):
            # in flight right after row k started: started no later (and before it in
            # order), not finished by then
            limit[k] = int(np.sum(fi[: k + 1] > st[k] + 1e-9))
            j = np.searchsorted(fin_sorted, st[k], side="right")
            if j > 0 and st[k] - fin_sorted[j - 1] <= RELEASE_EPS:
                available[k] = -np.inf
        out.append(Feed(rows, np.maximum(limit, 1), available))
    return out


@dataclass
class Replay:
    """The engine model fed each replica's prompts the way its real worker did."""

    started: np.ndarray
    """Replayed start time per row (seconds from the job's creation)."""
    finished: np.ndarray
    """Replayed finish time per row."""
    cached: np.ndarray
    """Replayed cached prompt tokens per row."""
    design: np.ndarray
    """Per row: the sums of each step feature (1, prefill tokens, decoding requests,
    context tokens) over its busy period up to its last step; `finished = offset +
    design @ coefficients`."""
    offset: np.ndarray
    """Per row: the start of its busy period plus steps that cost a fixed time."""
    preemptions: int
    decoding: float
    """Mean decoding requests per model step (how full the replayed engines ran)."""


class _Recorder:
    """A step-cost function that remembers each step's features."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.last: tuple[int, int, int] | None = None

    def __call__(self, prefill: int, decoding: int, context: int) -> float:
        self.last = (prefill, decoding, context)
        return self.profile.step_seconds(prefill, decoding, context)


def replay(run: Run, profile: Profile, scheduling: str = "prefix-groups", worker: EngineWorkerConfig | None = None,
           feed: list[Feed] | None = None) -> Replay:
    """Feed every replica's prompts to a simulated engine in their real order, closed
    loop as the real worker fed them (`feeds`): a prompt a completion let in starts when
    the replayed engine has fewer than its limit in flight, a prompt that arrived to a
    window with room starts at its real time. So a replayed engine slower or faster
    than the real one gets its work later or sooner, as the real one would have (fed at
    the real start times instead, a too-fast engine model idles waiting for them and
    looks right). Prefix-group priorities as the worker computes them."""
    worker = worker or EngineWorkerConfig(engine="vllm")
    wl = run.workload
    hashes = wl.engine_hashes(profile.block_size)
    n = len(wl)
    started = np.full(n, np.nan)
    finished = np.full(n, np.nan)
    cached = np.zeros(n, dtype=np.int64)
    design = np.zeros((n, len(COEFFICIENTS)))
    offset = np.zeros(n)
    preemptions = 0
    steps = decoding = 0
    for f in feed or feeds(run):
        rows, limit, available = f.rows, f.limit, f.available
        groups = EngineOrder(block_size=worker.hash_block_size, max_age=4 * worker.window) if scheduling == "prefix-groups" else None
        tickets: dict[int, int] = {}
        rec = _Recorder(profile)
        cfg = EngineConfig(num_blocks=profile.kv_blocks, block_size=profile.block_size, max_num_seqs=profile.max_num_seqs,
                           max_batched_tokens=profile.max_batched_tokens, policy="priority" if groups else "fcfs")
        eng = Engine(cfg, rec)
        k = 0
        inflight = 0
        t = period_start = fixed = 0.0
        acc = np.zeros(len(COEFFICIENTS))
        while k < len(rows) or not eng.idle():
            if eng.idle():
                t = period_start = max(t, available[k])
                acc[:] = 0.0
                fixed = 0.0
            while k < len(rows) and available[k] <= t and inflight < limit[k]:
                i = int(rows[k])
                prio = 0
                if groups is not None:
                    prio, tickets[i] = groups.admit(wl.tokens[i])
                eng.add(Req(i, hashes[i], wl.prompt_len(i), int(wl.output_len[i]), prio, t))
                started[i] = t
                inflight += 1
                k += 1
            rec.last = None
            dur = eng.schedule()
            if rec.last is None:
                fixed += dur  # nothing runnable (all preempted): not a model step
            else:
                pf, dec, ctx = rec.last
                acc += (1.0, pf, dec, ctx)
                steps += 1
                decoding += dec
            t += dur
            for req in eng.complete(dur):
                inflight -= 1
                if groups is not None:
                    groups.done(tickets.pop(req.rid))
                finished[req.rid] = t
                cached[req.rid] = req.cached
                design[req.rid] = acc
                offset[req.rid] = period_start + fixed
        preemptions += eng.stats.preemptions
    return Replay(started, finished, cached, design, offset, preemptions, decoding / max(steps, 1))


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best unconstrained fit
    over every subset of columns whose solution is non-negative (exact for NNLS, and
    with four coefficients only 15 subsets)."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(b**2))
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            x, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(x < 0):
                continue
            err = float(np.sum((a[:, cols] @ x - b) ** 2))
            if err < best_err:
                best_err = err
                best = np.zeros(k)
                best[list(cols)] = x
    return best


def with_coefficients(profile: Profile, x) -> Profile:
    """A copy of `profile` with the step-cost coefficients `x` (and speed 1)."""
    p = Profile.from_dict(asdict(profile))
    p.speed = 1.0
    for name, v in zip(COEFFICIENTS, x):
        setattr(p, name, float(v))
    return p


def classes(run: Run, max_classes: int = 8) -> list[np.ndarray]:
    """Rows grouped by (replica, output length): what the fit compares. Output lengths
    are binned into quartiles when a run has more than `max_classes` distinct ones."""
    out = run.workload.output_len
    lens = np.unique(out)
    if len(lens) > max_classes:
        edges = np.quantile(out, [0.25, 0.5, 0.75])
        out = np.searchsorted(edges, out, side="right")
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(run.replica.tolist(), out.tolist())):
        groups.setdefault(key, []).append(i)
    return [np.asarray(v) for _, v in sorted(groups.items())]


class Objective:
    """Mean squared difference between replayed and real finish times, each class of
    rows (replica, output length) compared in time order: the k-th of its rows to
    finish in the replay against the k-th in the real run. Which row of a class finishes
    first is not something the fit can or needs to reproduce (a 0.2 % change of every
    coefficient can reorder the engine's queue and move single rows by 0.1 s), the
    completion curve of each class is."""

    def __init__(self, runs: list[Run], profile: Profile, kv_blocks: list[int], scheduling: str) -> None:
        self.runs, self.profile, self.kv, self.scheduling = runs, profile, kv_blocks, scheduling
        self.classes = [classes(r) for r in runs]
        self.feeds = [feeds(r) for r in runs]
        self.real = [[np.sort(r.finished[c]) for c in cs] for r, cs in zip(runs, self.classes)]
        self.evaluations = 0

    def replays(self, x) -> list[Replay]:
        out = []
        for run, kv, feed in zip(self.runs, self.kv, self.feeds):
            p = with_coefficients(self.profile, x)
            p.kv_blocks = kv
            out.append(replay(run, p, self.scheduling, feed=feed))
        return out

    def __call__(self, x) -> float:
        self.evaluations += 1
        res = []
        for r, cs, real in zip(self.replays(x), self.classes, self.real):
            res.extend(np.sort(r.finished[c]) - t for c, t in zip(cs, real))
        return float(np.mean(np.concatenate(res) ** 2))

    def linear_step(self, x) -> np.ndarray:
        """Least squares on the schedule the replay at `x` produced (each class's k-th
        replayed finisher against its k-th real finish): a good start, not the answer
        (the schedule moves with the coefficients)."""
        a, b = [], []
        for r, cs, real in zip(self.replays(x), self.classes, self.real):
            for c, t in zip(cs, real):
                order = c[np.argsort(r.finished[c], kind="stable")]
                a.append(r.design[order])
                b.append(t - r.offset[order])
        return nnls(np.vstack(a), np.concatenate(b))


def nelder_mead(f, x0: np.ndarray, step: np.ndarray, max_evals: int = 400, tol: float = 1e-6) -> tuple[np.ndarray, float]:
    """Minimize `f` from `x0` (Nelder and Mead's simplex: no gradients, which a replay
    does not have). Stops after `max_evals` evaluations or when the simplex's values
    agree within `tol` (relative)."""
    n = len(x0)
    pts = [np.asarray(x0, dtype=float)] + [x0 + step[i] * np.eye(n)[i] for i in range(n)]
    vals = [f(p) for p in pts]
    evals = n + 1
    while evals < max_evals:
        order = np.argsort(vals)
        pts, vals = [pts[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] <= tol * (abs(vals[0]) + 1e-12):
            break
        centroid = np.mean(pts[:-1], axis=0)
        xr = centroid + (centroid - pts[-1])
        fr = f(xr)
        evals += 1
        if fr < vals[0]:
            xe = centroid + 2 * (centroid - pts[-1])
            fe = f(xe)
            evals += 1
            pts[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            pts[-1], vals[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (pts[-1] - centroid)
            fc = f(xc)
            evals += 1
            if fc < vals[-1]:
                pts[-1], vals[-1] = xc, fc
            else:  # shrink towards the best
                pts = [pts[0]] + [pts[0] + 0.5 * (p - pts[0]) for p in pts[1:]]
                vals = [vals[0]] + [f(p) for p in pts[1:]]
                evals += n
    k = int(np.argmin(vals))
    return pts[k], vals[k]


TYPICAL = np.array([2e-3, 1e-4, 1e-4, 1e-6])
"""Magnitudes of the coefficients on a CPU replica (scales the search where a start is 0)."""


def fit_costs(runs: list[Run], profile: Profile, kv_blocks: list[int], scheduling: str = "prefix-groups",
              max_evals: int = 400) -> tuple[Profile, dict]:
    """Fit `c0`, `c_pf`, `c_dec`, `c_ctx` to the runs' per-class completion curves.

    Starts: the profile's own coefficients and two rounds of least squares on the
    replayed schedule; the best of them by the objective seeds a Nelder-Mead search over
    non-negative coefficients (|z| x scale, scale from the start)."""
    obj = Objective(runs, profile, kv_blocks, scheduling)
    prior = np.array([profile.speed * getattr(profile, c) for c in COEFFICIENTS])
    starts = [prior]
    x = prior
    for _ in range(2):
        x = obj.linear_step(x)
        starts.append(x)
    scored = sorted(((obj(s), k) for k, s in enumerate(starts)))
    start = starts[scored[0][1]]
    scale = np.maximum(start, 0.25 * TYPICAL)
    z, value = nelder_mead(lambda z: obj(np.abs(z) * scale), start / scale, np.full(len(start), 0.5), max_evals)
    x = np.abs(z) * scale
    fitted = with_coefficients(profile, x)
    detail = {
        "coefficients": dict(zip(COEFFICIENTS, (float(v) for v in x))),
        "rmse_s": round(float(np.sqrt(value)), 4),
        "start_rmse_s": round(float(np.sqrt(scored[0][0])), 4),
        "replays": obj.evaluations,
    }
    return fitted, detail
