"""Running many simulations: in parallel processes (fork: the workload is shared, not
copied), printing tables, writing JSON and plots."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

from prefixflow.sim.cluster import Options, simulate
from prefixflow.sim.cost import Profile
from prefixflow.sim.workload import Workload

_SHARED: dict = {}


def _run_one(args: tuple) -> dict:
    name, method, replicas, profile_dict, opts = args
    wl: Workload = _SHARED[name]
    r = simulate(wl, Profile.from_dict(profile_dict), replicas, method, opts)
    return r.row()


def run_many(jobs: list[tuple[Workload, str, int, Profile, Options]], processes: int = 0) -> list[dict]:
    """Run (workload, method, replicas, profile, options) jobs; rows in job order."""
    processes = processes or min(len(jobs), os.cpu_count() or 1)
    for wl, *_ in jobs:
        _SHARED[wl.name] = wl
        for _, _, _, p, _ in jobs:
            wl.engine_hashes(p.block_size)  # before forking: computed once
    args = [(wl.name, m, n, asdict(p), o) for wl, m, n, p, o in jobs]
    if processes <= 1 or len(jobs) == 1:
        return [_run_one(a) for a in args]
    ctx = mp.get_context("fork")
    # Longest first (pipeline methods, fewest replicas) keeps both cores busy to the end.
    order = sorted(range(len(args)), key=lambda i: (args[i][1] in ("naive", "continuous", "sorted"), args[i][2]))
    with ProcessPoolExecutor(processes, mp_context=ctx) as pool:
        done = dict(zip(order, pool.map(_run_one, [args[i] for i in order])))
    return [done[i] for i in range(len(args))]


def write_json(path: str | Path, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def plot(report: dict, path: str | Path) -> None:
    """Wall time and hit rate per method; scaling curves if the report has them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scaling = report.get("scaling") or {}
    panels = 2 + (1 if scaling else 0)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    rows = report.get("methods", [])
    if rows:
        names = [r["method"] for r in rows]
        ax = axes[0]
        ax.bar(names, [r["wall_seconds"] for r in rows], color="#4477aa", label="simulated")
        pub = report.get("published") or {}
        xs = [i for i, n in enumerate(names) if n in pub]
        if xs:
            ax.scatter(xs, [pub[names[i]][0] for i in xs], color="black", marker="_", s=600, linewidths=3, label="published", zorder=3)
            ax.legend()
        ax.set_ylabel("wall seconds")
        ax.set_title("Wall time")
        ax = axes[1]
        ax.bar(names, [100 * r["hit_rate"] for r in rows], color="#228833", label="cached / prompt tokens")
        ax.scatter(range(len(names)), [100 * r["logged_hit_rate"] for r in rows], color="#ee6677", marker="o", label="vLLM counters (reference's)", zorder=3)
        if xs:
            ax.scatter(xs, [100 * pub[names[i]][1] for i in xs], color="black", marker="_", s=600, linewidths=3, label="published", zorder=3)
        ax.set_ylabel("prefix-cache hit rate, %")
        ax.set_title("Hit rate")
        ax.legend(fontsize=8)
        for a in axes[:2]:
            a.tick_params(axis="x", rotation=30)
    if scaling:
        ax = axes[-1]
        for label, curve in scaling.items():
            ns = sorted(int(n) for n in curve)
            ax.plot(ns, [curve[str(n)]["wall_seconds"] if str(n) in curve else curve[n]["wall_seconds"] for n in ns], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas (GPUs)")
        ax.set_ylabel("wall seconds")
        ax.set_title("Scaling")
        ax.legend(fontsize=7)
    fig.suptitle(report.get("title", ""))
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_rows(rows: list[dict], published: dict | None = None, limit: float | None = None) -> None:
    """The methods' table: beside each wall time its ratio to the workload's `limit` (the
    best any schedule could do: `prefixflow.sim.limit`), and `balanced s`: the wall the
    run's own engine work would take perfectly balanced (`cluster.work_bound`; wall
    minus it is the method's placement loss)."""
    published = published or {}
    if limit:
        print(f"the workload's limit on this fleet: {limit:.1f} s (ideal hit rate, perfect balance, each GPU busy "
              "from when it is up: no schedule does better)")
    head = f"{'method':>14} {'wall s':>9} {'x limit':>8} {'published':>10} {'hit (cached/prompt)':>20} {'hit (vLLM counters)':>20} {'published':>10} {'preempt':>8} {'busy':>6} {'split':>6} {'balanced s':>10}"
    print(head)
    for r in rows:
        pub = published.get(r["method"])
        pt = f"{pub[0]:.0f}" if pub else ""
        ph = f"{pub[1]:.1%}" if pub else ""
        ratio = f"{r['wall_seconds'] / limit:.3f}" if limit else ""
        print(f"{r['method']:>14} {r['wall_seconds']:9.1f} {ratio:>8} {pt:>10} {r['hit_rate']:20.1%} {r['logged_hit_rate']:20.1%} {ph:>10}"
              f" {r['preemptions']:8d} {r['busy_fraction']:6.1%} {r['groups_split']:6d} {r.get('bound_seconds', math.nan):10.1f}")
