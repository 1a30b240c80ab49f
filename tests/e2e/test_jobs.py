"""Real jobs end to end (honcho on the Procfile: nats-server, all services, two real vLLM
replicas on the local model): a chat job with shared system prompts reaches >= 90 % of
the analytic ideal hit rate of its shared *templated* prefix; a JSON-schema job whose
outputs all validate (nested object, array, enum); a `choice` job; per-row structured
output and sampling, with every kind of bad row coming back as an error row while the
job goes on."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import jsonschema
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.make_model import _synthetic_corpus
from prefixflow.services.ingestor.model import load_model
from tests.conftest import reset_prefix_caches, run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

BLOCK = 128  # the CPU engines' KV block size (tokens)


def rows_of(out_dir) -> dict:
    return {r["id"]: r for r in pq.read_table(out_dir).to_pylist()}


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def submit(cluster, data, out, job, *extra) -> None:
    res = run_cli("submit", str(data), "--out", str(out), "--nats", cluster.url, "--job", job,
                  "--no-progress", "--timeout", "600", *extra)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr}\n{cluster.tail()}"


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_chat_job_shared_system_prompt_hit_rate(vllm_cluster, tiny_model, tmp_path):
    """8 system prompts (about 3-4 KV blocks once templated) x 24 user questions,
    shuffled. Ideal: in each group every conversation but the first reuses the whole
    blocks of the group's shared templated prefix."""
    rng = random.Random(5)
    sentences = _synthetic_corpus(11)
    systems = [" ".join(rng.sample(sentences, 22)) for _ in range(8)]
    rows = [
        {"id": f"g{g}-{q}", "group": g,
         "messages": [{"role": "system", "content": systems[g]}, {"role": "user", "content": " ".join(rng.sample(sentences, 3))}]}
        for g in range(8) for q in range(24)
    ]
    rng.shuffle(rows)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    # The shared templated prefix of each group, as the ingestor tokenizes it.
    model = load_model(str(tiny_model), 4096, 16)
    ids = {r["id"]: model.encode_chat_batch([model.render_chat(r["messages"], "", {})])[0] for r in rows}
    shared = {}
    for g in range(8):
        group = [ids[r["id"]] for r in rows if r["group"] == g]
        shared[g] = min(common_prefix(group[0], t) for t in group[1:])
        assert shared[g] >= 2 * BLOCK, "each group shares at least two KV blocks"

    asyncio.run(reset_prefix_caches(vllm_cluster.url, ["r0", "r1"]))
    out = tmp_path / "out"
    submit(vllm_cluster, data, out, "e2e-chat", "--max-tokens", "4")
    got = rows_of(out)
    assert sorted(got) == sorted(r["id"] for r in rows) and all(r["error"] is None for r in got.values())
    # The conversation is carried through (as an input column: the rendered prompt is the
    # ingestor's, and only model inputs travel).
    some = got[rows[0]["id"]]
    messages = some["messages"] if isinstance(some["messages"], list) else json.loads(some["messages"])
    assert messages[0]["content"] == rows[0]["messages"][0]["content"]
    assert all(got[i]["prompt_tokens"] == len(t) for i, t in ids.items()), "engine saw the ingestor's token ids"

    total = sum(len(t) for t in ids.values())
    ideal = sum((24 - 1) * (shared[g] // BLOCK * BLOCK) for g in range(8)) / total
    hit = sum(r["cached_tokens"] for r in got.values()) / sum(r["prompt_tokens"] for r in got.values())
    summary = json.loads((out / "_summary.json").read_text())
    print(f"\nchat job: hit rate {hit:.3f}, analytic ideal {ideal:.3f} ({hit / ideal:.1%} of ideal); "
          f"summary {summary['prefix_cache_hit_rate']}")
    assert hit >= 0.9 * ideal


SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["cat", "dog", "bird"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,6}$"}, "verified": {"type": "boolean"}},
            "required": ["name", "verified"],
            "additionalProperties": False,
        },
    },
    "required": ["label", "score", "tags", "owner"],
    "additionalProperties": False,
}


def test_json_schema_job_every_output_validates(vllm_cluster, tmp_path):
    sentences = _synthetic_corpus(3)
    data = write_jsonl(tmp_path / "label.jsonl", [{"id": i, "prompt": f"Label this: {s}"} for i, s in enumerate(sentences[:32])])
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "out"
    submit(vllm_cluster, data, out, "e2e-json-schema", "--json-schema", str(schema), "--max-tokens", "200")
    got = rows_of(out)
    assert len(got) == 32
    for r in got.values():
        assert r["error"] is None, r["error"]
        jsonschema.validate(json.loads(r["output"]), SCHEMA)  # 100 %: the grammar forces it
        assert r["finish_reason"] == "stop"


def test_choice_job(vllm_cluster, tmp_path):
    data = write_jsonl(tmp_path / "sentiment.jsonl", [{"id": i, "prompt": f"Sentiment of review {i}:"} for i in range(24)])
    out = tmp_path / "out"
    submit(vllm_cluster, data, out, "e2e-choice", "--choice", "positive,negative,neutral", "--max-tokens", "16")
    got = rows_of(out)
    assert len(got) == 24 and all(r["error"] is None for r in got.values())
    assert {r["output"] for r in got.values()} <= {"positive", "negative", "neutral"}


def test_per_row_structured_output_sampling_and_bad_rows(vllm_cluster, tmp_path):
    conv = [{"role": "user", "content": "Pick one."}]
    good = [
        {"id": "regex", "prompt": "A date:", "regex": r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]"},
        {"id": "choice", "messages": conv, "choice": ["red", "green"]},
        {"id": "schema", "prompt": "JSON:", "sampling": {"max_tokens": 200},
         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
        {"id": "grammar", "prompt": "Yes or no:", "grammar": 'root ::= "yes" | "no"'},
        {"id": "sampling", "prompt": "Hello", "sampling": {"max_tokens": 3, "temperature": 0.0, "stop": ["zzz"]}},
        {"id": "n-logprobs", "prompt": "Hello", "sampling": {"n": 3, "logprobs": 2, "max_tokens": 4, "ignore_eos": True}},
    ]
    bad = {
        "messages-not-list": ({"messages": "hi"}, "'messages' must be a list"),
        "unknown-role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role"),
        "missing-content": ({"messages": [{"role": "user"}]}, "missing 'content'"),
        "too-long": ({"messages": [{"role": "user", "content": "word " * 5000}]}, "too long"),
        "bad-schema": ({"prompt": "x", "json_schema": {"type": "objectx"}}, "invalid JSON schema"),
        "bad-regex": ({"prompt": "x", "regex": "a(b"}, "regex does not compile"),
        "temperature": ({"prompt": "x", "sampling": {"temperature": -1}}, "temperature"),
        "unknown-param": ({"prompt": "x", "sampling": {"temprature": 0.5}}, "unknown field"),
        "n-out-of-range": ({"prompt": "x", "sampling": {"n": 0}}, "n"),
    }
    rows = good + [{"id": k, **row} for k, (row, _) in bad.items()]
    data = write_jsonl(tmp_path / "mixed.jsonl", rows)
    out = tmp_path / "out"
    submit(vllm_cluster, data, out, "e2e-per-row", "--max-tokens", "24")
    got = rows_of(out)
    assert sorted(got) == sorted(r["id"] for r in rows)
    for k, (_, want) in bad.items():
        assert got[k]["error"] and want in got[k]["error"], (k, got[k]["error"])
        print(f"{k}: {got[k]['error']}")
    for r in good:
        assert got[r["id"]]["error"] is None, (r["id"], got[r["id"]]["error"])
    import re

    assert re.fullmatch(good[0]["regex"], got["regex"]["output"])
    assert got["choice"]["output"] in ("red", "green")
    jsonschema.validate(json.loads(got["schema"]["output"]), SCHEMA)
    assert got["grammar"]["output"] in ("yes", "no")
    assert got["sampling"]["output_tokens"] <= 3
    n = got["n-logprobs"]  # n > 1: all completions in `outputs`; logprobs of the first
    assert len(n["outputs"]) == 3 and n["output"] == n["outputs"][0] and n["output_tokens"] == 12
    assert len(n["logprobs"]) == 4 and all(t["logprob"] <= 0 and 2 <= len(t["top"]) <= 3 for t in n["logprobs"])


def test_invalid_job_schema_is_refused_at_creation(vllm_cluster, tmp_path):
    data = write_jsonl(tmp_path / "x.jsonl", [{"id": 0, "prompt": "x"}])
    res = run_cli("submit", data, "--out", str(tmp_path / "out"), "--nats", vllm_cluster.url, "--job", "e2e-bad-schema",
                  "--json-schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}', "--no-progress")
    assert res.returncode != 0 and "bad sampling parameters" in res.stderr and "invalid JSON schema" in res.stderr, res.stderr
    assert not (tmp_path / "out").exists()


def test_openai_batch_file_good_and_bad_lines(vllm_cluster, tmp_path):
    """An OpenAI Batch file mixing good requests (chat, completion, structured, n > 1)
    and bad lines: output.jsonl lines validate with the `openai` package's types, every
    bad line is in errors.jsonl naming its line."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    def req(cid, url, body, method="POST"):
        return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})

    chat = "/v1/chat/completions"
    lines = [
        req("chat-1", chat, {"model": Path(vllm_cluster.env["PFX_MODEL"]).name, "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "max_tokens": 5}),
        req("chat-json", chat, {"messages": [{"role": "user", "content": "JSON please"}], "max_completion_tokens": 200,
                                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}),
        req("cmpl-1", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "temperature": 0.9}),
        req("cmpl-ids", "/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 3}),
        "this is not json",
        req("bad-url", "/v1/images/generations", {"prompt": "x"}),
        req("bad-body", chat, ["not", "an", "object"]),
        req("chat-1", chat, {"messages": [{"role": "user", "content": "dup"}]}),
        json.dumps({"custom_id": "no-url", "method": "POST", "body": {}}),
        req("bad-method", chat, {"messages": []}, method="GET"),
        req("bad-role", chat, {"messages": [{"role": "wizard", "content": "hi"}]}),
        req("bad-temp", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ]
    data = tmp_path / "batch.jsonl"
    data.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    submit(vllm_cluster, data, out, "e2e-openai-batch", "--max-tokens", "16")
    ok = [json.loads(x) for x in (out / "_batch" / "output.jsonl").read_text().splitlines()]
    errors = [json.loads(x) for x in (out / "_batch" / "errors.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in ok] == ["chat-1", "chat-json", "cmpl-1", "cmpl-ids"]
    for o in ok:
        assert o["id"] and o["error"] is None and o["response"]["status_code"] == 200 and o["response"]["request_id"]
        body = o["response"]["body"]
        typed = (ChatCompletion if o["custom_id"].startswith("chat") else Completion).model_validate(body, strict=False)
        assert typed.usage.prompt_tokens > 0 and typed.usage.prompt_tokens_details.cached_tokens is not None
    chat_json = ChatCompletion.model_validate(ok[1]["response"]["body"])
    jsonschema.validate(json.loads(chat_json.choices[0].message.content), SCHEMA)
    assert len(Completion.model_validate(ok[2]["response"]["body"]).choices) == 2
    messages = sorted(e["response"]["body"]["error"]["message"] for e in errors)
    print("\n".join(messages))
    assert len(errors) == 8 and all(e["response"]["status_code"] == 400 for e in errors)
    for want in ("line 5: not JSON", "line 6: unknown url", "line 7: 'body' must be an object",
                 "line 8: duplicate custom_id 'chat-1'", "line 9: missing 'url'", "line 10: method 'GET'",
                 "line 11: messages[0]: unknown role 'wizard'", "line 12: bad sampling"):
        assert any(msg.startswith(want) for msg in messages), (want, messages)
    assert pq.read_table(out).num_rows == 6  # the Parquet parts hold every request that ran
