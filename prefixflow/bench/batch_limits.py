"""`prefixflow bench batch-limits`: a batch input at OpenAI's limits (50,000 lines, ~200 MB,
every line bad) through the batch API, while a second tenant keeps using the API.

It starts its own nats-server and `prefixflow serve api` (no engines: a batch whose every
line is bad never reaches them), uploads the file as tenant `alice`, creates the batch
and, until the batch is final, has tenant `bob` list his batches and upload a small file
in a loop. Reports the batch's end (status, error file lines: every line must have one),
the time it took, bob's request latencies, and the API process's peak RSS (`VmHWM`;
target < 300 MiB: the input is parsed streaming, its error lines go to a file).

    prefixflow bench batch-limits                       # 50,000 lines of ~4 KB
    prefixflow bench batch-limits --lines 5000 --line-bytes 512   # a quick look

`run_against(url, ...)` is the part the nats-tier test drives with a smaller file
against an API it started (tests/nats/test_batch_conformance.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from prefixflow.shared.outcomes import CommandError, Exit

RSS_TARGET_MIB = 300


def write_bad_lines(path: Path, lines: int, line_bytes: int) -> Path:
    """`lines` request lines of about `line_bytes` bytes each, every one bad (method GET),
    written as they are generated."""
    with path.open("w") as f:
        for i in range(lines):
            head = f'{{"custom_id": "bad-{i}", "method": "GET", "url": "/v1/chat/completions", "body": {{"pad": "'
            f.write(head + "x" * max(line_bytes - len(head) - 4, 0) + '"}}\n')
    return path


def peak_rss_mib(pid: int) -> float | None:
    """A process's peak resident set (VmHWM), MiB (None: not readable)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def run_against(base_url: str, path: Path, lines: int, alice_key: str = "key-a", bob_key: str = "key-b",
                timeout: float = 1800) -> dict[str, Any]:
    """Run the batch of `path` as alice while bob uses the API; the figures (see the
    module docstring). Raises AssertionError when bob is refused or the batch does not end."""
    import openai

    alice = openai.OpenAI(api_key=alice_key, base_url=base_url, max_retries=0, timeout=600)
    bob = openai.OpenAI(api_key=bob_key, base_url=base_url, max_retries=0, timeout=60)
    latencies: list[float] = []
    stop = threading.Event()
    errors: list[str] = []

    def other_tenant() -> None:
        small = path.with_name("bob.jsonl")
        small.write_text('{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n')
        while not stop.is_set():
            start = time.monotonic()
            try:
                bob.batches.list(limit=5)
                bob.files.delete(bob.files.create(file=small.open("rb"), purpose="batch").id)
            except openai.OpenAIError as exc:  # counted: the check below fails on any
                errors.append(repr(exc))
            latencies.append(time.monotonic() - start)
            stop.wait(0.2)

    started = time.monotonic()
    fid = alice.files.create(file=path.open("rb"), purpose="batch").id
    uploaded = time.monotonic() - started
    batch = alice.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
    worker = threading.Thread(target=other_tenant, daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout
    try:
        while (batch := alice.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled", "expired"):
            assert time.monotonic() < deadline, f"batch not final after {timeout} s: {batch.status}"
            time.sleep(0.5)
    finally:
        stop.set()
        worker.join(30)
    took = time.monotonic() - started
    error_lines = 0
    if batch.error_file_id:
        with alice.files.with_streaming_response.content(batch.error_file_id) as response:
            for chunk in response.iter_bytes():
                error_lines += chunk.count(b"\n")
    ordered = sorted(latencies)
    return {
        "lines": lines, "bytes": path.stat().st_size, "status": batch.status, "error_lines": error_lines,
        "complete": error_lines == lines, "upload_seconds": round(uploaded, 2), "seconds": round(took, 2),
        "other_tenant_requests": len(latencies), "other_tenant_errors": errors[:5],
        "other_tenant_p50_seconds": round(ordered[len(ordered) // 2], 3) if ordered else None,
        "other_tenant_max_seconds": round(ordered[-1], 3) if ordered else None,
    }


def cmd_batch_limits(args) -> None:
    from prefixflow.launch.local_cluster import free_port

    venv_bin = Path(sys.executable).parent
    work = Path(args.out_dir or tempfile.mkdtemp(prefix="pfx-bench-limits-"))
    work.mkdir(parents=True, exist_ok=True)
    path = write_bad_lines(work / "bad.jsonl", args.lines, args.line_bytes)
    nats_port, api_port = free_port(), free_port()
    nats = subprocess.Popen([str(venv_bin / "nats-server"), "--jetstream", "--store_dir", str(work / "nats"),
                             "--addr", "127.0.0.1", "--port", str(nats_port)], stderr=subprocess.DEVNULL)
    env = {**os.environ, "PFX_NATS_URL": f"nats://127.0.0.1:{nats_port}", "PFX_API_KEYS": "alice:key-a,bob:key-b",
           "PFX_PORT": str(api_port), "PFX_LOG_FORMAT": "json"}
    log = (work / "api.log").open("w")
    api = subprocess.Popen([str(venv_bin / "prefixflow"), "serve", "api"], env=env, stdout=log,
                           stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while '"api ready"' not in (work / "api.log").read_text():
            if api.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"the API did not start: {(work / 'api.log').read_text()[-2000:]}", Exit.FAILED)
            time.sleep(0.2)
        result = run_against(f"http://127.0.0.1:{api_port}/v1", path, args.lines)
        result["api_peak_rss_mib"] = round(peak_rss_mib(api.pid) or 0.0, 1)
        result["rss_target_mib"] = RSS_TARGET_MIB
        result["rss_ok"] = result["api_peak_rss_mib"] < RSS_TARGET_MIB
    finally:
        for proc in (api, nats):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        log.close()
    print(json.dumps(result, indent=2))
    if args.result:
        Path(args.result).write_text(json.dumps(result, indent=2) + "\n")
    if not args.out_dir:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if result["complete"] and result["rss_ok"] and not result["other_tenant_errors"] else 1)


def add_batch_limits_parser(sub) -> None:
    p = sub.add_parser("batch-limits", help="a batch file at OpenAI's limits, every line bad, through the batch API "
                                            "while another tenant uses it: error file, latency, the API's peak RSS")
    p.add_argument("--lines", type=int, default=50_000, help="request lines (default 50000, OpenAI's limit)")
    p.add_argument("--line-bytes", type=int, default=4100, help="bytes per line (default 4100: ~200 MB in all)")
    p.add_argument("--out-dir", default=None, help="keep the input, the nats store and api.log here")
    p.add_argument("--result", default=None, help="also write the JSON result here")
    p.set_defaults(fn=cmd_batch_limits)
