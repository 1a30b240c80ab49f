"""`prefixflow bench eta`: how right the ETA of `prefixflow status` is while a job runs,
on a job whose rate changes partway (docs/plan.md, issue 43 must-show 3).

The job: `--rows` prompts (prefix-repetition), the first half asking `--output-len`
tokens (`min_tokens` = `max_tokens`), the second half 4x that. It runs with `prefixflow
run` (the echo engine with a per-prompt and a per-output-token delay, or vLLM); the
harness reads the job's status from the cluster's NATS every `--poll` seconds, as
`prefixflow status` does, and records each reading's ETA by the model
(`JobStatus.eta_seconds`, `prefixflow/shared/eta.py`: output tokens weighed by the cost the
job's engines measured, `JobStatus.decode_cost`) and by rows/s alone. At the end,
for the first reading at or past each checkpoint (25 %, 50 %, 75 % of the rows) it
reports both ETAs against the remaining time actually measured (until the status says
done).

    prefixflow bench eta --engine echo --rows 20000 --json eta-echo.json
    prefixflow bench eta --engine vllm --rows 2000 --output-len 16 --json eta-vllm.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixflow.shared.outcomes import CommandError, Exit

CHECKPOINTS = (0.25, 0.5, 0.75)
VARIANTS = ("eta_model", "eta_rows", "eta_work", "eta_engine")
"""The ETAs reported: what `status` shows (`JobStatus.eta_seconds`), rows/s alone, and
each of the model's parts (`prefixflow/shared/eta.py`): the token-work model and the
engines' step model."""


def add_eta_parser(sub) -> None:
    p = sub.add_parser("eta", help="ETA accuracy of `status` on a job whose outputs grow 4x halfway")
    p.add_argument("--engine", choices=("echo", "vllm"), default="echo")
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--output-len", type=int, default=16, help="output tokens of the first half (the second: 4x)")
    p.add_argument("--prefix-len", type=int, default=64)
    p.add_argument("--suffix-len", type=int, default=192)
    p.add_argument("--num-prefixes", type=int, default=32)
    p.add_argument("--echo-delay", type=float, default=0.05, help="echo: seconds per prompt")
    p.add_argument("--echo-token-delay", type=float, default=0.005, help="echo: seconds per output token")
    p.add_argument("--window", type=int, default=32,
                   help="echo: the engine-worker's window. With it and the delays a replica's 32 requests take "
                        "130-370 ms, longer than the pipeline takes to refill them, so the engines set the pace and "
                        "the rate really drops 2.8x halfway (with 2 ms + 0.5 ms a token and a window of 4 the refills "
                        "set it: the rate stayed flat, and the job tested nothing)")
    p.add_argument("--poll", type=float, default=0.5)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(fn=cmd_eta)


def write_input(path: Path, args: argparse.Namespace, model: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from prefixflow.datagen.dataset import write_prefix_repetition

    table = write_prefix_repetition(path, tokenizer_dir=model, num_prompts=args.rows, prefix_len=args.prefix_len,
                                    suffix_len=args.suffix_len, num_prefixes=args.num_prefixes,
                                    output_len=args.output_len, seed=0)
    half = args.rows // 2
    lens = [args.output_len] * half + [4 * args.output_len] * (args.rows - half)
    sampling = pa.array([{"max_tokens": k, "min_tokens": k} for k in lens])
    keep = [c for c in table.column_names if c not in ("sampling", "output_len")]
    pq.write_table(table.select(keep).append_column("sampling", sampling).append_column("output_len", pa.array(lens)), path)


async def follow(url: str, poll: float, proc: subprocess.Popen) -> list[dict]:
    """Every reading of the (only) job's status until it is done or the run ended."""
    import msgspec
    import nats

    from prefixflow.shared.wire import messages as m
    from prefixflow.shared.wire import subjects

    async def quiet(_exc: Exception) -> None:  # the cluster's NATS may not be up yet: retried below
        return None

    nc = None
    while nc is None:
        if proc.poll() is not None:
            return []
        try:
            nc = await nats.connect(url, error_cb=quiet, allow_reconnect=False, connect_timeout=2)
        except (OSError, asyncio.TimeoutError, nats.errors.NoServersError):
            await asyncio.sleep(poll)
    readings: list[dict] = []
    try:
        kv = None
        while kv is None and proc.poll() is None:  # the cluster makes its buckets as it starts
            try:
                kv = await nc.jetstream().key_value(subjects.JOB_STATUS_KV)
            except Exception:  # noqa: BLE001 - a harness: not made yet
                await asyncio.sleep(poll)
        while proc.poll() is None:
            try:
                keys = await kv.keys()
                st = m.job_status_decoder.decode((await kv.get(keys[0])).value)
            except Exception:  # noqa: BLE001 - a harness: no job yet, bucket not made yet
                await asyncio.sleep(poll)
                continue
            now = time.time()
            rows_eta = (st.total - st.rows) / st.rate if st.total and st.rate > 0 else None
            model, progress = st.eta_model(), st.eta_progress()
            readings.append({"t": now, "rows": st.rows, "total": st.total, "done": st.done,
                             "eta_model": st.eta_seconds(), "eta_rows": rows_eta, "decode_cost": st.decode_cost,
                             "eta_work": model.work_eta(progress), "eta_engine": model.engine_eta(progress),
                             "replicas": st.replicas,
                             "step": None if st.step is None else msgspec.structs.asdict(st.step),
                             "output_tokens": st.output_tokens, "prompt_tokens": st.prompt_tokens,
                             "cached_tokens": st.cached_tokens, "rate": st.rate})
            if st.done:
                break
            await asyncio.sleep(poll)
    finally:
        await nc.close()
    return readings


def score(readings: list[dict]) -> list[dict]:
    """Per checkpoint: each ETA against the remaining time measured."""
    end = next((r["t"] for r in readings if r["done"]), None)
    out = []
    for frac in CHECKPOINTS:
        r = next((r for r in readings if r["total"] and r["rows"] >= frac * r["total"] and not r["done"]), None)
        if r is None or end is None:
            continue
        actual = end - r["t"]
        row = {"checkpoint": frac, "rows": r["rows"], "actual_remaining_s": round(actual, 2),
               "decode_cost": r.get("decode_cost")}
        for k in VARIANTS:
            v = r.get(k)
            row[k + "_s"] = None if v is None else round(v, 2)
            row[k + "_error"] = None if v is None or actual <= 0 else round(v / actual - 1, 3)
        out.append(row)
    return out


def cmd_eta(args: argparse.Namespace) -> None:
    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.process.config import DEFAULT_MODEL

    model = str(make_model(os.environ.get("PFX_MODEL", DEFAULT_MODEL)))
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pfx-bench-eta-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "input.parquet"
    write_input(data, args, model)
    env = {**os.environ, "PFX_MODEL": model}
    if args.engine == "echo":
        env |= {"PFX_ECHO_DELAY": str(args.echo_delay), "PFX_ECHO_TOKEN_DELAY": str(args.echo_token_delay)}
        if args.window:
            env["PFX_WINDOW"] = str(args.window)
    cluster = work / "cluster"
    cmd = [sys.executable, "-m", "prefixflow.cli.main", "run", str(data), "--out", str(work / "out"), "--overwrite",
           "--engine", args.engine, "--replicas", str(args.replicas), "--workdir", str(cluster), "--no-progress",
           "--no-report", "--model", model]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not (cluster / "pids.json").exists() and proc.poll() is None:
            time.sleep(0.2)
        url = json.loads((cluster / "pids.json").read_text())["url"] if proc.poll() is None else ""
        readings = asyncio.run(follow(url, args.poll, proc)) if url else []
    finally:
        _, err = proc.communicate(timeout=600)
    if proc.returncode != 0:
        raise CommandError(f"the job failed ({proc.returncode}): {err[-800:]}", Exit.FAILED)
    report = {"engine": args.engine, "rows": args.rows, "replicas": args.replicas,
              "output_lens": [args.output_len, 4 * args.output_len],
              "echo": {"delay": args.echo_delay, "token_delay": args.echo_token_delay} if args.engine == "echo" else None,
              "checkpoints": score(readings), "readings": len(readings)}
    print(json.dumps({k: v for k, v in report.items()}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report | {"trace": readings}, indent=1) + "\n")
