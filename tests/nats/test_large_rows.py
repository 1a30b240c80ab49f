"""No message is too large: rows whose results (or prompts) are far over nats-server's
`max_payload` go through `prefixflow run` whole, with no error row and no process
restarted (issue #22: one row asking for `logprobs: 20` on a long output used to crash
the engine-worker with `MaxPayloadError` forever).

One generate run holds every kind of large row: `logprobs: 20` on 3,000 generated tokens
(~2 MB of result each: stored by reference in the blob store), `n: 16` completions of
1,000 tokens (~80 KB each, batches of them over 1 MiB), and ~2,900-token prompts (prompt
and work batches over 1 MiB). One embed run has 8,192-float embeddings (~74 KB each).
The echo engine stands in for vLLM: it gives the same fields at the same sizes
(`prefixflow/services/engine_worker/engines/echo.py`).
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import run_cli

pytestmark = [pytest.mark.nats, pytest.mark.timeout(420)]

LOGPROB_ROWS, N_ROWS, LONG_ROWS, EMBED_ROWS = 4, 48, 240, 64


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def start_run(tmp_path: Path, name: str, rows: list[dict], *args: str, env: dict[str, str] | None = None):
    data, out, workdir = tmp_path / f"{name}.jsonl", tmp_path / f"out-{name}", tmp_path / f"cluster-{name}"
    write_jsonl(data, rows)
    res = run_cli("run", str(data), "--out", str(out), "--engine", "echo", "--replicas", "2", "--workdir", str(workdir),
                  "--job", name, "--no-progress", "--timeout", "240", *args, timeout=360, env=env)
    return res, out, workdir


def check_cluster(res: subprocess.CompletedProcess, workdir: Path) -> str:
    """The run succeeded, no process was restarted; returns every service's log."""
    assert res.returncode == 0, res.stdout + res.stderr
    pids = json.loads((workdir / "pids.json").read_text())
    restarts = {name: p["restarts"] for name, p in pids["processes"].items()}
    assert restarts and all(n == 0 for n in restarts.values()), restarts
    logs = "".join(p.read_text(errors="replace") for p in sorted((workdir / "logs").glob("*")) if p.is_file())
    assert "MaxPayload" not in logs and "Traceback" not in logs
    return logs


def read_rows(out: Path) -> dict:
    return {r["id"]: r for r in pq.read_table(out).to_pylist()}


WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "zeta", "theta", "lambda"]


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def test_large_generate_rows_complete_whole_with_no_restart(tmp_path, tiny_model):
    rng = random.Random(22)
    rows = []
    for i in range(LOGPROB_ROWS):
        rows.append({"id": f"lp{i}", "prompt": f"row lp{i}: {words(rng, 20)}",
                     "sampling": {"logprobs": 20, "max_tokens": 3000, "min_tokens": 3000}})
    for i in range(N_ROWS):
        rows.append({"id": f"n{i}", "prompt": f"row n{i}: {words(rng, 20)}",
                     "sampling": {"n": 16, "max_tokens": 1000, "min_tokens": 1000}})
    prefixes = [words(rng, 700) for _ in range(3)]
    for i in range(LONG_ROWS):  # ~2,900 tokens, in groups sharing ~2,000: long bucket keys too
        rows.append({"id": f"long{i}", "prompt": f"{prefixes[i % 3]} {words(rng, 300)}"})
    res, out, workdir = start_run(tmp_path, "large-gen", rows, "--model", str(tiny_model), "--max-tokens", "64")
    logs = check_cluster(res, workdir)
    assert "result stored by reference" in logs, "the logprobs rows went through the blob store"

    got = read_rows(out)
    assert set(got) == {r["id"] for r in rows}
    assert [i for i, r in got.items() if r["error"] is not None] == []
    for i in range(LOGPROB_ROWS):
        r = got[f"lp{i}"]
        assert r["output_tokens"] == 3000 and len(r["output"].split()) == 3000, i
        assert len(r["logprobs"]) == 3000 and all(len(t["top"]) == 21 for t in r["logprobs"]), i
    for i in range(N_ROWS):
        r = got[f"n{i}"]
        assert len(r["outputs"]) == 16 and all(len(o.split()) == 1000 for o in r["outputs"]), i
        assert r["output"] == r["outputs"][0] and r["output_tokens"] == 16_000, i
    for i in range(LONG_ROWS):
        r = got[f"long{i}"]
        assert r["prompt_tokens"] > 2500 and r["output_tokens"] == 64, i
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == len(rows) and summary["errors"] == 0


def test_wide_embeddings_complete_whole_with_no_restart(tmp_path, tiny_model):
    rng = random.Random(8192)
    rows = [{"id": i, "prompt": f"document {i}: {words(rng, 30)}"} for i in range(EMBED_ROWS)]
    res, out, workdir = start_run(tmp_path, "large-embed", rows, "--model", str(tiny_model), "--task", "embed",
                                  env={"PFX_ECHO_EMBED_DIM": "8192"})
    check_cluster(res, workdir)
    got = read_rows(out)
    assert set(got) == set(range(EMBED_ROWS))
    assert [i for i, r in got.items() if r["error"] is not None] == []
    assert all(len(r["embedding"]) == 8192 for r in got.values())
    assert json.loads((out / "_summary.json").read_text())["errors"] == 0

