"""Embeddings end to end: `prefixflow submit --task embed` of an OpenAI Batch file of
`/v1/embeddings` requests to a cluster of a vLLM pooling engine (`EMBED_CLUSTER`, shared
with the batch API's embeddings test; `run --task embed` starting pooling engines itself
is tested on echo engines in tests/nats/test_large_rows.py) writes an `embedding` column
of the model's hidden size, identical vectors for identical inputs, and `_batch/output.jsonl` lines that
validate as `CreateEmbeddingResponse`; bucketing and
routing still apply (documents with a shared preamble: the prefix-cache hit rate is
printed). A generate cluster refuses an embed job with a clear error."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.make_model import _synthetic_corpus
from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HIDDEN = 256  # the local model's hidden size
EMBED_CLUSTER = {"engine": "vllm", "replicas": 1, "env": {"PFX_TASK": "embed"}}
"""One vLLM pooling replica (`PFX_TASK=embed`): `clusters.get(**EMBED_CLUSTER)`. One is
enough for what these tests assert (vectors, output lines, refusals; routing between
replicas is the same code for every task and is asserted on generate clusters), and a
second engine is ~25 CPU-s of start-up on a 2-core machine."""


def test_embed_job_of_a_batch_file_through_submit(tiny_model, tmp_path, clusters):
    cluster = clusters.get(**EMBED_CLUSTER)
    rng = random.Random(2)
    sentences = _synthetic_corpus(7)
    preambles = [" ".join(rng.sample(sentences, 25)) for _ in range(4)]
    rows = [{"id": f"p{p}-{i}", "prompt": preambles[p] + " " + rng.choice(sentences)} for p in range(4) for i in range(16)]
    rows += [{"id": "twin-a", "prompt": "the same text"}, {"id": "twin-b", "prompt": "the same text"}]
    rng.shuffle(rows)
    # As an OpenAI Batch file of /v1/embeddings requests (plus one bad line).
    data = tmp_path / "docs.jsonl"
    lines = [json.dumps({"custom_id": r["id"], "method": "POST", "url": "/v1/embeddings",
                         "body": {"model": "tiny", "input": r["prompt"]}}) for r in rows]
    lines.append(json.dumps({"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}))
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    res = run_cli("submit", str(data), "--out", str(out), "--task", "embed", "--nats", cluster.url, "--no-progress",
                  "--timeout", "600", timeout=850)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
    table = pq.read_table(out)
    kind = table.schema.field("embedding").type
    assert pa.types.is_fixed_size_list(kind) and kind.list_size == HIDDEN and kind.value_type == pa.float32()
    got = {r["id"]: r for r in table.to_pylist()}
    assert len(got) == len(rows) and all(r["error"] is None for r in got.values())
    assert all(len(r["embedding"]) == HIDDEN for r in got.values())
    assert got["twin-a"]["embedding"] == got["twin-b"]["embedding"]
    assert got["p0-0"]["embedding"] != got["p0-1"]["embedding"]
    from openai.types import CreateEmbeddingResponse

    ok = [json.loads(x) for x in (out / "_batch" / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "_batch" / "errors.jsonl").read_text().splitlines()]
    assert len(ok) == len(rows) and [e["custom_id"] for e in errors] == ["chat"]
    for o in ok:
        body = CreateEmbeddingResponse.model_validate(o["response"]["body"])
        assert body.data[0].embedding == pytest.approx(got[o["custom_id"]]["embedding"], rel=1e-6)
    summary = json.loads((out / "_summary.json").read_text())
    print(f"\nembed job: prefix-cache hit rate {summary['prefix_cache_hit_rate']} "
          f"({summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens)")


def test_generate_cluster_refuses_an_embed_job(vllm_cluster, tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text('{"id": 1, "prompt": "x"}\n')
    res = run_cli("submit", str(data), "--out", str(tmp_path / "out"), "--nats", vllm_cluster.url, "--job", "e2e-embed-refused",
                  "--task", "embed", "--no-progress", "--timeout", "120")
    assert res.returncode == 1
    assert "job e2e-embed-refused failed: job task 'embed', but this cluster's engines generate" in res.stderr + res.stdout
