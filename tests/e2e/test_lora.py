"""LoRA adapters per row (issue #27) on real vLLM with three random adapters of the local
model (`prefixflow make-model --lora`):

Both tests share one cluster of two replicas serving the adapters (`--lora-modules ...
--max-loras 2`; `special_vllm_cluster`, which the KV-events and engine-kill tests use after
them; its prefix caches emptied before each test):

- through `prefixflow submit`: an OpenAI batch file whose lines name the adapters, the
  base model (by its name) and an unknown adapter by `model`: greedy outputs of one prompt differ by adapter and
  are the same for every copy of it under one adapter; the unknown adapter is an error
  line; each (adapter, shared prefix) group reaches its ideal hit rate and no more (an
  adapter's cache is its own: the same text under another adapter is a miss);
- through the OpenAI Batch API (`prefixflow serve api --lora-adapters`): lines naming the
  adapters are answered in their names, one naming neither the model nor an adapter is
  an error line; and a Parquet file with a `lora` column submitted twice while the router
  deals round-robin: each adapter ran on both replicas with equal outputs."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
from collections import defaultdict

import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from prefixflow.datagen.make_model import _synthetic_corpus
from tests.conftest import LORA_ADAPTERS, reset_prefix_caches, run_cli, set_policy, special_vllm_cluster, start_api
from tests.e2e.test_batch_api_vllm import finished, lines, upload

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ADAPTERS = LORA_ADAPTERS
BLOCK = 128  # the CPU engine's KV block
PROBE = "Tell me about the river and the stone."


def request(cid: str, model: str, prompt: str, max_tokens: int = 8) -> dict:
    return {"custom_id": cid, "method": "POST", "url": "/v1/completions",
            "body": {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}}


def ideal_hit(tokenizer: Tokenizer, prompts: list[str]) -> float:
    """A group's best hit rate: every prompt but its first reuses the group's common
    prefix, in whole KV blocks."""
    ids = [tokenizer.encode(p, add_special_tokens=False).ids for p in prompts]
    common = min(len(x) for x in ids)
    for x in ids[1:]:
        common = next((i for i, (a, b) in enumerate(zip(ids[0], x)) if a != b), common)
    return (len(ids) - 1) * (common // BLOCK * BLOCK) / sum(map(len, ids))


@pytest.fixture
def lora_cluster(clusters, tiny_model):
    cluster = special_vllm_cluster(clusters, tiny_model)
    asyncio.run(reset_prefix_caches(cluster.url, ["r0", "r1"]))
    return cluster


def test_adapters_through_submit_on_a_batch_file(tiny_model, tmp_path, lora_cluster):
    rng = random.Random(27)
    sentences = _synthetic_corpus(27)
    prefixes = [" ".join(rng.sample(sentences, 30)) for _ in range(2)]
    names = [tiny_model.name, *ADAPTERS]  # the base model by its name, then the adapters
    reqs, groups = [], defaultdict(list)
    for name in names:
        for p, prefix in enumerate(prefixes):
            for i in range(8):
                prompt = f"{prefix} {rng.choice(sentences)}"
                reqs.append(request(f"{name}-{p}-{i}", name, prompt))
                groups[(name, p)].append(f"{name}-{p}-{i}")
        reqs += [request(f"{name}-probe-{i}", name, PROBE) for i in range(3)]
    reqs += [request(f"zeta-{i}", "zeta", PROBE) for i in range(2)]
    rng.shuffle(reqs)
    data = tmp_path / "batch.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    out = tmp_path / "out"
    res = run_cli("submit", str(data), "--out", str(out), "--nats", lora_cluster.url, "--no-progress", "--no-report",
                  "--timeout", "600", timeout=850)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"

    rows = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    assert len(rows) == len(reqs)
    for i in range(2):
        assert "unknown LoRA adapter 'zeta'" in rows[f"zeta-{i}"]["error"]
    assert sum(r["error"] is not None for r in rows.values()) == 2
    # One prompt: the same output for every copy under one adapter (on whichever replica),
    # a different one under each adapter and the base model.
    probe = {name: {rows[f"{name}-probe-{i}"]["output"] for i in range(3)} for name in names}
    assert all(len(v) == 1 for v in probe.values()), probe
    assert len({next(iter(v)) for v in probe.values()}) == len(names), probe
    # Each adapter's prefix groups reach their ideal hit rate, and no more.
    tokenizer = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    prompt_of = {r["custom_id"]: r["body"]["prompt"] for r in reqs}
    for (name, p), ids in sorted(groups.items()):
        cached = sum(rows[i]["cached_tokens"] for i in ids)
        hit = cached / sum(rows[i]["prompt_tokens"] for i in ids)
        ideal = ideal_hit(tokenizer, [prompt_of[i] for i in ids])
        replicas = sorted({rows[i]["replica"] for i in ids})
        print(f"{name:>10} prefix {p}: hit rate {hit:.3f} (ideal {ideal:.3f}) on {replicas}")
        assert ideal - 0.02 <= hit <= ideal + 0.01, (name, p, hit, ideal, replicas)
    # The batch's result file answers each line in the name it asked for.
    ok = [json.loads(x) for x in (out / "_batch" / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "_batch" / "errors.jsonl").read_text().splitlines()]
    assert sorted(e["custom_id"] for e in errors) == ["zeta-0", "zeta-1"]
    assert {o["custom_id"].rsplit("-", 2)[0]: o["response"]["body"]["model"] for o in ok} == {n: n for n in names}


def test_adapters_through_the_batch_api_and_a_lora_column(tiny_model, tmp_path, lora_cluster):
    from prefixflow.launch.local_cluster import free_port

    cluster = lora_cluster
    env = {"PFX_MODEL": str(tiny_model), "PFX_LORA_ADAPTERS": ",".join(ADAPTERS)}
    port = free_port()
    log = tmp_path / "api.log"
    api = start_api({**env, "PFX_NATS_URL": cluster.url, "PFX_PORT": str(port)}, log)
    try:
        c = openai.OpenAI(api_key="unused", base_url=f"http://127.0.0.1:{port}/v1", max_retries=2)
        names = [tiny_model.name, *ADAPTERS]
        reqs = [request(f"{name}-{i}", name, f"{PROBE} {i}") for name in names for i in range(2)]
        reqs.append(request("zeta", "zeta", PROBE))
        fid = upload(c, tmp_path / "batch.jsonl", reqs)
        done = finished(c, c.batches.create(input_file_id=fid, endpoint="/v1/completions", completion_window="24h").id)
        assert done.status == "completed" and done.request_counts.completed == 8, (done, log.read_text()[-2000:])
        answered = {x["custom_id"]: x["response"]["body"] for x in lines(c, done.output_file_id)}
        # An adapter's lines are answered in its name, the base model's in the model's (the API's `--model`).
        asked = {r["custom_id"]: r["body"]["model"] for r in reqs[:-1]}
        assert {cid: body["model"] for cid, body in answered.items()} == {
            cid: str(tiny_model) if name == tiny_model.name else name for cid, name in asked.items()}
        texts = {name: answered[f"{name}-0"]["choices"][0]["text"] for name in names}
        assert len(set(texts.values())) == len(names), texts
        [bad] = lines(c, done.error_file_id)
        assert bad["custom_id"] == "zeta" and "not served here" in json.dumps(bad)

        # A Parquet `lora` column, twice, dealt round-robin: every adapter runs on both replicas.
        asyncio.run(set_policy(cluster.url, "round-robin"))
        table = pa.table({"id": list(range(8)), "prompt": [PROBE] * 8,
                          "lora": pa.array(["", *ADAPTERS] * 2).dictionary_encode()})
        pq.write_table(table, tmp_path / "rows.parquet")
        outputs = defaultdict(set)
        replicas = defaultdict(set)
        for run in range(2):
            out = tmp_path / f"col-{run}"
            res = run_cli("submit", str(tmp_path / "rows.parquet"), "--out", str(out), "--nats", cluster.url,
                          "--max-tokens", "8", "--temperature", "0", "--no-progress", timeout=300)
            assert res.returncode == 0, f"{res.stdout}\n{res.stderr}"
            for r in pq.read_table(out).to_pylist():
                assert r["error"] is None, r
                outputs[r["lora"]].add(r["output"])
                replicas[r["lora"]].add(r["replica"])
        print(f"\nreplicas per adapter: {dict(replicas)}")
        assert all(len(v) == 1 for v in outputs.values()), outputs
        assert len({next(iter(v)) for v in outputs.values()}) == 4, outputs
        assert all(v == {"r0", "r1"} for v in replicas.values()), replicas
    finally:
        api.send_signal(signal.SIGTERM)
        try:
            api.wait(timeout=20)
        except subprocess.TimeoutExpired:
            api.kill()
