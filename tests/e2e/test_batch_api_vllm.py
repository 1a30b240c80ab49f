"""The OpenAI Batch API on real vLLM (issue #24): `honcho start` on the Procfile runs
`prefixflow serve api` beside the services (the `vllm_cluster` fixture); the real `openai`
client uploads a chat batch with bad lines and a completions batch, polls them to
`completed`, reads the output and error files and validates them with openai's own
types, lists its batches; a third batch is cancelled mid-run and keeps its results."""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{cluster.env['PFX_PORT']}/v1", max_retries=2)


def upload(c: openai.OpenAI, path: Path, lines: list) -> str:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return c.files.create(file=path.open("rb"), purpose="batch").id


def finished(c: openai.OpenAI, bid: str, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while (b := c.batches.retrieve(bid)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, b
        time.sleep(0.5)
    return b


def lines(c: openai.OpenAI, fid: str | None) -> list[dict]:
    return [json.loads(x) for x in c.files.content(fid).text.splitlines() if x.strip()] if fid else []


def test_openai_client_runs_batches_on_vllm(vllm_cluster, tiny_model, tmp_path):
    c = client(vllm_cluster)
    deadline = time.monotonic() + 60
    while True:  # the API process comes up with the others
        try:
            c.batches.list()
            break
        except openai.APIConnectionError:
            assert time.monotonic() < deadline, vllm_cluster.tail()
            time.sleep(0.5)
    model = tiny_model.name
    chat = [{"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"model": model, "messages": [{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": f"Question {i}?"}], "max_tokens": 6}}
            for i in range(12)]
    bad = ["not json", {"custom_id": "wrong-model", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}}]
    chat_batch = c.batches.create(input_file_id=upload(c, tmp_path / "chat.jsonl", chat + bad),
                                  endpoint="/v1/chat/completions", completion_window="24h")
    cmpl = [{"custom_id": f"cmpl-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"Once upon a time {i}", "max_tokens": 5}} for i in range(8)]
    cmpl_batch = c.batches.create(input_file_id=upload(c, tmp_path / "cmpl.jsonl", cmpl),
                                  endpoint="/v1/completions", completion_window="24h")

    done = finished(c, chat_batch.id)
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (12, 2), done
    out = lines(c, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in chat)
    for x in out:
        body = ChatCompletion.model_validate(x["response"]["body"])
        assert body.usage.prompt_tokens > 0 and body.usage.completion_tokens > 0
    errors = lines(c, done.error_file_id)
    assert sorted(str(x["custom_id"]) for x in errors) == ["None", "wrong-model"]

    done = finished(c, cmpl_batch.id)
    assert done.status == "completed" and done.request_counts.completed == 8, done
    for x in lines(c, done.output_file_id):
        Completion.model_validate(x["response"]["body"])
    assert done.error_file_id is None

    # Cancelled mid-run: the results written stay, the rest are batch_cancelled lines.
    n = 3000
    long = [{"custom_id": f"long-{i}", "method": "POST", "url": "/v1/completions",
             "body": {"model": model, "prompt": f"Count to {i}:", "max_tokens": 32, "min_tokens": 32}} for i in range(n)]
    big = c.batches.create(input_file_id=upload(c, tmp_path / "long.jsonl", long), endpoint="/v1/completions",
                           completion_window="24h")
    deadline = time.monotonic() + 300
    while c.batches.retrieve(big.id).request_counts.completed < 20:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    c.batches.cancel(big.id)
    done = finished(c, big.id)
    assert done.status == "cancelled", done
    out, errors = lines(c, done.output_file_id), lines(c, done.error_file_id)
    assert 20 <= len(out) < n and {x["response"] is None and x["error"]["code"] for x in errors} == {"batch_cancelled"}
    assert len({x["custom_id"] for x in out + errors}) == n
    assert {chat_batch.id, cmpl_batch.id, big.id} <= {b.id for b in c.batches.list(limit=2)}  # pages through


def test_an_embeddings_batch_on_pooling_engines(tiny_model, tmp_path, clusters):
    """`/v1/embeddings` through the API on a cluster of a vLLM pooling engine (`PFX_TASK=embed`,
    the one tests/e2e/test_embeddings.py shares): every response validates as openai's
    `CreateEmbeddingResponse`, identical inputs get identical vectors, and a chat batch is
    refused there (400)."""
    import signal

    from openai.types import CreateEmbeddingResponse

    from prefixflow.launch.local_cluster import free_port
    from tests.conftest import start_api
    from tests.e2e.test_embeddings import EMBED_CLUSTER

    cluster = clusters.get(**EMBED_CLUSTER)
    env = {"PFX_MODEL": str(tiny_model), "PFX_TASK": "embed"}
    port = free_port()
    log = tmp_path / "api.log"
    api = start_api({**env, "PFX_NATS_URL": cluster.url, "PFX_PORT": str(port)}, log)
    try:
        c = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=2)
        texts = [f"document {i % 5} about prefixes" for i in range(10)]
        reqs = [{"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": tiny_model.name, "input": t}} for i, t in enumerate(texts)]
        fid = upload(c, tmp_path / "embed.jsonl", reqs)
        with pytest.raises(openai.BadRequestError):
            c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
        done = finished(c, c.batches.create(input_file_id=fid, endpoint="/v1/embeddings", completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 10, (done, log.read_text()[-2000:])
        vectors = {}
        for x in lines(c, done.output_file_id):
            body = CreateEmbeddingResponse.model_validate(x["response"]["body"])
            vectors[x["custom_id"]] = body.data[0].embedding
        assert len(vectors) == 10 and all(len(v) == 256 for v in vectors.values())
        assert vectors["e0"] == pytest.approx(vectors["e5"], rel=1e-6) and vectors["e0"] != vectors["e1"]
    finally:
        api.send_signal(signal.SIGTERM)
        api.wait(20)
