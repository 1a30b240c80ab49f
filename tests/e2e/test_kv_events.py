"""KV-cache events from real vLLM engines reach the router (`--kv-events`), through
`prefixflow run` as a user starts it: the engines publish `BlockStored`/`BlockRemoved`
(ZMQ), the engine-workers translate them into block keys and send them on
`pfx.cache.<replica>`, and the router indexes what each replica holds and routes by it.

A KV cache smaller than the prefixes (30 blocks of 128 tokens per replica for 24 prefixes
of 256 tokens: blocks are evicted, so removal events flow too; 3,840 tokens, less than the
model's 4,096-token context: the engines start with the context vLLM fits to the cache). Asserted: every row once and ok, both replicas reported as sending events in
the router's fleet log with a non-empty index and no sequence gap, and prefix-cache hits
as the job's prefixes repeat.

Routing by KV events on hierarchical prefixes, where the history is most wrong: the hit
rate, and how often the history would have erred (the same job routed by the history is a
benchmark: docs/benchmarks.md "KV events or history")."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess

import pyarrow.parquet as pq
import pytest

from datagen.dataset import write_prefix_repetition, write_shape
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
         "--max-tokens", "48", "--kv-cache-blocks", "30", "--no-progress", "--job", "kv", "--workdir", str(workdir)],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "PFX_KV_EVENTS": "1"}, timeout=500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(N))
    assert table.column("error").null_count == N
    fleet = fleet_log(workdir)
    # The router logs its fleet every 5 s; the job lasts long enough for a few mid-job.
    during = [e for e in fleet if e["live"] == ["r0", "r1"] and e["routed"]]
    assert during, fleet
    assert all(e["precise"] == ["r0", "r1"] and e["cache_gaps"] == 0 for e in during), during
    assert max(e["cache_entries"] for e in during) > 0, during
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["prefix_cache_hit_rate"] > 0.2, summary


def fleet_log(workdir) -> list[dict]:
    entries = []
    for line in (workdir / "logs" / "router.log").read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "fleet":
            entries.append(entry)
    return entries


@pytest.mark.timeout(700)
def test_kv_event_routing_on_hierarchical_prefixes_where_the_history_errs(tmp_path, tiny_model):
    """Where the history is most wrong: hierarchical prefixes (a system prompt every row
    shares, then one of 28 few-shot groups, then a question), 48 KV blocks per replica
    (blocks are evicted), and every group routed again after a while: two jobs over the
    same groups, one after the other, submitted with `prefixflow submit` to a cluster that
    keeps its caches between them. The history, sized like the cache, counts the shared
    system prompt once per group it routed, so by the second job it has forgotten groups
    the caches still hold. (With one job the groups mostly leave the bucketer whole and
    are routed once: whether the history erred depended on the machine's timing.)

    The cluster routes by the engines' KV events and measures how often the history would
    have been wrong about what a replica holds. Asserted: the history is measurably wrong
    (3 decisions or more) and routing by the events stays near the ideal hit rate (a broken
    precise model would not). The same job routed by the history, beside it: a benchmark
    (docs/benchmarks.md "KV events or history"; on two replicas the two are within a
    point or two)."""
    from launch.local_cluster import LocalCluster, processes
    from tests.conftest import run_cli, wait_replicas_ready

    data = tmp_path / "hier.parquet"
    table = write_shape(data, "hierarchical", tokenizer_dir=tiny_model, block_size=128, num_prompts=1024,
                        num_groups=28, output_len=32)
    ideal = json.loads(table.schema.metadata[b"prefixflow.dataset"])["ideal_hit_rate"]["128"]["exact"]
    halves = [tmp_path / "first.parquet", tmp_path / "second.parquet"]
    for i, path in enumerate(halves):  # consecutive halves of the shuffled table: every group in both
        pq.write_table(table.slice(512 * i, 512), path)
    workdir = tmp_path / "cluster"
    cluster = LocalCluster(
        processes(2, engine="vllm", extra_engine_args=["--kv-cache-blocks", "48"]), workdir=workdir,
        env={"PFX_MODEL": str(tiny_model), "PFX_KV_EVENTS": "1", "PFX_BUFFER_PROMPTS": "96"},
    )
    cluster.start()
    tokens = [0, 0]  # prompt, cached
    try:
        asyncio.run(wait_replicas_ready(cluster.url, ["r0", "r1"], 300, cluster.check_alive))
        for i, path in enumerate(halves):
            out = tmp_path / f"out-{i}"
            res = run_cli("submit", str(path), "--out", str(out), "--nats", cluster.url, "--job", f"hier-{i}",
                          "--no-progress", "--timeout", "500")
            assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
            rows = pq.read_table(out, columns=["id", "error"])
            assert sorted(rows.column("id").to_pylist()) == list(range(512 * i, 512 * (i + 1)))
            assert rows.column("error").null_count == 512
            summary = json.loads((out / "_summary.json").read_text())
            tokens[0] += summary["prompt_tokens"]
            tokens[1] += summary["cached_tokens"]
    finally:
        cluster.stop()
    hit = tokens[1] / tokens[0]  # over both jobs
    checks = max((e.get("history_checks") or {} for e in fleet_log(workdir)), key=lambda c: c.get("decisions", 0))
    print(f"\nideal {ideal:.1%}; hit rate by KV events {hit:.1%}; history checks: {checks}")
    # How often it errs depends on how the groups leave the bucketer (49 of 111 alone, 7 of 58
    # in the full suite on a loaded machine): asserted is that it measurably errs.
    assert checks["decisions"] > 20 and checks["wrong"] >= 3, checks
    assert hit >= 0.85 * ideal, (hit, ideal)
