"""Embeddings end to end: `prefixflow run --task embed` on an OpenAI Batch file of
`/v1/embeddings` requests starts vLLM pooling engines (its own cluster: a different
engine mode than the session cluster), writes an `embedding` column of the model's hidden
size, identical vectors for identical inputs, and `_batch/output.jsonl` lines that
validate as `CreateEmbeddingResponse`; bucketing and
routing still apply (documents with a shared preamble: the prefix-cache hit rate is
printed). A generate cluster refuses an embed job with a clear error."""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.make_model import _synthetic_corpus
from tests.conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

HIDDEN = 256  # the local model's hidden size


def test_embed_job_through_run(tiny_model, tmp_path):
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
    res = run_cli("run", str(data), "--out", str(out), "--task", "embed", "--replicas", "2", "--model", str(tiny_model),
                  "--no-progress", "--timeout", "600", "--workdir", str(tmp_path / "cluster"), timeout=850)
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
