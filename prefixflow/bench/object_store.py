"""`prefixflow bench s3`: the same job read from and written to an S3 API server against
local files, side by side (issue 41).

The input is `bench soak`'s (token ids: a shared prefix and a random suffix per row, from a
fixed seed), split into `--shards` Parquet files in a local directory and uploaded as the
same files under `s3://BUCKET/bench-in/`. Each round runs `prefixflow run` (echo engine: no
model, so the pipeline, the client's reads and the sink's writes are what is measured)
twice, in turn: local directory -> local `--out`, then S3 prefix -> `s3://.../bench-out/`,
each with `bench soak`'s sampler (RSS of `run` and every process of its cluster, the job's
rows from its status). After each run the output is checked: rows == N and every id
once (for S3: the files the manifest names).

The S3 server is moto's server mode started here on a loopback port (`--endpoint` for
another S3-compatible server, with the credentials of this environment): its speed, a
single Python process holding every object in memory, bounds the S3 figures, not a
cloud store's.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from prefixflow.bench.soak import MIB, check_output, generate_input, watch

BUCKET = "pfx-bench"
MODES = ("local", "s3")


def split_shards(path: Path, shards: int, dest: Path) -> list[Path]:
    """`path`'s row groups in `shards` files of consecutive groups (in name order: ids in
    order across them), one row group held at a time."""
    import pyarrow.parquet as pq

    dest.mkdir(parents=True, exist_ok=True)
    src = pq.ParquetFile(path, pre_buffer=False)
    groups = src.num_row_groups
    per = -(-groups // shards)
    out = []
    for k in range(0, groups, per):
        target = dest / f"part-{k // per:03d}.parquet"
        with pq.ParquetWriter(target, src.schema_arrow) as writer:
            for g in range(k, min(k + per, groups)):
                writer.write_table(src.read_row_group(g))
        out.append(target)
    return out


def upload(files: list[Path], fs, prefix: str) -> float:
    """Copy `files` under `prefix` (bucket/key) in `fs`; seconds taken."""
    t = time.monotonic()
    for f in files:
        with fs.open_output_stream(f"{prefix}/{f.name}") as w, f.open("rb") as r:
            while chunk := r.read(8 * MIB):
                w.write(chunk)
    return time.monotonic() - t


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """The figures a row of the table shows, from one `watch` result."""
    procs = run["processes"]
    out = run["output"]
    return {
        "job_s": run["job_seconds"], "run_s": run["run_seconds"], "prompts_per_s": run["prompts_per_second"],
        "peak_rss_mib": {name: procs[name]["peak_rss_mib"] for name in ("run", "sink") if name in procs},
        "cpu_s": {name: procs[name].get("cpu_seconds") for name in ("run", "sink") if name in procs},
        "files": out["files"], "total_mib": out["total_mib"], "ids_ok": out["ids_ok"],
    }


def medians(rounds: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    rows = [r[mode] for r in rounds if mode in r]

    def med(get) -> float | None:
        vals = [v for v in (get(r) for r in rows) if v is not None]
        return round(statistics.median(vals), 2) if vals else None

    return {"job_s": med(lambda r: r["job_s"]), "prompts_per_s": med(lambda r: r["prompts_per_s"]),
            "run_s": med(lambda r: r["run_s"]),
            "peak_rss_mib": {p: med(lambda r, p=p: r["peak_rss_mib"].get(p)) for p in ("run", "sink")},
            "cpu_s": {p: med(lambda r, p=p: r["cpu_s"].get(p)) for p in ("run", "sink")}}


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['prompts']:,} prompts in {report['shards']} shards ({report['input_mib']} MiB), "
          f"{report['rounds']} round(s), S3 server: {report['server']}")
    print("| round | input -> output | job s | prompts/s | whole run s | peak RSS MiB run / sink | CPU s run / sink | files | ids once |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(report["per_round"], 1):
        for mode in MODES:
            if mode not in r:
                continue
            x = r[mode]
            print(f"| {i} | {mode} | {x['job_s']} | {x['prompts_per_s']:,} | {x['run_s']} | "
                  f"{x['peak_rss_mib'].get('run')} / {x['peak_rss_mib'].get('sink')} | "
                  f"{x['cpu_s'].get('run')} / {x['cpu_s'].get('sink')} | {x['files']} | {x['ids_ok']} |")
    m = report["medians"]
    if m.get("local", {}).get("prompts_per_s") and m.get("s3", {}).get("prompts_per_s"):
        print(f"median prompts/s: local {m['local']['prompts_per_s']:,}, s3 {m['s3']['prompts_per_s']:,} "
              f"(s3/local {report['s3_over_local']:.2f})")


async def rounds_of(args, n: int, shards_dir: Path, base: Path, env: dict[str, str], fs) -> list[dict[str, Any]]:
    out = []
    for r in range(args.rounds):
        row: dict[str, Any] = {}
        for mode in MODES:
            if mode == "local":
                target: Path | str = base / f"out-local-{r}"
                run = await watch(args, n, shards_dir, base, out=target, name=f"local-{r}", extra=("--no-report",))
            else:
                fs.delete_dir_contents(f"{BUCKET}/bench-out/{r}", missing_dir_ok=True)
                target = f"s3://{BUCKET}/bench-out/{r}/"
                run = await watch(args, n, f"s3://{BUCKET}/bench-in/", base, out=target, name=f"s3-{r}", env=env,
                                  extra=("--no-report",))
            run["output"] = check_output(target, n)
            row[mode] = summarize(run)
            print(f"round {r + 1} {mode}: {row[mode]}", flush=True)
        out.append(row)
    return out


def cmd_s3(args) -> None:
    from prefixflow.bench.common import write_report
    from prefixflow.shared.outcomes import CommandError, Exit

    n = args.prompts
    base = Path(args.out_dir or f".prefixflow/bench/s3-{n}").resolve()
    shape = dict(prompt_len=args.prompt_len, prefix_len=args.prompt_len // 2, num_prefixes=args.num_prefixes, seed=args.seed)
    single = base / f"input-n{n}-l{args.prompt_len}-x{args.num_prefixes}-s{args.seed}.parquet"
    if not single.exists():
        generate_input(single, n, rows_per_group=args.row_group_rows, **shape)
    shards_dir = base / f"shards-{args.shards}"
    files = sorted(shards_dir.glob("part-*.parquet")) or split_shards(single, args.shards, shards_dir)
    server = None
    if args.endpoint:
        env = {"AWS_ENDPOINT_URL": args.endpoint}
    else:
        from prefixflow.bench.s3server import S3Server

        server = S3Server(base / "moto.log", bucket=BUCKET).start()
        env = server.env
    os.environ.update(env)  # this process reads the outputs with the same credentials
    try:
        from prefixflow.shared.outputs import filesystem

        fs, _ = filesystem(f"s3://{BUCKET}/")
        if args.endpoint:
            fs.create_dir(BUCKET)
        seconds = upload(files, fs, f"{BUCKET}/bench-in")
        input_bytes = sum(f.stat().st_size for f in files)
        print(f"uploaded {len(files)} shards ({input_bytes / MIB:.1f} MiB) in {seconds:.1f} s", flush=True)
        per_round = asyncio.run(rounds_of(args, n, shards_dir, base, env, fs))
    finally:
        if server is not None:
            server.stop()
    bad = [(i, m) for i, r in enumerate(per_round) for m in MODES if not r[m]["ids_ok"]]
    meds = {mode: medians(per_round, mode) for mode in MODES}
    report = {"bench": "s3", "prompts": n, "shards": len(files), "rounds": args.rounds, "shape": shape,
              "input_mib": round(input_bytes / MIB, 1), "upload_seconds": round(seconds, 1),
              "server": args.endpoint or "moto_server (in memory, loopback)",
              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
              "per_round": per_round, "medians": meds,
              "s3_over_local": round(meds["s3"]["prompts_per_s"] / meds["local"]["prompts_per_s"], 3)
              if meds["s3"]["prompts_per_s"] and meds["local"]["prompts_per_s"] else None}
    print_table(report)
    write_report(report, args.result or f"prefixflow/bench/results/s3-{n}.json")
    if bad:
        raise CommandError(f"output check failed (round, mode): {bad}", Exit.FAILED)


def add_s3_parser(sub) -> None:
    p = sub.add_parser("s3", help="one job read from and written to an S3 API server vs local files (echo engine)",
                       description=__doc__)
    p.add_argument("--prompts", type=int, default=1_000_000, help="rows in the job (default 1000000)")
    p.add_argument("--shards", type=int, default=4, help="input files (default 4)")
    p.add_argument("--rounds", type=int, default=2, help="local and S3 runs, interleaved (default 2 each)")
    p.add_argument("--endpoint", default=None,
                   help="an S3-compatible server to use (credentials from the environment); default: start moto_server here")
    p.add_argument("--engine", choices=("echo",), default="echo", help="echo: no model")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default 128; half a shared prefix)")
    p.add_argument("--num-prefixes", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-group-rows", type=int, default=65_536)
    p.add_argument("--out-dir", default=None, help="inputs, outputs, work dirs and logs (default .prefixflow/bench/s3-N)")
    p.add_argument("--prefixflow", default=None, help="the prefixflow executable to run")
    p.add_argument("--cwd", default=None)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=0, help="stop a run after this many seconds (0: never)")
    p.add_argument("--result", default=None, help="JSON result (default prefixflow/bench/results/s3-N.json)")
    p.set_defaults(fn=cmd_s3)
