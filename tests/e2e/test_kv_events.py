"""KV-cache events from real vLLM engines reach the router (`--kv-events`): the engines
publish `BlockStored`/`BlockRemoved` (ZMQ), the engine-workers translate them into block
keys and send them on `pfx.cache.<replica>`, and the router indexes what each replica
holds and routes by it.

Both tests share one cluster (`special_vllm_cluster`: two replicas with KV events, 48 KV
blocks of 128 tokens each, a 96-prompt bucketer buffer; the LoRA tests run on it before
them, the engine-kill tests after them); each empties the prefix caches first and
reads only the router log lines written during it.

A KV cache smaller than the prefixes (48 blocks per replica for 24 prefixes of 256 tokens
and their suffixes: blocks are evicted, so removal events flow too). Asserted: every row
once and ok, both replicas reported as sending events in the router's fleet log with a
non-empty index and no sequence gap, and prefix-cache hits as the job's prefixes repeat.

Routing by KV events on hierarchical prefixes, where the history is most wrong: the hit
rate, and how often the history would have erred (the same job routed by the history is a
benchmark: docs/benchmarks.md "KV events or history")."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import write_prefix_repetition, write_shape
from tests.conftest import reset_prefix_caches, run_cli, special_vllm_cluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

N = 320


@pytest.fixture
def kv_cluster(clusters, tiny_model):
    cluster = special_vllm_cluster(clusters, tiny_model)
    asyncio.run(reset_prefix_caches(cluster.url, ["r0", "r1"]))
    return cluster


def router_log_size(cluster) -> int:
    path = cluster.workdir / "logs" / "router.log"
    return path.stat().st_size if path.exists() else 0


def test_router_indexes_the_blocks_the_engines_report(tmp_path, tiny_model, kv_cluster):
    data = tmp_path / "prompts.parquet"
    write_prefix_repetition(data, tokenizer_dir=tiny_model, num_prompts=N, prefix_len=256, suffix_len=64,
                            num_prefixes=24, seed=5)
    out = tmp_path / "out"
    since = router_log_size(kv_cluster)
    res = run_cli("submit", str(data), "--out", str(out), "--nats", kv_cluster.url, "--max-tokens", "48", "--job", "kv",
                  "--no-progress", "--timeout", "500", timeout=550)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    table = pq.read_table(out)
    assert sorted(table.column("id").to_pylist()) == list(range(N))
    assert table.column("error").null_count == N
    fleet = fleet_log(kv_cluster.workdir, since)
    # The router logs its fleet every 5 s; the job lasts long enough for a few mid-job.
    during = [e for e in fleet if e["live"] == ["r0", "r1"] and e["routed"]]
    assert during, fleet
    assert all(e["precise"] == ["r0", "r1"] and e["cache_gaps"] == 0 for e in during), during
    assert max(e["cache_entries"] for e in during) > 0, during
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["prefix_cache_hit_rate"] > 0.2, summary


def fleet_log(workdir, since: int = 0, until: int | None = None) -> list[dict]:
    """The router's fleet lines, from byte `since` of its log (to byte `until`)."""
    entries = []
    with open(workdir / "logs" / "router.log", "rb") as f:
        f.seek(since)
        text = f.read(-1 if until is None else until - since).decode(errors="replace")
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == "fleet":
            entries.append(entry)
    return entries


@pytest.mark.timeout(700)
def test_kv_event_routing_on_hierarchical_prefixes_where_the_history_errs(tmp_path, tiny_model, kv_cluster):
    """Where the history is most wrong: hierarchical prefixes (a 4-block system prompt every
    row shares, then one of 28 one-block few-shot groups, then a question), 48 KV blocks per
    replica (blocks are evicted), and every group routed again after a while: two jobs over
    the same groups, one after the other, submitted with `prefixflow submit` to a cluster
    that keeps its caches between them. The history, sized like the cache, counts the shared
    system prompt once per group it routed (5 blocks an entry: ~9 of a replica's ~14 groups),
    while the cache holds it once (4 + 14 blocks and the requests in flight): by the second
    job the history has forgotten groups the caches still hold, by construction. (With a
    2-block system prompt and 2-block groups the two models' sizes were close, and whether
    the history erred depended on the machine's timing: 2 of 65 decisions in one CI run.)

    The cluster routes by the engines' KV events and measures how often the history would
    have been wrong about what a replica holds. Asserted: the history is measurably wrong
    (3 decisions or more; 16 of 94 here on a quiet machine, 22 of 98 with two cores kept
    busy beside it) and routing by the events stays near the ideal hit rate (a broken
    precise model would not). The same job routed by the history, beside it: a benchmark
    (docs/benchmarks.md "KV events or history"; on two replicas the two are within a
    point or two)."""
    data = tmp_path / "hier.parquet"
    table = write_shape(data, "hierarchical", tokenizer_dir=tiny_model, block_size=128, num_prompts=1024,
                        num_groups=28, system_len=512, group_len=128, output_len=32)
    ideal = json.loads(table.schema.metadata[b"prefixflow.dataset"])["ideal_hit_rate"]["128"]["exact"]
    halves = [tmp_path / "first.parquet", tmp_path / "second.parquet"]
    for i, path in enumerate(halves):  # consecutive halves of the shuffled table: every group in both
        pq.write_table(table.slice(512 * i, 512), path)
    since = router_log_size(kv_cluster)
    tokens = [0, 0]  # prompt, cached
    for i, path in enumerate(halves):
        out = tmp_path / f"out-{i}"
        res = run_cli("submit", str(path), "--out", str(out), "--nats", kv_cluster.url, "--job", f"hier-{i}",
                      "--no-progress", "--timeout", "500")
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        rows = pq.read_table(out, columns=["id", "error"])
        assert sorted(rows.column("id").to_pylist()) == list(range(512 * i, 512 * (i + 1)))
        assert rows.column("error").null_count == 512
        summary = json.loads((out / "_summary.json").read_text())
        tokens[0] += summary["prompt_tokens"]
        tokens[1] += summary["cached_tokens"]
    hit = tokens[1] / tokens[0]  # over both jobs
    # The router's history checks are counted since it started: this test's are the growth
    # over its own log lines.
    def latest(entries: list[dict]) -> dict:
        return max((e.get("history_checks") or {} for e in entries), key=lambda c: c.get("decisions", 0), default={})

    start, end = latest(fleet_log(kv_cluster.workdir, 0, until=since)), latest(fleet_log(kv_cluster.workdir))
    checks = {k: v - start.get(k, 0) for k, v in end.items() if isinstance(v, (int, float))}
    print(f"\nideal {ideal:.1%}; hit rate by KV events {hit:.1%}; history checks: {checks}")
    # How often it errs depends on how the groups leave the bucketer; that it errs does not
    # (the sizes above): asserted is that it measurably errs.
    assert checks["decisions"] > 20 and checks["wrong"] >= 3, checks
    assert hit >= 0.85 * ideal, (hit, ideal)
