"""OpenAI Batch files: request lines -> rows, bad lines -> error lines naming the line and
the reason, output rows -> output.jsonl / errors.jsonl lines that the `openai` package's
own types accept."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from prefixflow.client.openai_batch import is_batch_file, output_lines, read_batch

pytestmark = pytest.mark.unit


def line(cid, url, body, method="POST"):
    return json.dumps({"custom_id": cid, "method": method, "url": url, "body": body})


CHAT = "/v1/chat/completions"
LINES = [
    line("a", CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stop": "x",
                     "logprobs": True, "top_logprobs": 2, "response_format": {"type": "json_object"}}),
    line("b", "/v1/completions", {"prompt": ["one prompt"], "n": 2, "temperature": 0.5}),
    line("c", "/v1/completions", {"prompt": [1, 2, 3]}),
    "{not json",
    "[1, 2]",
    line("d", "/v1/embeddings", {"input": "x"}),
    line("e", "/v1/files", {}),
    line("a", CHAT, {"messages": []}),
    json.dumps({"custom_id": "f", "url": CHAT, "body": {}}),
    line("g", CHAT, {"messages": [{"role": "user", "content": "x"}]}, method="PUT"),
    line("h", CHAT, "body"),
    line("i", "/v1/completions", {"prompt": ["two", "prompts"]}),
    line("j", CHAT, {"max_tokens": 3}),
    line("k", CHAT, {"messages": [{"role": "user", "content": "x"}], "stream": True}),
]


@pytest.fixture
def batch(tmp_path):
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(LINES) + "\n\n")
    assert is_batch_file(path)
    return read_batch(path)


def test_good_lines_become_rows(batch):
    assert [r["id"] for r in batch.rows] == ["a", "b", "c"]
    a, b, c = batch.rows
    assert a["messages"] == [{"role": "user", "content": "hi"}] and a["response_format"] == {"type": "json_object"}
    assert a["sampling"] == {"max_tokens": 5, "stop": ["x"], "logprobs": 2}
    assert b["prompt"] == "one prompt" and b["sampling"] == {"n": 2, "temperature": 0.5}
    assert c["prompt_token_ids"] == [1, 2, 3] and "sampling" not in c
    assert batch.requests["b"] == (2, "/v1/completions", "")


def test_bad_lines_name_the_line_and_the_reason(batch):
    messages = [e["response"]["body"]["error"]["message"] for e in batch.bad]
    assert messages == [
        "line 4: not JSON: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)",
        "line 5: want a JSON object per line",
        "line 6: url /v1/embeddings in a generate job (embeddings run with --task embed, alone)",
        "line 7: unknown url '/v1/files' (want /v1/chat/completions, /v1/completions, /v1/embeddings)",
        "line 8: duplicate custom_id 'a'",
        "line 9: missing 'method'",
        "line 10: method 'PUT' is not POST",
        "line 11: 'body' must be an object",
        "line 12: 'prompt' must be one string or a list of token ids (one prompt per request)",
        "line 13: missing 'messages' in body",
        "line 14: 'stream' is not supported in a batch",
    ]
    assert all(e["response"]["status_code"] == 400 and e["error"] is None for e in batch.bad)


def test_output_lines_validate_with_openai_types(batch):
    rows = [
        {"id": "a", "output": '{"k": 1}', "finish_reason": "stop", "prompt_tokens": 9, "cached_tokens": 0, "output_tokens": 4, "error": None},
        {"id": "b", "output": "x", "outputs": ["x", "y"], "finish_reason": "length", "prompt_tokens": 3, "cached_tokens": 0,
         "output_tokens": 8, "error": None},
        {"id": "c", "output": None, "finish_reason": "error", "prompt_tokens": 3, "error": "token id 9999 outside the vocabulary"},
    ]
    ok, errors = output_lines(batch, rows, "tiny")
    assert [o["custom_id"] for o in ok] == ["a", "b"]
    chat = ChatCompletion.model_validate(ok[0]["response"]["body"])
    assert chat.choices[0].message.content == '{"k": 1}' and chat.usage.prompt_tokens_details.cached_tokens == 0
    assert chat.usage.total_tokens == 13 and chat.model == "tiny"
    cmpl = Completion.model_validate(ok[1]["response"]["body"])
    assert [c.text for c in cmpl.choices] == ["x", "y"] and cmpl.choices[0].finish_reason == "length"
    assert errors[-1]["custom_id"] == "c" and errors[-1]["response"]["body"]["error"]["message"].startswith("line 3: token id")
    assert len(errors) == len(batch.bad) + 1


def test_plain_jsonl_is_not_a_batch_file(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"id": 1, "prompt": "x"}\n')
    assert not is_batch_file(path)


def test_embeddings_requests_in_an_embed_job(tmp_path):
    from openai.types import CreateEmbeddingResponse

    path = tmp_path / "emb.jsonl"
    path.write_text("\n".join([
        line("e1", "/v1/embeddings", {"model": "m", "input": "some text", "encoding_format": "float"}),
        line("e2", "/v1/embeddings", {"input": [4, 5, 6]}),
        line("e3", "/v1/embeddings", {"input": ["a", "b"]}),
        line("c1", CHAT, {"messages": [{"role": "user", "content": "x"}]}),
    ]) + "\n")
    batch = read_batch(path, "embed")
    assert [r["id"] for r in batch.rows] == ["e1", "e2"] and batch.rows[1]["prompt_token_ids"] == [4, 5, 6]
    assert [e["response"]["body"]["error"]["message"] for e in batch.bad] == [
        "line 3: 'input' must be one string or a list of token ids (one input per request)",
        "line 4: url /v1/chat/completions in an embed job (embeddings run with --task embed, alone)",
    ]
    rows = [{"id": "e1", "embedding": [0.5, -0.25], "prompt_tokens": 2, "error": None},
            {"id": "e2", "embedding": [0.1, 0.2], "prompt_tokens": 3, "error": None}]
    ok, _ = output_lines(batch, rows, "tiny")
    emb = CreateEmbeddingResponse.model_validate(ok[0]["response"]["body"])
    assert emb.data[0].embedding == [0.5, -0.25] and emb.usage.prompt_tokens == 2


def test_a_batch_file_with_an_extra_field_or_a_bad_first_line_is_still_a_batch_file(tmp_path):
    """Issue 40: lines with a field OpenAI's format does not have, or a first line that is
    not JSON, are still read as batch lines (the bad ones become error lines), never as a
    plain file without a 'prompt' column."""
    req = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "extra": {"x": 1},
           "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    for first in ("", "{not json\n", '{"custom_id": "only-id"}\n'):
        path = tmp_path / "extra.jsonl"
        path.write_text("\n" + first + json.dumps(req) + "\n")
        assert is_batch_file(path), first
        batch = read_batch(path)
        assert [r["id"] for r in batch.rows] == ["a"] and len(batch.bad) == (1 if first else 0)
    path.write_text(json.dumps({"prompt": "p", "custom_id": "x"}) + "\n")  # a plain file with an id-ish column
    assert not is_batch_file(path)
