"""`prefixflow report OUTDIR`: a finished (or running) job's story in plots, from its output.

Writes into `OUTDIR/_report/` (`pyarrow.parquet.read_table(OUTDIR)` skips names starting
with `_`):
- `throughput.png`   generated tokens per second over time, per replica;
- `hit_rate.png`     prefix-cache hit rate over time (cached / prompt tokens of the rows
                     finished in each interval), overall and per replica;
- `idle.png`         when each replica had none of the job's prompts in its engine, and
                     its idle time in total;
- `bucket_sizes.png` prompts per released bucket;
- `groups.csv`       one line per prefix group: prompts, replicas, split or not, misses;
- `index.html`       all of it on one page, with the summary and the worst groups.

Data: the output rows (`finished_at`, `started_at`, `bucket`, `replica`, token counts,
`prompt`; above `--sample-rows`, 20,000 by default, a seeded uniform sample of them, said
in the report: `prefixflow/report/rows.py`) and `_summary.json`. Prefix groups are the prompts sharing their first
128-token block (the key that shards them over bucketers), found by tokenizing `prompt`
with the job's model (`--model`; default the summary's, else PFX_MODEL, else the local
tiny model). Rows without `started_at` (written by engine-workers that do not record it)
make the idle plot an estimate (intervals in which no result finished); without `bucket`
the bucket plot shows prefix-group sizes instead. The figures say so when that happens.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.report.analysis import GroupStat, engine_block_size, group_table, prefix_groups
from prefixflow.report.rows import COLUMNS, SAMPLE_ROWS, JobRows, bucket_sizes, load  # noqa: F401 - `load` for callers
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.outputs import is_output_uri

NICE_SECONDS = (0.25, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)
MAX_LINES = 10
STYLES = ("-", "--", "-.", ":")
"""Line styles by replica (with the colours): equal series stay visible."""
"""Replicas drawn as lines; more are drawn as a heat map."""


# --- time series ------------------------------------------------------------------------


def bin_width(wall: float, target: int = 80) -> float:
    """A round interval giving about `target` bins over `wall` seconds."""
    raw = wall / target
    return next((s for s in NICE_SECONDS if s >= raw), NICE_SECONDS[-1])


def time_unit(wall: float) -> tuple[float, str]:
    """(seconds per unit, unit name) for a time axis over `wall` seconds."""
    if wall <= 900:
        return 1.0, "s"
    if wall <= 36_000:
        return 60.0, "min"
    return 3600.0, "h"


def binned(times: np.ndarray, values: np.ndarray, t0: float, width: float, n: int) -> np.ndarray:
    """Sum of `values` per bin of `width` seconds from `t0` (n bins)."""
    idx = np.clip(((times - t0) / width).astype(np.int64), 0, n - 1)
    return np.bincount(idx, weights=values, minlength=n)[:n]


def _np(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy(zero_copy_only=False).astype(float) if table.num_rows else np.zeros(0)


def busy_intervals(starts: np.ndarray, ends: np.ndarray) -> list[tuple[float, float]]:
    """The union of [start, end] intervals, sorted and merged."""
    out: list[list[float]] = []
    for s, e in sorted(zip(starts.tolist(), ends.tolist())):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


@dataclass
class Idle:
    replica: str
    busy: list[tuple[float, float]]
    """Busy spans (Unix times) within the job."""
    idle_seconds: float
    estimated: bool
    """No start times: `busy` is the span from the replica's first result to its last,
    `unknown` what came before (no work yet, or the first results being computed), and
    `idle_seconds` only the time after its last result (a lower bound)."""
    unknown: list[tuple[float, float]] = field(default_factory=list)


def idle_times(job: JobRows) -> list[Idle]:
    """Per replica: when it had the job's prompts in its engine (the union of its rows'
    [started_at, finished_at]), and how long it had none between the job's start and
    end. Rows without started_at say only when results finished, and an engine finishes
    prompts in waves (nothing finishes while a wave computes), so gaps between results
    are not idle time: then the replica counts as busy from its first result to its last
    and idle after its last (a lower bound; see `Idle.estimated`)."""
    out = []
    t0, t1 = job.t0, job.t1
    ok = job.table.filter(pc.is_valid(job.table.column("finished_at")))
    for name in job.replicas():
        rows = ok.filter(pc.equal(ok.column("replica"), name))
        fin = _np(rows, "finished_at")
        start = _np(rows, "started_at")
        have_start = ~np.isnan(start)
        if have_start.all() and len(fin):
            busy = busy_intervals(np.maximum(start, t0), np.minimum(fin, t1))
            out.append(Idle(name, busy, max(job.wall - sum(e - s for s, e in busy), 0.0), False))
        else:
            first, last = max(float(fin.min()), t0), min(float(fin.max()), t1)
            out.append(Idle(name, [(first, last)], max(t1 - last, 0.0), True, [(t0, first)]))
    return out


# --- plots ---------------------------------------------------------------------------


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"font.size": 10, "axes.titlesize": 12, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def _colors(names: list[str]) -> dict[str, Any]:
    plt = _plt()
    cmap = plt.get_cmap("tab10")
    return {n: cmap(i % 10) for i, n in enumerate(names)}


def _subtitle(job: JobRows) -> str:
    s = job.summary or {}
    rows = s.get("rows", job.table.num_rows)
    return f"job {job.job}: {rows} rows in {job.wall:.1f} s" + (f", hit rate {s['prefix_cache_hit_rate']:.1%}" if s else "")


def plot_throughput(job: JobRows, path: Path) -> None:
    """Top: generated tokens so far per replica (the slope is the throughput; engines
    finish prompts in waves, so this reads better than any rate). Bottom: the rate in
    intervals of about 1/30 of the job."""
    plt = _plt()
    ok = job.ok().filter(pc.is_valid(job.ok().column("finished_at")))
    width = bin_width(job.wall, 30)
    n = max(int(math.ceil(job.wall / width)), 1)
    unit, uname = time_unit(job.wall)
    x = (np.arange(n) + 0.5) * width / unit
    use_tokens = bool(pc.sum(ok.column("output_tokens")).as_py() or 0)
    what = "generated tokens" if use_tokens else "rows"
    names = job.replicas()
    series, done = {}, {}
    for name in names:
        rows = ok.filter(pc.equal(ok.column("replica"), name))
        fin = _np(rows, "finished_at")
        weights = (_np(rows, "output_tokens") if use_tokens else np.ones(rows.num_rows)) * job.scale
        series[name] = binned(fin, weights, job.t0, width, n) / width
        order = np.argsort(fin)
        done[name] = ((fin[order] - job.t0) / unit, np.cumsum(weights[order]))
    lines = len(names) <= MAX_LINES
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, gridspec_kw={"height_ratios": [1, 1]})
    colors = _colors(names)
    for i, name in enumerate(names if lines else []):
        t, c = done[name]
        ax1.step(np.r_[0, t], np.r_[0, c], where="post", label=name, color=colors[name], linewidth=1.8,
                 linestyle=STYLES[i % len(STYLES)])
    if lines:
        ax1.set_ylabel(f"{what} so far")
        ax1.set_ylim(bottom=0)
        ax1.legend(loc="upper left", fontsize=9)
        for i, name in enumerate(names):
            ax2.plot(x, series[name], label=name, color=colors[name], linewidth=1.8, linestyle=STYLES[i % len(STYLES)],
                     marker="o", markersize=3)
        if len(names) > 1:
            ax2.plot(x, sum(series.values()), label="all", color="black", linewidth=1.0, linestyle="--", alpha=0.7)
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper right", fontsize=9, ncols=min(len(names) + 1, 6))
    else:  # a large fleet: one row per replica, colour = rate
        total_done = np.cumsum(sum(series.values())) * width
        ax1.plot(x, total_done, color="black", label="all replicas")
        ax1.set_ylabel(f"{what} so far")
        ax1.legend(loc="upper left", fontsize=9)
        grid = np.vstack([series[n_] for n_ in names])
        im = ax2.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                        extent=(0, n * width / unit, len(names) - 0.5, -0.5))
        ax2.set_yticks(range(len(names)), names, fontsize=7)
        ax2.grid(False)
        fig.colorbar(im, ax=ax2, label=f"{what} / s", location="bottom", shrink=0.5)
    ax2.set_ylabel(f"{what} / s (per {width:g} s)")
    ax2.set_xlabel(f"time since the job started ({uname})")
    ax2.set_xlim(0, job.wall / unit)
    ax1.set_title(f"Throughput by replica\n{_subtitle(job)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_hit_rate(job: JobRows, path: Path) -> None:
    plt = _plt()
    ok = job.ok().filter(pc.is_valid(job.ok().column("finished_at")))
    width = bin_width(job.wall, 30)
    n = max(int(math.ceil(job.wall / width)), 1)
    unit, uname = time_unit(job.wall)
    x = (np.arange(n) + 0.5) * width / unit
    fig, ax = plt.subplots(figsize=(10, 4.5))

    def draw(values: np.ndarray, **kw) -> None:
        have = ~np.isnan(values)  # intervals in which nothing finished are skipped, not zero
        ax.plot(x[have], values[have], **kw)

    def rate(rows: pa.Table) -> np.ndarray:
        fin = _np(rows, "finished_at")
        prompt = binned(fin, _np(rows, "prompt_tokens"), job.t0, width, n)
        cached = binned(fin, _np(rows, "cached_tokens"), job.t0, width, n)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(prompt > 0, 100 * cached / prompt, np.nan)

    names = job.replicas()
    if len(names) <= MAX_LINES and len(names) > 1:
        colors = _colors(names)
        for i, name in enumerate(names):
            draw(rate(ok.filter(pc.equal(ok.column("replica"), name))), label=name, color=colors[name],
                 linewidth=1.0, alpha=0.7, marker=".", markersize=4, linestyle=STYLES[i % len(STYLES)])
    draw(rate(ok), label="all replicas", color="black", linewidth=2.0, marker="o", markersize=3)
    prompt = pc.sum(ok.column("prompt_tokens")).as_py() or 0
    total = 100 * (pc.sum(ok.column("cached_tokens")).as_py() or 0) / prompt if prompt else 0.0
    ax.axhline(total, color="#cc3311", linestyle="--", linewidth=1.2, label=f"whole job: {total:.1f} %")
    ax.set_ylim(0, 100)
    ax.set_ylabel("prefix-cache hit rate, % of prompt tokens")
    ax.set_xlabel(f"time since the job started ({uname})")
    ax.set_xlim(0, n * width / unit)
    ax.legend(loc="upper right", fontsize=9, ncols=min(len(names) + 2, 5))
    ax.set_title(f"Prefix-cache hit rate of the rows finished in each {width:g} s\n{_subtitle(job)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_idle(job: JobRows, idle: list[Idle], path: Path) -> None:
    plt = _plt()
    unit, uname = time_unit(job.wall)
    names = [i.replica for i in idle]
    colors = _colors(names)
    height = max(3.5, min(0.45 * len(names) + 2.2, 14))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, height), gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    for y, i in enumerate(idle):
        spans = [((s - job.t0) / unit, (e - s) / unit) for s, e in i.busy]
        ax1.broken_barh(spans, (y - 0.35, 0.7), color=colors[i.replica], alpha=0.85)
        unknown = [((s - job.t0) / unit, (e - s) / unit) for s, e in i.unknown]
        ax1.broken_barh(unknown, (y - 0.35, 0.7), facecolor="none", edgecolor="grey", hatch="//", linewidth=0.5)
    ax1.set_yticks(range(len(names)), names)
    ax1.set_ylim(len(names) - 0.5, -0.5)
    ax1.set_xlim(0, job.wall / unit)
    ax1.set_xlabel(f"time since the job started ({uname})")
    estimated = any(i.estimated for i in idle)
    if estimated:
        ax1.set_title("Busy from first to last result (rows have no start times);\nhatched: no work yet or first results computing", fontsize=10)
    else:
        ax1.set_title("Busy (a prompt of the job in the engine); gaps are idle")
    idle_s = [i.idle_seconds / unit for i in idle]
    bars = ax2.barh(range(len(names)), idle_s, color=[colors[n] for n in names], alpha=0.85)
    for bar, i in zip(bars, idle):
        ax2.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {i.idle_seconds / job.wall:.0%}",
                 va="center", fontsize=9)
    ax2.set_xlabel(f"idle ({uname}; % of the job)")
    ax2.set_xlim(0, max(max(idle_s, default=0) * 1.3, 1e-3))
    ax2.set_title("Idle after its last result (at least)" if estimated else "Idle time", fontsize=10)
    fig.suptitle(f"Replica idle time - {_subtitle(job)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_bucket_sizes(sizes: list[int], path: Path, *, title: str, job: JobRows, noun: str = "buckets",
                      weights: list[float] | None = None) -> None:
    """Bars: how many `noun` had 1, 2-3, 4-7, ... prompts; above each, the share of all
    prompts they held (a few large buckets can hold most prompts). `weights`: how many
    `noun` each size stands for (a sample's estimate; default one each)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(10, 4.5))
    w = np.ones(len(sizes)) if weights is None else np.asarray(weights, dtype=float)
    if sizes:
        top = max(sizes)
        edges = [2 ** int(math.log2(min(sizes)))]
        while edges[-1] <= top:
            edges.append(edges[-1] * 2)
        while len(edges) < 6:  # a few empty neighbours: one bar alone reads as a block
            if edges[0] > 1 and len(edges) % 2:
                edges.insert(0, edges[0] // 2)
            else:
                edges.append(edges[-1] * 2)
        counts, _ = np.histogram(sizes, bins=edges, weights=w)
        prompts, _ = np.histogram(sizes, bins=edges, weights=w * np.asarray(sizes, dtype=float))
        counts = np.rint(counts).astype(int)
        labels = [f"{lo}" if hi - lo == 1 else f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
        bars = ax.bar(range(len(counts)), counts, color="#4477aa", width=0.7)
        for bar, k in zip(bars, prompts):
            if k:
                ax.annotate(f"{100 * k / prompts.sum():.0f}% of prompts", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            xytext=(0, 3), textcoords="offset points", ha="center", fontsize=9)
        ax.set_xticks(range(len(counts)), labels)
        ax.set_ylabel(noun)
        ax.set_ylim(0, max(counts) * 1.15)
        ax.set_xlabel(f"prompts per {noun[:-1]}")
        order = np.argsort(sizes)
        median = np.asarray(sizes)[order][np.searchsorted(np.cumsum(w[order]), w.sum() / 2)]
        about = "about " if weights is not None else ""
        ax.set_title(f"{title}: {about}{round(w.sum())} {noun}, median {median:g} prompts, largest {top}\n{_subtitle(job)}")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title}\n{_subtitle(job)}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- prefix groups ------------------------------------------------------------------


@dataclass
class Groups:
    stats: dict[Any, GroupStat]
    first_id: dict[Any, Any]
    """Group -> the id of its first row (to find its prompts)."""
    block: int
    """Engine KV block size the misses are counted in."""


def find_groups(job: JobRows, model: str | None) -> Groups | None:
    """Per prefix group statistics; None (with a note) when the prompts cannot be
    tokenized."""
    t = job.table
    if "prompt" not in t.column_names:
        job.notes.append("no 'prompt' column (the input had token ids): no prefix groups")
        return None
    from prefixflow.shared.prefix import tokens as tk
    from prefixflow.shared.prefix.tokenize import load_tokenizer

    model = model or (job.summary or {}).get("model") or os.environ.get("PFX_MODEL") or _default_model()
    try:
        tokenizer = load_tokenizer(model)
    except Exception as exc:  # noqa: BLE001 - no tokenizer: the rest of the report stands
        job.notes.append(f"no prefix groups: cannot load the tokenizer of {model!r} ({exc}); pass --model")
        return None
    t = t.filter(pc.is_valid(t.column("prompt")))  # a sampled report reads some rows' prompts only
    texts = t.column("prompt").to_pylist()
    packed = [tk.pack(e.ids) for e in tokenizer.encode_batch_fast(texts)]
    groups, shared = prefix_groups(packed)
    ids = t.column("id").to_pylist()
    group_of = {i: g for i, g in zip(ids, groups) if g is not None}
    first_id: dict[Any, Any] = {}
    for i, g in zip(ids, groups):
        if g is not None:
            first_id.setdefault(g, i)
    block, inferred = engine_block_size(t.column("cached_tokens").to_pylist())
    prefix = {g: n // block * block for g, n in shared.items()}
    rows = zip(ids, t.column("replica").to_pylist(), t.column("cached_tokens").to_pylist(),
               t.column("prompt_tokens").to_pylist(), pc.is_null(t.column("error")).to_pylist())
    table = group_table(((i, r, c or 0, p or 0, ok) for i, r, c, p, ok in rows), group_of, prefix)
    if not inferred:
        job.notes.append(f"no prefix-cache hits: engine block size taken as {block} tokens for the misses")
    return Groups(table, first_id, block)


def _default_model() -> str:
    from prefixflow.shared.process.config import DEFAULT_MODEL

    return DEFAULT_MODEL


def write_groups_csv(groups: dict[Any, GroupStat], first_id: dict[Any, Any], path: Path) -> None:
    rows = [
        {
            "group": g.group,
            "first_id": str(first_id.get(g.group, "")),
            "prompts": g.prompts,
            "prefix_tokens": g.prefix_tokens,
            "replicas": len(g.replicas),
            "rows_per_replica": " ".join(f"{r}:{n}" for r, n in sorted(g.replicas.items())),
            "split": g.split,
            "misses": g.misses,
            "hit_rate": round(g.hit_rate, 4),
        }
        for g in sorted(groups.values(), key=lambda g: (-g.misses, -g.prompts))
    ]
    import csv

    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["group"])
        w.writeheader()
        w.writerows(rows)


# --- the report -----------------------------------------------------------------------


def write_report(out_dir: str | Path, dest: str | Path | None = None, *, model: str | None = None, groups: bool = True,
                 sample: int = SAMPLE_ROWS) -> Path:
    """Write the report of the job in `out_dir` into `dest` (default `out_dir/_report`);
    returns the path of its index.html. Above `sample` rows it reads a sample (`load`)."""
    if dest is None and is_output_uri(str(out_dir)):
        raise usage_error(f"{out_dir}: an object store output: give --dest, a local directory for the report")
    job = load(out_dir, with_prompts=groups, sample=sample)
    dest = Path(dest) if dest else Path(out_dir) / "_report"
    dest.mkdir(parents=True, exist_ok=True)
    images: list[tuple[str, str]] = []
    timed = job.table.column("finished_at").null_count < job.table.num_rows
    idle: list[Idle] = []
    if timed:
        plot_throughput(job, dest / "throughput.png")
        plot_hit_rate(job, dest / "hit_rate.png")
        idle = idle_times(job)
        plot_idle(job, idle, dest / "idle.png")
        images += [("Throughput", "throughput.png"), ("Hit rate", "hit_rate.png"), ("Idle time", "idle.png")]
        if any(i.estimated for i in idle):
            job.notes.append("rows have no started_at (the engine-workers do not record it): idle time is estimated "
                             "(only the time after each replica's last result counts)")
    found = find_groups(job, model) if groups else None
    group_stats: dict[Any, GroupStat] = found.stats if found else {}
    buckets = job.table.filter(pc.is_valid(job.table.column("bucket")))
    if buckets.num_rows:
        sizes, weights = bucket_sizes(job)
        plot_bucket_sizes(sizes, dest / "bucket_sizes.png", title="Released buckets", job=job,
                          weights=weights if job.sampled else None)
    else:
        job.notes.append("rows have no bucket ids (the engine-workers do not record them): "
                         "bucket_sizes.png shows prefix-group sizes instead")
        sizes = [g.prompts for g in group_stats.values()]
        plot_bucket_sizes(sizes, dest / "bucket_sizes.png", title="Prefix-group sizes (no bucket ids in this output)", job=job, noun="groups")
    images.append(("Bucket sizes", "bucket_sizes.png"))
    if found:
        write_groups_csv(group_stats, found.first_id, dest / "groups.csv")
    index = dest / "index.html"
    index.write_text(_html(job, images, group_stats, idle, found.block if found else None))
    return index


def _html(job: JobRows, images: list[tuple[str, str]], groups: dict[Any, GroupStat], idle: list[Idle], block: int | None) -> str:
    s = job.summary or {}
    e = html.escape
    lines = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>prefixflow report: {e(job.job)}</title>",
        "<style>body{font-family:sans-serif;max-width:1250px;margin:2em auto}"
        "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
        "img{max-width:100%;border:1px solid #eee;margin:0.5em 0}</style>",
        f"<h1>Job {e(job.job)}</h1>",
        "<table>",
    ]
    facts = [
        ("rows", s.get("rows", job.table.num_rows)),
        ("errors", s.get("errors", job.table.num_rows - job.ok().num_rows)),
        ("wall seconds", f"{job.wall:.1f}"),
        ("prefix-cache hit rate", f"{s['prefix_cache_hit_rate']:.1%}" if "prefix_cache_hit_rate" in s else "-"),
        ("output tokens / s", s.get("output_tokens_per_second", "-")),
        ("deduplicated rows (a copy of an identical row's output)", s.get("deduplicated_rows", "-")),
        ("merged rows (one completion of a shared n request)", s.get("merged_rows", "-")),
    ]
    if groups:
        facts += [("prefix groups", len(groups)), ("groups split over replicas", sum(g.split for g in groups.values())),
                  ("prompts that missed their prefix", sum(g.misses for g in groups.values())),
                  ("(ideal misses: one per group)", len(groups))]
    for i in idle:
        facts.append((f"idle {i.replica}", f"{i.idle_seconds:.1f} s ({i.idle_seconds / job.wall:.0%})" + (" est." if i.estimated else "")))
    lines += [f"<tr><th style='text-align:left'>{e(str(k))}</th><td>{e(str(v))}</td></tr>" for k, v in facts]
    lines.append("</table>")
    if job.notes:
        lines.append("<ul>" + "".join(f"<li>{e(n)}</li>" for n in job.notes) + "</ul>")
    for title, name in images:
        lines.append(f"<h2>{e(title)}</h2><img src='{e(name)}' alt='{e(title)}'>")
    if groups:
        worst = sorted(groups.values(), key=lambda g: (-g.misses, -len(g.replicas), -g.prompts))[:40]
        lines.append(f"<h2>Prefix groups (the {len(worst)} with the most misses; all in groups.csv)</h2>")
        lines.append(f"<p>A miss: a prompt that found less than its group's shared prefix (in {block}-token blocks) cached.</p>")
        lines.append("<table><tr><th>group</th><th>prompts</th><th>prefix tokens</th><th>replicas</th><th>misses</th><th>hit rate</th></tr>")
        for g in worst:
            reps = " ".join(f"{r}:{n}" for r, n in sorted(g.replicas.items()))
            lines.append(f"<tr><td>{g.group}</td><td>{g.prompts}</td><td>{g.prefix_tokens}</td><td>{e(reps)}</td>"
                         f"<td>{g.misses}</td><td>{g.hit_rate:.1%}</td></tr>")
        lines.append("</table>")
    return "\n".join(lines) + "\n"


def cmd_report(args) -> None:
    index = write_report(args.out_dir, args.dest, model=args.model, groups=not args.no_groups, sample=args.sample_rows)
    print(f"report: {index}")
    for p in sorted(index.parent.iterdir()):
        if p.name != index.name:
            print(f"  {p}")


def add_parser(sub) -> None:
    p = sub.add_parser("report", help="plots of a job from its output directory (throughput, hit rate, idle time, buckets, prefix groups)")
    p.add_argument("out_dir", help="the job's output directory (part-*.parquet, _summary.json), or its s3:// or gs:// "
                   "prefix (the files its _manifest.json names, read with this machine's credentials)")
    p.add_argument("--dest", default=None, help="where to write the report (default OUT_DIR/_report; required for an "
                   "s3:// or gs:// OUT_DIR)")
    p.add_argument("--model", default=None, help="tokenizer for the prefix groups (default: the job's model, else PFX_MODEL, else the local tiny model)")
    p.add_argument("--no-groups", action="store_true", help="skip the prefix-group analysis (it tokenizes the prompts it reads)")
    p.add_argument("--sample-rows", type=int, default=SAMPLE_ROWS,
                   help=f"read at most this many rows, a seeded uniform sample, for the plots (the prefix groups: "
                        f"those of them in random row groups holding about 64 MiB of prompts) (0: every row) "
                        f"(default {SAMPLE_ROWS:,})")
    p.set_defaults(fn=cmd_report)
