"""`prefixflow bench soak`: one long job through `prefixflow run` (echo engine, no model),
watching every process's memory on the way.

The input is generated straight as token ids (`id` int64, `prompt_token_ids` list<int32>),
one row group at a time, so the harness never holds the table: every row is a shared prefix
(one of `--num-prefixes`, so bucketing has work) and a random suffix, from a fixed seed.
`prefixflow run` (this checkout's or `--prefixflow`'s, e.g. another worktree's) runs it as
a subprocess with `--workdir`, whose `pids.json` names every process of the cluster. Every
second the harness samples the RSS of `run` itself and of each process in `pids.json`
(with its children), reads the job's progress from the cluster's `PFX_JOB_STATUS` KV
bucket (or counts rows in the output's Parquet footers when it cannot), and keeps the
readings at 10, 50 and 100 % of the rows and the last one before `run` exits (after it has
written `_report/`). Then it checks the output: part files and sizes, rows == N, ids unique.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from prefixflow.bench.sampling import MIB, Progress, Sampler
from prefixflow.shared.outcomes import CommandError, Exit

PART_BYTES = 128 * MIB
"""The sink's target part size (an output of B bytes should be about B / 128 MiB + 1 files)."""
RSS_LIMIT_MIB = 1.5 * 1024
FLAT_TOLERANCE = 0.10
MILESTONES = (10, 50, 100)
TOKEN_RANGE = (10, 8000)
"""Token ids drawn (the local tiny model's vocabulary is 8192)."""


# -- pure parts --------------------------------------------------------------------------


def expected_files(total_bytes: int, part_bytes: int = PART_BYTES) -> int:
    """How many part files an output of `total_bytes` should have at `part_bytes` each."""
    return total_bytes // part_bytes + 1


def is_flat(at_warm: float | None, last: float | None, tolerance: float = FLAT_TOLERANCE) -> bool | None:
    """Whether memory stayed flat after warm-up: the last reading at most `tolerance` above
    the reading at 10 % of the rows (shrinking is flat). None without both readings."""
    if at_warm is None or last is None:
        return None
    return last <= at_warm * (1 + tolerance)


def verdicts(procs: dict[str, dict[str, Any]], limit_mib: float = RSS_LIMIT_MIB) -> dict[str, Any]:
    """Per process: flat after warm-up, peak under `limit_mib`; and whether all pass."""
    out = {}
    for name, p in procs.items():
        at = p.get("rss_mib_at", {})
        warm, high = at.get("10%"), p.get("peak_after_warm_mib")
        out[name] = {"flat": is_flat(warm, p.get("last_rss_mib")),
                     "peak_after_warm_over_warm": round(high / warm, 2) if warm and high else None,
                     "under_limit": p.get("peak_rss_mib") is not None and p["peak_rss_mib"] < limit_mib}
    return {"per_process": out, "all_flat": all(v["flat"] is not False for v in out.values()),
            "all_under_limit": all(v["under_limit"] for v in out.values())}


def input_batch(start: int, rows: int, prefixes, prompt_len: int, seed: int):
    """Rows `start` .. `start + rows` of the input as a record batch; the same rows for the
    same arguments whatever else was generated (the generator is keyed by `start`)."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng([seed, start])
    prefix = prefixes[rng.integers(0, len(prefixes), rows)]
    suffix = rng.integers(*TOKEN_RANGE, (rows, prompt_len - prefixes.shape[1]), dtype=np.int32)
    tokens = np.hstack([prefix, suffix]).astype(np.int32).ravel()
    offsets = np.arange(0, rows * prompt_len + 1, prompt_len, dtype=np.int32)
    return pa.RecordBatch.from_arrays(
        [pa.array(np.arange(start, start + rows, dtype=np.int64)), pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens))],
        names=["id", "prompt_token_ids"],
    )


def generate_input(path: Path, n: int, *, prompt_len: int = 128, prefix_len: int = 64, num_prefixes: int = 1024,
                   seed: int = 0, rows_per_group: int = 65_536) -> dict[str, Any]:
    """Write the input Parquet one row group at a time (memory bounded by one group)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not 0 < prefix_len < prompt_len:
        raise ValueError("want 0 < prefix_len < prompt_len")
    prefixes = np.random.default_rng(seed).integers(*TOKEN_RANGE, (num_prefixes, prefix_len), dtype=np.int32)
    schema = pa.schema([("id", pa.int64()), ("prompt_token_ids", pa.list_(pa.int32()))])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    groups = 0
    with pq.ParquetWriter(tmp, schema) as writer:
        for start in range(0, n, rows_per_group):
            batch = input_batch(start, min(rows_per_group, n - start), prefixes, prompt_len, seed)
            writer.write_table(pa.Table.from_batches([batch], schema), row_group_size=rows_per_group)
            groups += 1
    tmp.replace(path)
    return {"path": str(path), "rows": n, "row_groups": groups, "bytes": path.stat().st_size}


def check_output(out: Path | str, n: int) -> dict[str, Any]:
    """Part files, their sizes, rows and whether ids are 0..n-1 each once (a bitmap, read
    one batch of ids at a time). `out`: a local directory, or an object store URI (the
    files its manifest names)."""
    import numpy as np
    import pyarrow.parquet as pq

    from prefixflow.shared.outputs import committed_files, filesystem, is_output_uri

    if is_output_uri(str(out)):
        fs, _ = filesystem(str(out))
        parts = committed_files(str(out))
        sizes = [i.size for i in fs.get_file_info(parts)]
        opener = fs.open_input_file
    else:
        parts = sorted(Path(out).glob("part-*.parquet"))
        sizes = [p.stat().st_size for p in parts]
        opener = None
    seen = np.zeros(n, dtype=bool)
    rows = dups = outside = 0
    for p in parts:
        source = opener(p) if opener else p
        for batch in pq.ParquetFile(source, pre_buffer=False).iter_batches(columns=["id"], batch_size=262_144):
            ids = batch.column(0).to_numpy(zero_copy_only=False)
            rows += len(ids)
            ok = (ids >= 0) & (ids < n)
            outside += int((~ok).sum())
            ids = ids[ok].astype(np.int64)
            dups += len(ids) - len(np.unique(ids)) + int(seen[ids].sum())
            seen[ids] = True
    total = sum(sizes)
    mib = sorted(s / MIB for s in sizes) or [0.0]
    return {"files": len(parts), "total_mib": round(total / MIB, 1),
            "file_mib_min_median_max": [round(mib[0], 2), round(mib[len(mib) // 2], 2), round(mib[-1], 2)],
            "file_bytes": sizes if len(sizes) <= 1000 else None,
            "expected_files": expected_files(total), "rows": rows, "rows_ok": rows == n,
            "unique_ids": int(seen.sum()), "duplicate_ids": dups, "ids_outside": outside,
            "ids_ok": rows == n and dups == 0 and outside == 0 and int(seen.sum()) == n}


def downsample(points: list, keep: int = 600) -> list:
    step = max(1, -(-len(points) // keep))
    return points[::step] + ([points[-1]] if points and (len(points) - 1) % step else [])


# -- the run -----------------------------------------------------------------------------


def prefixflow_cmd(exe: str | None) -> list[str]:
    if exe:
        return [str(Path(exe).resolve())]
    from prefixflow.launch.local_cluster import prefixflow_argv

    return prefixflow_argv()


async def watch(args, n: int, input_path: Path | str, base: Path, *, out: Path | str | None = None,
                name: str | None = None, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One `prefixflow run` of `input_path` (a path or URI) into `out` (default `base/out`;
    an object store URI is emptied by the caller), sampled as the module's doc says."""
    out = base / "out" if out is None else out
    workdir, job = base / (f"work-{name}" if name else "work"), f"{name or 'soak'}-{n}-{int(time.time())}"
    for d in ((out, workdir) if isinstance(out, Path) else (workdir,)):
        shutil.rmtree(d, ignore_errors=True)  # a rerun must not resume the last run
    argv = [*prefixflow_cmd(args.prefixflow), "run", str(input_path), "--out", str(out), "--workdir", str(workdir),
            "--engine", args.engine, "--replicas", str(args.replicas), "--max-tokens", str(args.max_tokens),
            "--job", job, "--no-progress", *extra]
    cwd = Path(args.cwd or (Path(args.prefixflow).resolve().parents[2] if args.prefixflow else Path.cwd()))
    log_path = base / (f"{name}.log" if name else "run.log")
    print(f"$ (cd {cwd}; {' '.join(argv)})  > {log_path}", flush=True)
    t0, t0_unix = time.monotonic(), time.time()
    with log_path.open("wb") as logf:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=logf, stderr=subprocess.STDOUT,
                                env={**os.environ, **env} if env else None)
    sampler, progress = Sampler(proc.pid, workdir), Progress(job, out if isinstance(out, Path) else None)
    marks: dict[str, dict[str, Any]] = {}
    timeline: list[list] = []
    done_at = report_at = None
    try:
        while proc.poll() is None:
            reading = sampler.sample()
            now = time.monotonic() - t0
            rows, done = (n, True) if done_at is not None else await progress.rows(sampler.url)
            if done_at is None and (done or rows >= n):
                done_at = now
                await progress.close()
            for pct in MILESTONES:
                if f"{pct}%" not in marks and rows * 100 >= pct * n:
                    # A process that has just stopped (run stops the cluster once the job is
                    # done) counts with its last reading.
                    latest = {name: p["last_rss_mib"] for name, p in sampler.procs.items()}
                    marks[f"{pct}%"] = {"seconds": round(now, 1), "rows": rows, "rss_mib": latest}
                    print(f"{now:7.1f} s  {pct:3d} % ({rows:,} rows)  RSS MiB: "
                          + " ".join(f"{k} {v:.0f}" for k, v in latest.items()), flush=True)
            timeline.append([round(now, 1), rows, reading])
            if "10%" in marks:  # the highest reading after warm-up (the flatness check only sees the last)
                for name, mib in reading.items():
                    p = sampler.procs[name]
                    p["peak_after_warm_mib"] = max(p.get("peak_after_warm_mib", 0.0), mib)
            if done_at is not None and report_at is None and isinstance(out, Path) and (out / "_report").exists():
                report_at = now  # run is writing (or has written) the report: later readings are after it
            if args.timeout and now > args.timeout:
                proc.send_signal(signal.SIGTERM)  # run stops its cluster on SIGTERM
                proc.wait(120)
                break
            # Closer looks near the end: the 100 % reading, and the last one before run exits.
            await asyncio.sleep(min(0.25, args.interval) if rows * 10 >= 9 * n else args.interval)
    except BaseException:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        raise
    finally:
        await progress.close()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise CommandError(f"prefixflow run exited with {proc.returncode} (log {log_path}):\n{tail}", Exit.FAILED)
    st = progress.status
    job_seconds = None  # submit (the spec's created_at) to done (the sink's last status update)
    if st.get("done") and st.get("created_at") and st.get("updated_at"):
        job_seconds = st["updated_at"] - st["created_at"]
    elif done_at is not None:
        job_seconds = done_at  # an older cluster: from the start of run (start-up included)
    for name, p in sampler.procs.items():
        for label, mark in marks.items():
            p["rss_mib_at"][label] = mark["rss_mib"].get(name)
        p["rss_mib_at"]["after report" if name == "run" else "last"] = p["last_rss_mib"]
        p["peak_rss_mib"] = max(p["peak_rss_mib"], p.get("own_vm_hwm_mib") or 0)
        p["restarts"] = sampler.restarts.get(name, 0)
    return {
        "job": job, "argv": argv, "cwd": str(cwd), "log": str(log_path), "out": str(out), "started_unix": round(t0_unix, 1),
        "job_seconds": round(job_seconds, 2) if job_seconds is not None else None,
        "job_seconds_source": "job status created_at..updated_at" if st.get("created_at") else "observed from the start of run",
        "run_seconds": round(wall, 2), "done_at_seconds": round(done_at, 2) if done_at is not None else None,
        "report_seen_at_seconds": report_at, "last_sample_seconds": timeline[-1][0] if timeline else None,
        "prompts_per_second": round(n / job_seconds, 1) if job_seconds else None,
        "summary": st.get("summary"), "milestones": {k: {"seconds": v["seconds"], "rows": v["rows"]} for k, v in marks.items()},
        "processes": sampler.procs,
        "timeline": downsample(timeline),
    }


def cmd_soak(args) -> None:
    from prefixflow.bench.common import write_report

    n = args.prompts
    base = Path(args.out_dir or f".prefixflow/bench/soak-{n}").resolve()
    shape = dict(prompt_len=args.prompt_len, prefix_len=args.prefix_len or args.prompt_len // 2,
                 num_prefixes=args.num_prefixes, seed=args.seed)
    input_path = base / f"input-n{n}-l{shape['prompt_len']}-p{shape['prefix_len']}x{shape['num_prefixes']}-s{args.seed}.parquet"
    t = time.monotonic()
    if input_path.exists() and not args.regenerate:
        print(f"reusing {input_path}", flush=True)
    else:
        generate_input(input_path, n, rows_per_group=args.row_group_rows, **shape)
        print(f"{n:,} rows generated in {time.monotonic() - t:.1f} s: {input_path} "
              f"({input_path.stat().st_size / MIB:.1f} MiB)", flush=True)
    run = asyncio.run(watch(args, n, input_path, base))
    run["output"] = check_output(Path(run["out"]), n)
    run["checks"] = verdicts(run["processes"])
    report = {"bench": "soak", "prompts": n, "config": {k: v for k, v in vars(args).items() if k not in ("fn", "engine_argv")} | shape,
              "input_mib": round(input_path.stat().st_size / MIB, 1), "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
              "rss_limit_mib": RSS_LIMIT_MIB, "flat_tolerance": FLAT_TOLERANCE, **run}
    if run["job_seconds"]:
        report["extrapolated_job_seconds_10M"] = round(run["job_seconds"] * 10_000_000 / n)
        report["extrapolated_run_seconds_10M"] = round(run["run_seconds"] * 10_000_000 / n)
    print_table(report)
    write_report(report, args.result or f"prefixflow/bench/results/soak-{n}.json")


def print_table(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=140)
    labels = [f"{p}%" for p in MILESTONES]
    t = Table(title=f"soak: {r['prompts']:,} prompts, {r['config']['engine']} engine, {r['config']['replicas']} replicas (RSS MiB)")
    for col in ("process", *labels, "last / after report", "peak", "max after 10% / 10%", "CPU s", "flat", f"< {RSS_LIMIT_MIB / 1024:g} GiB"):
        t.add_column(col, justify="left" if col == "process" else "right", no_wrap=True)
    checks = r["checks"]["per_process"]
    for name, p in r["processes"].items():
        at = p["rss_mib_at"]
        t.add_row(name, *(f"{at[k]:.0f}" if at.get(k) is not None else "-" for k in labels),
                  f"{p['last_rss_mib']:.0f}", f"{p['peak_rss_mib']:.0f}", str(checks[name]["peak_after_warm_over_warm"] or "-"),
                  f"{p.get('cpu_seconds', 0):.0f}",
                  {True: "yes", False: "[red]NO[/red]", None: "-"}[checks[name]["flat"]],
                  "yes" if checks[name]["under_limit"] else "[red]NO[/red]")
    console.print(t)
    o = r["output"]
    pps = r["prompts_per_second"]
    console.print(f"job {r['job_seconds']} s (submit to done; {r['job_seconds_source']}), {pps} prompts/s; "
                  f"whole run {r['run_seconds']} s (start-up, job, stop, report)")
    console.print(f"output: {o['files']} files (expected ~{o['expected_files']} at 128 MiB), {o['total_mib']} MiB, "
                  "MiB per file min/median/max " + "/".join(map(str, o["file_mib_min_median_max"])) + f"; rows {o['rows']:,} "
                  f"({'ok' if o['rows_ok'] else 'WRONG'}), unique ids {o['unique_ids']:,} ({'ok' if o['ids_ok'] else 'WRONG'})")
    if "extrapolated_job_seconds_10M" in r:
        console.print(f"at 10M rows, linearly: job ~{r['extrapolated_job_seconds_10M'] / 3600:.1f} h, "
                      f"whole run ~{r['extrapolated_run_seconds_10M'] / 3600:.1f} h")


def add_soak_parser(sub) -> None:
    p = sub.add_parser("soak", help="one long job through `prefixflow run` (echo engine): every process's RSS over time, output checks")
    p.add_argument("--prompts", type=int, default=100_000, help="rows in the job (default 100000)")
    p.add_argument("--engine", choices=("echo",), default="echo", help="echo: no model")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default 128)")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens (default half the prompt)")
    p.add_argument("--num-prefixes", type=int, default=1024, help="distinct shared prefixes (default 1024)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-group-rows", type=int, default=65_536, help="input rows per Parquet row group (what the generator holds)")
    p.add_argument("--regenerate", action="store_true", help="write the input again even if it exists")
    p.add_argument("--out-dir", default=None, help="input, out/, work/ and run.log (default .prefixflow/bench/soak-N)")
    p.add_argument("--prefixflow", default=None, help="the prefixflow executable to run (e.g. another worktree's .venv/bin/prefixflow)")
    p.add_argument("--cwd", default=None, help="where to run it (default: the checkout of --prefixflow, else here)")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=0, help="stop the run after this many seconds (0: never)")
    p.add_argument("--result", default=None, help="JSON result (default prefixflow/bench/results/soak-N.json)")
    p.set_defaults(fn=cmd_soak)
