"""KV-cache events from real vLLM engines reach the router (`--kv-events`), through
`prefixflow run` as a user starts it: the engines publish `BlockStored`/`BlockRemoved`
(ZMQ), the engine-workers translate them into block keys and send them on
`pfx.cache.<replica>`, and the router indexes what each replica holds and routes by it.

A KV cache smaller than the prefixes (40 blocks of 128 tokens per replica for 24 prefixes
of 256 tokens: blocks are evicted, so removal events flow too). Asserted: every row once and ok, both replicas reported as sending events in
the router's fleet log with a non-empty index and no sequence gap, and prefix-cache hits
as the job's prefixes repeat."""

from __future__ import annotations

import json
import os
import subprocess

import pyarrow.parquet as pq
import pytest

from cli.dataset import write_prefix_repetition
from tests.conftest import REPO, VENV_BIN

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

N = 320


def test_router_indexes_the_blocks_the_engines_report(tmp_path, tiny_model):
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=256, suffix_len=64,
                            num_prefixes=24, seed=5)
    out, workdir = tmp_path / "out", tmp_path / "cluster"
    proc = subprocess.run(
        [str(VENV_BIN / "prefixflow"), "run", str(data), "--out", str(out), "--model", str(tiny_model), "--replicas", "2",
         "--max-tokens", "48", "--kv-cache-blocks", "40", "--no-progress", "--job", "kv", "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PFX_KV_EVENTS": "1"}, timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(N))
    assert table.column("error").null_count == N
    fleet = []
    for line in (workdir / "logs" / "router.log").read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "fleet":
            fleet.append(entry)
    # The router logs its fleet every 5 s; the job lasts long enough for a few mid-job.
    during = [e for e in fleet if e["live"] == ["r0", "r1"] and e["routed"]]
    assert during, fleet
    assert all(e["precise"] == ["r0", "r1"] and e["cache_gaps"] == 0 for e in during), during
    assert max(e["cache_entries"] for e in during) > 0, during
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["prefix_cache_hit_rate"] > 0.2, summary
