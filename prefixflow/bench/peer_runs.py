"""`prefixflow bench peers`: one dataset through prefixflow and through the tools users would
otherwise pick, on the same machine, model, sampling and KV-cache size per engine.

Methods (`--methods`, all by default):

    prefixflow              `prefixflow run` with its defaults (prefix-aware routing), R replicas
    prefixflow-round-robin  the same with `--policy round-robin`: what routing alone is worth
    prefixflow-no-admission the same without admission by KV memory (`PFX_KV_ADMISSION=false`):
                            vLLM admits greedily and preempts (the `preempted` column)
    daft-native             Daft's `vllm-prefix-caching` provider on Daft's native runner (one engine, all cores)
    daft-ray                the same provider on Ray, R engine actors pinned one per core set
    vllm-dataset            vLLM offline `LLM.generate`, one engine on all cores, prompts in dataset order
    vllm-sorted             the same, prompts sorted by text first (sort timed)

The peers run in their own virtualenv (`make bench-peers`: `.venv-peers`), each as a script of
prefixflow/bench/peers/ that prints one `PEER_RESULT {json}` line; prefixflow runs as `prefixflow run` in a
subprocess too, so every method pays its own process start, imports and engine start-up.

Every method gets the same per-row lengths (resolved here once: `row_lengths`; with
`--mean-lengths`, every row the rounded means, the one setting Daft's provider can run), the same sampling
flags, prefix caching on, enforce_eager, and `--kv-cache-blocks` KV blocks per engine. Each method
reports two times:

- `run_seconds`, without engine start-up: prefixflow's `_summary.json` `wall_seconds` (job created,
  after every replica was ready, to the last row written); a peer's own measure from its last
  engine ready to its last output (prefixflow/bench/peers/*.py say how);
- `wall_seconds`, with start-up: the subprocess's whole life, as a user waits for it (this
  includes each tool's shutdown).

Hit rate: cached / prompt tokens as vLLM reports them (`num_cached_tokens`; the Daft runners read
the same count from vLLM's counters). Rounds are interleaved (every method once per round), each
metric is the median over rounds, and the ratio columns divide by the best peer's median.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.process import config as cfgmod

REPO = Path(__file__).resolve().parents[2]
"""The checkout (the peers' virtualenv, .venv-peers, is made there by `make bench-peers`)."""
PEERS_DIR = Path(__file__).resolve().parent / "peers"
"""The peers' scripts (shipped with the package: found here from a checkout or an install)."""
RESULT_MARKER = "PEER_RESULT "
"""The peers' result line prefix (prefixflow/bench/peers/common.py RESULT_MARKER; a unit test keeps the two equal)."""

PREFIXFLOW_METHODS = {"prefixflow": [], "prefixflow-round-robin": ["--policy", "round-robin"], "prefixflow-no-admission": []}
PREFIXFLOW_ENV = {"prefixflow-no-admission": {"PFX_KV_ADMISSION": "false"}}
"""Environment of a prefixflow method's `run` (the services read their settings from it)."""
PEER_METHODS = {
    "daft-native": ("daft_provider.py", ["--runner", "native"]),
    "daft-ray": ("daft_provider.py", ["--runner", "ray"]),
    "vllm-dataset": ("vllm_offline.py", ["--order", "dataset"]),
    "vllm-sorted": ("vllm_offline.py", ["--order", "sorted"]),
}
METHODS = (*PREFIXFLOW_METHODS, *PEER_METHODS)
METRICS = ("run_seconds", "wall_seconds", "startup_seconds", "hit_rate", "rows", "errors", "prompt_tokens",
           "cached_tokens", "output_tokens", "preemptions")


@dataclass
class Run:
    """One method's run in one round."""

    method: str
    round: int
    rows: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    hit_rate: float
    run_seconds: float
    """Without engine start-up (see the module docstring)."""
    wall_seconds: float
    """The whole subprocess, start-up and shutdown included."""
    startup_seconds: float | None = None
    preemptions: int | None = None
    """Requests vLLM preempted, from its own counters (prefixflow: the engines' line; None: not reported)."""
    extra: dict[str, Any] = field(default_factory=dict)


# --- pure parts ------------------------------------------------------------------------


def row_lengths(columns: dict[str, list[Any]], default_max: int, default_min: int) -> tuple[list[int], list[int]]:
    """Per row (max_tokens, min_tokens), from the first source that gives them:

    1. the `sampling` struct column (what `prefixflow dataset`'s shapes write and
       `prefixflow run` honours per row);
    2. `max_tokens` / `min_tokens` columns;
    3. `output_len` (prefix-repetition): an output length, so min = max;
    4. the flags' defaults.
    """
    n = len(next(iter(columns.values()))) if columns else 0
    sampling = columns.get("sampling") or [None] * n
    out_max: list[int] = []
    out_min: list[int] = []
    for i in range(n):
        own = sampling[i] or {}
        hi = own.get("max_tokens")
        lo = own.get("min_tokens")
        if hi is None and "max_tokens" in columns:
            hi = columns["max_tokens"][i]
        if lo is None and "min_tokens" in columns:
            lo = columns["min_tokens"][i]
        if hi is None and "output_len" in columns and columns["output_len"][i] is not None:
            hi = columns["output_len"][i]
            lo = hi if lo is None else lo
        hi = default_max if hi is None else int(hi)
        lo = min(hi, default_min if lo is None else int(lo))
        out_max.append(hi)
        out_min.append(lo)
    return out_max, out_min


def parse_peer_output(stdout: str) -> dict[str, Any]:
    """The last `PEER_RESULT {json}` line of a peer runner's stdout."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    raise ValueError("no PEER_RESULT line in the runner's output")


STARTUP_LINE = re.compile(r"(\d+) replicas ready in ([0-9.]+) s(?: \(the job was submitted at ([0-9.]+) s\))?")
REPLICA_READY_LINE = re.compile(r"^\S+ ready in ([0-9.]+) s: it takes work now$", re.MULTILINE)
ENGINE_PART = re.compile(r"(\S+) (\d+) preempted(?:, an output token costs ([0-9.]+) prompt tokens)?")


def parse_engines(stdout: str) -> tuple[int | None, dict[str, float]]:
    """The `engines:` line `prefixflow run` prints at the end of a job (prefixflow/client/progress.py
    `engines_note`): the requests vLLM preempted over all replicas, and what an output
    token cost each engine in prompt tokens. (None, {}) without that line."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith("engines: ")), None)
    if line is None:
        return None, {}
    parts = ENGINE_PART.findall(line[len("engines: "):])
    return sum(int(n) for _, n, _ in parts), {name: float(c) for name, _, c in parts if c}


def parse_prefixflow(summary: dict[str, Any], stdout: str) -> dict[str, Any]:
    """A `prefixflow run`'s result fields from its `_summary.json` and its stdout (start-up
    line). The job is submitted while the engines start: its time without start-up counts
    from the last replica ready (as Daft's, from its last engine ready), and
    `run_seconds_from_first_engine` from the first."""
    startup = STARTUP_LINE.search(stdout)
    overlap = 0.0
    extra: dict[str, Any] = {"replicas": {name: r.get("prefix_cache_hit_rate") for name, r in summary.get("replicas", {}).items()}}
    if startup and startup.group(3):
        submitted = float(startup.group(3))
        overlap = max(0.0, float(startup.group(2)) - submitted)
        first = min((float(t) for t in REPLICA_READY_LINE.findall(stdout)), default=None)
        if overlap and first is not None:
            extra["run_seconds_from_first_engine"] = round(summary["wall_seconds"] - max(0.0, first - submitted), 3)
    preemptions, decode_costs = parse_engines(stdout)
    if decode_costs:
        extra["decode_cost"] = decode_costs
    return dict(
        preemptions=preemptions,
        rows=summary["rows"],
        errors=summary["errors"],
        prompt_tokens=summary["prompt_tokens"],
        cached_tokens=summary["cached_tokens"],
        output_tokens=summary["output_tokens"],
        hit_rate=summary["prefix_cache_hit_rate"],
        run_seconds=round(max(0.0, summary["wall_seconds"] - overlap), 3),
        startup_seconds=float(startup.group(2)) if startup else None,
        extra=extra,
    )


def medians(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per method (in first-run order), the median of each metric over its rounds."""
    by_method: dict[str, list[Run]] = {}
    for r in runs:
        by_method.setdefault(r.method, []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for method, group in by_method.items():
        row: dict[str, Any] = {"rounds": len(group)}
        for metric in METRICS:
            values = [getattr(r, metric) for r in group if getattr(r, metric) is not None]
            row[metric] = statistics.median(values) if values else None
        out[method] = row
    return out


def ratio_table(med: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of the ratio table: each method's medians, plus its times divided by the best
    peer's (lower is better; `None` where no peer ran). The best peer is chosen per column:
    the fastest without start-up may not be the fastest with it."""
    peers = [m for m in med if m not in PREFIXFLOW_METHODS]
    best = {
        metric: min((med[p][metric] for p in peers if med[p][metric]), default=None)
        for metric in ("run_seconds", "wall_seconds")
    }
    best_peer = {
        metric: next((p for p in peers if med[p][metric] == best[metric]), None) if best[metric] else None
        for metric in best
    }
    rows = []
    for method, m in med.items():
        row = {"method": method, **m}
        for metric in ("run_seconds", "wall_seconds"):
            row[f"{metric}_vs_best_peer"] = round(m[metric] / best[metric], 3) if best[metric] and m[metric] else None
            row[f"best_peer_{metric}"] = best_peer[metric]
        rows.append(row)
    return rows


def ideal_hit_rate(metadata: dict[str, Any], block_size: int | None) -> float | None:
    """The dataset's analytic ideal at the engines' block size, when its metadata has one
    (`prefixflow dataset`'s shapes store {"<block size>": {"formula": .., "exact": ..}};
    prefix-repetition files are handled by `dataset_ideal`)."""
    ideal = metadata.get("ideal_hit_rate")
    if not isinstance(ideal, dict) or block_size is None:
        return ideal if isinstance(ideal, (int, float)) else None
    entry = ideal.get(str(block_size))
    if isinstance(entry, dict):
        return entry.get("exact", entry.get("formula"))
    return entry


def dataset_ideal(path: str | Path, metadata: dict[str, Any], block_size: int | None) -> float | None:
    """`ideal_hit_rate`, or for a prefix-repetition file (whose metadata has no table of
    ideals) prefixflow.datagen.dataset's formula over the file."""
    ideal = ideal_hit_rate(metadata, block_size)
    if ideal is None and block_size and metadata.get("generator") == "prefix_repetition":
        from prefixflow.datagen.dataset import ideal_hit_rate as repetition_ideal

        ideal = round(repetition_ideal(pq.read_table(path), block_size=block_size), 4)
    return ideal


# --- inputs ------------------------------------------------------------------------------


def mean_lengths(hi: list[int], lo: list[int]) -> tuple[list[int], list[int]]:
    """Every row at the rounded mean (max_tokens, min_tokens), min never above max: what
    Daft's provider, which takes one sampling setting per query, runs (its `uniform_sampling`)."""
    if not hi:
        return hi, lo
    mean_max = round(sum(hi) / len(hi))
    mean_min = min(mean_max, round(sum(lo) / len(lo)))
    return [mean_max] * len(hi), [mean_min] * len(lo)


def prepare_inputs(dataset: Path, work: Path, default_max: int, default_min: int,
                   mean: bool = False) -> dict[str, Any]:
    """Write the two inputs every method reads, with the same rows and per-row lengths
    (`mean`: every row at the means): `peers.parquet` (id, prompt, max_tokens, min_tokens) and
    `prefixflow.parquet` (id, prompt, and a `sampling` column only when lengths vary;
    otherwise they go as flags)."""
    table = pq.read_table(dataset)
    names = set(table.column_names)
    if "prompt" not in names:
        raise usage_error(f"{dataset}: no 'prompt' column")
    ids = table.column("id") if "id" in names else pa.array(range(table.num_rows), pa.int64())
    wanted = [c for c in ("sampling", "max_tokens", "min_tokens", "output_len") if c in names]
    hi, lo = row_lengths({c: table.column(c).to_pylist() for c in wanted} or {"id": ids.to_pylist()}, default_max, default_min)
    if mean:
        hi, lo = mean_lengths(hi, lo)
    work.mkdir(parents=True, exist_ok=True)
    peers = pa.table({"id": ids, "prompt": table.column("prompt"), "max_tokens": pa.array(hi, pa.int32()),
                      "min_tokens": pa.array(lo, pa.int32())})
    pq.write_table(peers, work / "peers.parquet")
    uniform = len(set(zip(hi, lo))) <= 1
    own = {"id": ids, "prompt": table.column("prompt")}
    if not uniform:
        own["sampling"] = pa.StructArray.from_arrays([pa.array(hi, pa.int32()), pa.array(lo, pa.int32())],
                                                     names=["max_tokens", "min_tokens"])
    pq.write_table(pa.table(own), work / "prefixflow.parquet")
    raw = (table.schema.metadata or {}).get(b"prefixflow.dataset")
    return {
        "rows": table.num_rows,
        "uniform_lengths": (hi[0], lo[0]) if uniform and hi else None,
        "output_tokens_asked": sum(hi),
        "metadata": json.loads(raw) if raw else {},
    }


# --- running -----------------------------------------------------------------------------


@contextlib.contextmanager
def machine_lock(path: str | None) -> Iterator[None]:
    """Hold an exclusive lock on `path` (if given) while one method runs, so that no other
    engine shares the cores; the wait for it is not timed."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def sampling_flags(args: argparse.Namespace, lengths: tuple[int, int] | None) -> list[str]:
    flags = ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    if args.seed is not None:
        flags += ["--seed", str(args.seed)]
    if args.ignore_eos:
        flags.append("--ignore-eos")
    if lengths is not None:
        flags += ["--max-tokens", str(lengths[0]), "--min-tokens", str(lengths[1])]
    return flags


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> tuple[str, float]:
    """Run `cmd` (with `env` added to this environment), its stdout and stderr into `log`;
    (stdout, wall seconds). Raises on failure."""
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False,
                          env={**os.environ, **env} if env else None)
    wall = time.monotonic() - t0
    log.write_text(f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1:3]} exited {proc.returncode}; see {log}")
    return proc.stdout, wall


def run_prefixflow(method: str, round_: int, args: argparse.Namespace, work: Path, inputs: dict[str, Any]) -> Run:
    out, workdir = work / "out" / method, work / "cluster" / method
    for d in (out, workdir):
        shutil.rmtree(d, ignore_errors=True)  # `run` resumes a job whose rows are there
    cmd = [sys.executable, "-m", "prefixflow.cli.main", "run", str(work / "prefixflow.parquet"), "--out", str(out),
           "--model", args.model, "--replicas", str(args.replicas), "--workdir", str(workdir), "--no-progress",
           "--job", f"peers-{method}-{round_}-{int(time.time())}", *PREFIXFLOW_METHODS[method],
           *sampling_flags(args, inputs["uniform_lengths"])]
    if args.kv_cache_blocks:
        cmd += ["--kv-cache-blocks", str(args.kv_cache_blocks)]
    with machine_lock(args.lock):
        stdout, wall = run_logged(cmd, work / "logs" / f"{method}-{round_}.log", args.timeout,
                                  env=PREFIXFLOW_ENV.get(method))
    summary = json.loads((out / "_summary.json").read_text())
    return Run(method=method, round=round_, wall_seconds=round(wall, 3), **parse_prefixflow(summary, stdout))


def run_peer(method: str, round_: int, args: argparse.Namespace, work: Path) -> Run:
    script, extra = PEER_METHODS[method]
    cmd = [args.peers_python, str(PEERS_DIR / script), "--input", str(work / "peers.parquet"), "--model", args.model,
           *extra, *sampling_flags(args, None)]
    if method == "daft-ray":
        cmd += ["--engines", str(args.replicas)]
    if args.kv_cache_blocks:
        cmd += ["--kv-cache-blocks", str(args.kv_cache_blocks)]
    with machine_lock(args.lock):
        stdout, wall = run_logged(cmd, work / "logs" / f"{method}-{round_}.log", args.timeout)
    res = parse_peer_output(stdout)
    fields = {k: res.pop(k) for k in ("rows", "errors", "prompt_tokens", "cached_tokens", "output_tokens", "hit_rate",
                                      "run_seconds", "startup_seconds")}
    res.pop("method", None)
    return Run(method=method, round=round_, wall_seconds=round(wall, 3), **fields, extra=res)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work_dir)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    inputs = prepare_inputs(Path(args.dataset), work, args.max_tokens, args.min_tokens, args.mean_lengths)
    print(f"{inputs['rows']} rows, {inputs['output_tokens_asked']} output tokens asked; "
          f"{args.rounds} round(s) of {', '.join(args.methods)}; logs in {work / 'logs'}", flush=True)
    runs: list[Run] = []
    t0 = time.monotonic()
    for round_ in range(args.rounds):
        for method in args.methods:
            if method in PREFIXFLOW_METHODS:
                run = run_prefixflow(method, round_, args, work, inputs)
            else:
                run = run_peer(method, round_, args, work)
            runs.append(run)
            print(f"round {round_} {method:>22}: run {run.run_seconds:8.2f} s  wall {run.wall_seconds:8.2f} s  "
                  f"hit {run.hit_rate:6.1%}  rows {run.rows} ({run.errors} errors)  out tok {run.output_tokens}", flush=True)
    block_size = next((e.get("block_size") for r in runs for e in r.extra.get("engines", []) if e.get("block_size")), None)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "fn"},
        "dataset": {"path": args.dataset, **inputs},
        "block_size": block_size,
        "ideal_hit_rate": dataset_ideal(args.dataset, inputs["metadata"], block_size),
        "peer_versions": next((r.extra["versions"] for r in runs if "versions" in r.extra), {}),
        "total_seconds": round(time.monotonic() - t0, 1),
        "methods": ratio_table(medians(runs)),
        "runs": [asdict(r) for r in runs],
    }


# --- output ------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=120)  # a log file: no wrapping at 80

    rounds = report["config"]["rounds"]
    table = Table(title=f"{report['dataset']['rows']} rows, medians of {rounds} interleaved round(s); "
                        "ratios against the best peer (lower is better)")
    for name in ("method", "run s", "vs best", "wall s", "vs best", "hit rate", "rows", "errors", "out tokens", "preempted"):
        table.add_column(name, justify="left" if name == "method" else "right", no_wrap=True)
    for r in report["methods"]:
        table.add_row(
            r["method"], _fmt(r["run_seconds"], ".2f"), _fmt(r["run_seconds_vs_best_peer"], ".2f"),
            _fmt(r["wall_seconds"], ".2f"), _fmt(r["wall_seconds_vs_best_peer"], ".2f"), _fmt(r["hit_rate"], ".1%"),
            _fmt(r["rows"], "d"), _fmt(r["errors"], "d"), _fmt(r["output_tokens"], "d"), _fmt(r.get("preemptions"), ".0f"),
        )
    console.print(table)
    if report["ideal_hit_rate"] is not None:
        print(f"analytic ideal hit rate at block size {report['block_size']}: {report['ideal_hit_rate']:.1%}")
    print("run s: without engine start-up; wall s: the whole process, start-up and shutdown included")
    notes = {r["method"]: r["extra"]["sampling_note"] for r in report["runs"] if "sampling_note" in r["extra"]}
    for method, note in notes.items():
        print(f"note ({method}): {note}")
    early = {}  # Daft on Ray and prefixflow: work the first engine did while the last one started
    for r in report["runs"]:
        from_first = r["extra"].get("run_seconds_from_first_engine")
        if from_first is not None and from_first != r["run_seconds"]:
            early.setdefault(r["method"], []).append(from_first)
    for method, values in early.items():
        print(f"note ({method}): run s counts from its last engine ready; from its first: "
              f"{statistics.median(values):.2f} s (median)")


def plot(report: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["methods"]
    names = [r["method"] for r in rows]
    x = list(range(len(rows)))
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, metric, title, color in ((ax1, "run_seconds", "Without engine start-up", "#4477aa"),
                                     (ax2, "wall_seconds", "With start-up and shutdown", "#aabbdd")):
        ax.bar(x, [r[metric] or 0 for r in rows], color=color)
        for i, r in zip(x, rows):
            if r[f"{metric}_vs_best_peer"] is not None:
                ax.annotate(f"{r[f'{metric}_vs_best_peer']:.2f}x", (i, r[metric]), ha="center", va="bottom", fontsize=8)
        ax.set_ylabel("seconds, median (lower is better)")
        ax.set_title(f"{title} (x: vs best peer)")
    ax3.bar(x, [100 * (r["hit_rate"] or 0) for r in rows], color="#228833")
    if report["ideal_hit_rate"] is not None:
        ax3.axhline(100 * report["ideal_hit_rate"], color="black", linestyle="--", label="analytic ideal")
        ax3.legend()
    ax3.set_ylabel("prefix-cache hit rate, %")
    ax3.set_title("Prefix-cache hit rate")
    for ax in (ax1, ax2, ax3):
        ax.set_xticks(x, names, rotation=30, ha="right")
    meta = report["dataset"]["metadata"]
    cfg = report["config"]
    fig.suptitle(f"{Path(cfg['dataset']).name} ({meta.get('generator', 'dataset')}, {report['dataset']['rows']} rows), "
                 f"{cfg['replicas']} engines / replicas, KV cap {cfg['kv_cache_blocks'] or 'none'} blocks per engine")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def cmd_peers(args: argparse.Namespace) -> None:
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(args.methods) - set(METHODS)
    if unknown:
        raise usage_error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if any(m in PEER_METHODS for m in args.methods) and not Path(args.peers_python).exists():
        raise usage_error(f"{args.peers_python} not found: install the peers with `make bench-peers`")
    if args.rounds < 1:
        raise usage_error("--rounds must be at least 1")
    args.model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    report = bench(args)
    print()
    print_table(report)
    from prefixflow.bench.common import write_report

    write_report(report, args.json, args.plot, plot)


def add_peers_parser(sub) -> None:
    p = sub.add_parser("peers", help="prefixflow against Daft's vllm-prefix-caching provider and vLLM offline (docs/peers.md)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dataset", help="Parquet from `prefixflow dataset` (id, prompt; optionally sampling, max_tokens, min_tokens, output_len)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each metric is the median (default 3)")
    p.add_argument("--replicas", type=int, default=2, help="prefixflow replicas and daft-ray engine actors (default 2: one per core here)")
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="KV blocks per engine, every method (0: vLLM's own size)")
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL)
    p.add_argument("--max-tokens", type=int, default=128, help="for rows whose dataset gives no length")
    p.add_argument("--min-tokens", type=int, default=0, help="for rows whose dataset gives no length")
    p.add_argument("--mean-lengths", action="store_true",
                   help="every method runs every row at the rounded mean lengths (the job Daft's provider runs on rows "
                        "whose lengths differ): a like-for-like comparison")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (per row: seed + id)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate every row's max_tokens (default on: equal work for every method)")
    p.add_argument("--peers-python", default=str(REPO / ".venv-peers" / "bin" / "python"), help="the peers' interpreter")
    p.add_argument("--lock", default=None, help="hold this file locked during each method's run (no other engine on the cores)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.add_argument("--work-dir", default=".prefixflow/bench-peers", help="inputs, outputs and logs")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--plot", help="write a PNG here")
    p.set_defaults(fn=cmd_peers)
