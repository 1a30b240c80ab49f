"""`prefixflow bench pipeline`: prompts per second through every service with the `echo`
engine (no model), each service's peak RSS and CPU time, and the bytes published per
prompt on each subject family (a core-NATS wiretap on `pfx.>`).

The input goes through the same client path as a user's file: the rows (with
`--extra-columns` columns of mixed types beside the prompt) are written to a Parquet file
and submitted with `prefixflow.client.submit.submit`."""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from prefixflow.bench.common import machine_info
from prefixflow.shared.process import config as cfgmod
from prefixflow.shared.wire import messages as m

HOT_PATH = ("bucket", "work", "results")
"""Subject families between the ingestor and the sink (what every prompt crosses)."""
FAMILIES = ("ingest", *HOT_PATH, "blob")
"""Families always shown (others, e.g. status or hb, appear when they carry traffic)."""


def peak_rss_mib(pid: int) -> float | None:
    """Peak resident set size (VmHWM) of a live process, MiB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, IndexError, ValueError):
        return None


# -- extra input columns -----------------------------------------------------------------

_WORDS = (
    "the of and to in is for on with as by at from that this be are was it an or which "
    "order invoice customer shipment delivered pending review quality product return refund "
    "account billing support ticket priority resolved escalated warehouse region north south "
    "east west quarterly revenue forecast contract renewal subscription premium standard"
).split()
_LABELS = ("positive", "negative", "neutral", "spam", "question", "complaint", "praise", "other")
_SOURCES = ("web", "email", "chat", "phone", "api")
_LANGS = ("en", "de", "fr", "es", "ja", "pt")


def extra_columns(n: int, num_rows: int, seed: int = 0) -> dict[str, Any]:
    """`n` input columns of realistic mixed types (pyarrow arrays), cycling through: an
    int64 id-like hash, a float score, a short string label, a ~200-char text, a bool, a
    UTC timestamp, a list of ints and a small struct."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed + 1_000_003)
    words = np.array(_WORDS)
    cols: dict[str, Any] = {}
    for k in range(n):
        kind, rep = k % 8, k // 8
        suffix = f"_{rep}" if rep else ""
        if kind == 0:
            cols[f"doc_hash{suffix}"] = pa.array(rng.integers(0, 2**63 - 1, num_rows, dtype=np.int64))
        elif kind == 1:
            cols[f"score{suffix}"] = pa.array(rng.random(num_rows))
        elif kind == 2:
            cols[f"label{suffix}"] = pa.array(np.array(_LABELS)[rng.integers(0, len(_LABELS), num_rows)].tolist())
        elif kind == 3:  # ~200 characters of words (about 30 words of 6.5 characters with the space)
            picks = words[rng.integers(0, len(words), (num_rows, 30))]
            cols[f"text{suffix}"] = pa.array([" ".join(row)[:200] for row in picks.tolist()])
        elif kind == 4:
            cols[f"flag{suffix}"] = pa.array(rng.random(num_rows) < 0.3)
        elif kind == 5:
            base = 1_700_000_000_000_000  # microseconds, late 2023
            us = base + rng.integers(0, 365 * 86_400 * 10**6, num_rows, dtype=np.int64)
            cols[f"created_at{suffix}"] = pa.array(us, type=pa.timestamp("us", tz="UTC"))
        elif kind == 6:
            lengths = rng.integers(0, 9, num_rows)
            values = rng.integers(0, 100_000, int(lengths.sum()), dtype=np.int64)
            offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            cols[f"tag_ids{suffix}"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        else:
            cols[f"meta{suffix}"] = pa.StructArray.from_arrays(
                [
                    pa.array(np.array(_SOURCES)[rng.integers(0, len(_SOURCES), num_rows)].tolist()),
                    pa.array(rng.integers(1, 500, num_rows, dtype=np.int32)),
                    pa.array(np.array(_LANGS)[rng.integers(0, len(_LANGS), num_rows)].tolist()),
                ],
                names=["source", "page", "lang"],
            )
    return cols


def write_input(path: Path, base: dict[str, Any], extra: dict[str, Any]) -> Path:
    """The bench's input as a user's Parquet file: `base` (id and prompt or
    prompt_token_ids) and the extra columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({**base, **extra}), path)
    return path


# -- wiretap -----------------------------------------------------------------------------


def family_of(subject: str) -> str:
    """`pfx.work.r0` -> `work`; a subject outside `pfx.` -> `other`."""
    parts = subject.split(".", 2)
    return parts[1] if len(parts) > 1 and parts[0] == "pfx" else "other"


def header_bytes(headers: dict[str, str] | None) -> int:
    """Size of a NATS header block as sent (`NATS/1.0\\r\\n`, `k: v\\r\\n` lines, `\\r\\n`)."""
    if not headers:
        return 0
    return 12 + sum(len(k) + len(v) + 4 for k, v in headers.items())


class Wiretap:
    """Bytes and messages published on every `pfx.>` subject, by family, seen by a core
    subscription on a connection of its own. JetStream publishes are ordinary messages, so
    the subscription sees each once, as published (deliveries to consumers go to inboxes
    and are not counted). The callback only adds lengths; its pending limits are off, so
    the client never drops a message (`lost` compares the connection's received count with
    the counted ones; a server-side slow-consumer cut would show as a reconnect)."""

    SUBJECT = "pfx.>"

    def __init__(self) -> None:
        self.msgs: dict[str, int] = {}
        self.data: dict[str, int] = {}
        self.headers: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self.counting = False

    async def start(self, url: str) -> None:
        from prefixflow.shared.bus.connection import connect

        self.nc = await connect(url, "prefixflow-bench-wiretap")
        self.sub = await self.nc.subscribe(self.SUBJECT, cb=self._on_msg, pending_msgs_limit=0, pending_bytes_limit=0)
        await self.nc.flush()
        self.base_in = self.nc.stats["in_msgs"]
        self.counting = True

    async def _on_msg(self, msg) -> None:
        if not self.counting:
            return
        fam = family_of(msg.subject)
        now = time.monotonic()
        self.msgs[fam] = self.msgs.get(fam, 0) + 1
        self.data[fam] = self.data.get(fam, 0) + len(msg.data)
        if msg.headers:
            self.headers[fam] = self.headers.get(fam, 0) + header_bytes(msg.headers)
        self.first.setdefault(fam, now)
        self.last[fam] = now

    async def stop(self) -> dict[str, Any]:
        from prefixflow.shared.bus.connection import close

        await self.nc.flush()
        for _ in range(100):  # let the callback task catch up with what the socket already read
            if self.sub.pending_msgs == 0:
                break
            await asyncio.sleep(0.05)
        self.counting = False
        received = self.nc.stats["in_msgs"] - self.base_in
        counted = sum(self.msgs.values())
        info = {"received": received, "counted": counted, "lost": max(received - counted, 0),
                "reconnects": self.nc.stats["reconnects"]}
        await close(self.nc)
        return info

    def report(self, num_prompts: int) -> dict[str, Any]:
        fams = sorted(set(self.msgs) | set(FAMILIES), key=lambda f: (f not in FAMILIES, FAMILIES.index(f) if f in FAMILIES else 0, f))
        per_family = {
            f: {
                "messages": self.msgs.get(f, 0),
                "data_bytes": self.data.get(f, 0),
                "header_bytes": self.headers.get(f, 0),
                "bytes_per_prompt": round((self.data.get(f, 0) + self.headers.get(f, 0)) / num_prompts, 1),
                "data_bytes_per_prompt": round(self.data.get(f, 0) / num_prompts, 1),
            }
            for f in fams
        }
        hot = sum(self.data.get(f, 0) + self.headers.get(f, 0) for f in HOT_PATH)
        return {
            "bytes_per_prompt": {f: v["bytes_per_prompt"] for f, v in per_family.items()},
            "hot_path_bytes_per_prompt": round(hot / num_prompts, 1),
            "subjects": per_family,
        }


# -- the bench ---------------------------------------------------------------------------


async def bench_pipeline_once(args, num_prompts: int) -> dict[str, Any]:
    import pyarrow as pa

    from prefixflow.client.submit import submit
    from prefixflow.launch.local_cluster import LocalCluster, processes
    from prefixflow.datagen.dataset import prefix_repetition, prefix_repetition_ids, shape_args
    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.prefix.tokenize import load_tokenizer

    model = str(make_model(args.model) if args.model == cfgmod.DEFAULT_MODEL else Path(args.model))
    t_data = time.monotonic()
    shape = shape_args(args) | {"num_prompts": num_prompts}  # the pipeline bench has no --output-len
    if args.pretokenized:  # the dataset's token ids, no text round trip
        _, ids = prefix_repetition_ids(load_tokenizer(model), **shape)
        base = {"id": pa.array(range(num_prompts), type=pa.int64()), "prompt_token_ids": pa.array(ids.tolist(), type=pa.list_(pa.int64()))}
    else:
        table = prefix_repetition(tokenizer_dir=model, output_len=1, **shape)
        base = {"id": table.column("id"), "prompt": table.column("prompt")}
    job = f"pipeline-{num_prompts}"
    workdir = Path(args.work_dir) / job
    shutil.rmtree(workdir, ignore_errors=True)  # a rerun must not resume the last run
    extra = extra_columns(args.extra_columns, num_prompts, args.seed)
    input_path = write_input(workdir / "input.parquet", base, extra)
    print(f"{num_prompts} prompts generated in {time.monotonic() - t_data:.1f} s ({len(extra)} extra columns: "
          f"{', '.join(extra) or '-'}; {input_path.stat().st_size / 2**20:.1f} MiB Parquet)", flush=True)
    cluster = LocalCluster(
        processes(args.replicas, engine=args.engine),
        workdir=workdir,
        env={"PFX_MODEL": model, "PFX_LOG_LEVEL": "warning", "PFX_OUT_ROOT": str(workdir.resolve())},
    )
    cluster.start()
    tap = Wiretap() if args.wiretap else None
    tap_info: dict[str, Any] = {}
    try:
        await cluster.wait_ready([f"r{i}" for i in range(args.replicas)], timeout=600)
        if tap is not None:
            await tap.start(cluster.url)
        cpu0 = {name: cpu_seconds(p.pid) for name, p in cluster.running.items()}
        t0 = time.monotonic()
        # The user's path: `prefixflow submit` on a Parquet file (read, publish, seal, wait).
        status = await submit(
            input_path, nats_url=cluster.url, job=job, out_dir=workdir / "out",
            sampling=m.SamplingSpec(max_tokens=1), progress=False, timeout=3600,
        )
        wall = time.monotonic() - t0
        if tap is not None:
            tap_info = await tap.stop()
        rss = {name: peak_rss_mib(p.pid) for name, p in cluster.running.items()}
        cpu = {name: cpu_seconds(p.pid) for name, p in cluster.running.items()}
    finally:
        cluster.stop()
    assert status.rows == num_prompts and status.errors == 0, status
    run: dict[str, Any] = {
        "num_prompts": num_prompts,
        "extra_columns": list(extra),
        "input_parquet_bytes": input_path.stat().st_size,
        "wall_seconds": round(wall, 2),
        "prompts_per_second": round(num_prompts / wall, 1),
        "peak_rss_mib": rss,
        "cpu_seconds": cpu,
    }
    # CPU spent on the job (start-up excluded): steadier than wall time on a shared machine.
    job_cpu = {n: round(c - cpu0[n], 2) for n, c in cpu.items() if c is not None and cpu0.get(n) is not None}
    run["job_cpu_seconds"] = job_cpu
    run["job_cpu_us_per_prompt"] = round(sum(job_cpu.values()) / num_prompts * 1e6, 1)
    if tap is not None:
        if "ingest" in tap.last:  # the last row published (submit() does not say)
            run["publish_seconds"] = round(tap.last["ingest"] - t0, 2)
        if "results" in tap.last:  # the last result published: not rounded up to the status poll (0.5 s)
            run["last_result_seconds"] = round(tap.last["results"] - t0, 2)
            run["prompts_per_second_last_result"] = round(num_prompts / (tap.last["results"] - t0), 1)
        run |= tap.report(num_prompts) | {"wiretap": tap_info}
    return run


def print_bytes_table(runs: list[dict[str, Any]]) -> None:
    fams = list(dict.fromkeys(f for r in runs for f in r.get("bytes_per_prompt", {})))
    if not fams:
        return
    print()
    print(f"{'prompts':>9} {'extra':>5}  bytes/prompt: " + " ".join(f"{f:>9}" for f in fams) + f" {'hot path':>9}")
    for r in runs:
        bpp = r["bytes_per_prompt"]
        print(f"{r['num_prompts']:>9} {len(r['extra_columns']):>5}  {'':14}" + " ".join(f"{bpp.get(f, 0):>9}" for f in fams)
              + f" {r['hot_path_bytes_per_prompt']:>9}")
    lost = [r["wiretap"] for r in runs if r["wiretap"].get("lost") or r["wiretap"].get("reconnects")]
    if lost:
        print(f"WARNING: the wiretap missed messages: {lost}")


def cmd_pipeline(args) -> None:
    counts = [args.num_prompts] + ([args.compare] if args.compare else [])
    runs = [asyncio.run(bench_pipeline_once(args, n)) for n in sorted(counts)]
    print()
    names = list(runs[0]["peak_rss_mib"])
    print(f"{'prompts':>9} {'wall s':>8} {'prompts/s':>10}  peak RSS MiB: " + " ".join(f"{n:>9}" for n in names))
    for r in runs:
        print(f"{r['num_prompts']:>9} {r['wall_seconds']:>8} {r['prompts_per_second']:>10}  {'':14}"
              + " ".join(f"{r['peak_rss_mib'][n]!s:>9}" for n in names))
        print(f"{'':>30}  CPU seconds:  " + " ".join(f"{r['cpu_seconds'][n]!s:>9}" for n in names))
        print(f"{'':>30}  of the job:   " + " ".join(f"{r['job_cpu_seconds'].get(n)!s:>9}" for n in names)
              + f"  ({r['job_cpu_us_per_prompt']} CPU us/prompt"
              + (f"; last result at {r['last_result_seconds']} s: {r['prompts_per_second_last_result']} prompts/s)"
                 if "last_result_seconds" in r else ")"))
    print_bytes_table(runs)
    report = {"config": {k: v for k, v in vars(args).items() if k != "fn"}, "machine": machine_info(), "runs": runs}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


def add_pipeline_parser(sub) -> None:
    p = sub.add_parser("pipeline", help="prompts/s through every service with no model, each service's peak RSS, and bytes per prompt per subject")
    p.add_argument("--engine", choices=("echo",), default="echo", help="echo: no model (measures orchestration only)")
    p.add_argument("--num-prompts", type=int, default=200_000)
    p.add_argument("--compare", type=int, default=0, help="also run this many prompts (e.g. 20000) to compare RSS")
    p.add_argument(
        "--pretokenized", action=argparse.BooleanOptionalAction, default=True,
        help="send prompt_token_ids (measures orchestration; tokenization scales with ingestors) or text",
    )
    p.add_argument(
        "--extra-columns", type=int, default=0, metavar="N",
        help="N more input columns of mixed types (int64 hash, float, label, ~200-char text, bool, timestamp, "
             "list of ints, struct; cycled) carried the way a user's Parquet columns are",
    )
    p.add_argument(
        "--wiretap", action=argparse.BooleanOptionalAction, default=True,
        help="count the bytes published on each pfx.* subject family (a core subscription in this process)",
    )
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--prefix-len", type=int, default=64, help="128-token prompts by default (64 + 64)")
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=cfgmod.DEFAULT_MODEL, help="tokenizer source")
    p.add_argument("--work-dir", default=".prefixflow/bench")
    p.add_argument("--json", help="write the report here")
    p.set_defaults(fn=cmd_pipeline)
