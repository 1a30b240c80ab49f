"""Chat rows: the ingestor's rendering and tokenization of `messages` equals vLLM's own
chat path token for token (must-show 2), and every kind of bad chat input becomes an
error row naming the problem while the rest of the batch goes on."""

from __future__ import annotations

import json

import msgspec
import pytest

from prefixflow.services.ingestor.chat import ChatError, check_messages, content_format
from prefixflow.services.ingestor.model import load_model
from prefixflow.services.ingestor.plan import Incoming, plan_batch
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]

SYSTEM = "You are a terse assistant. Answer in one sentence."
CONVERSATIONS = [
    # single user turn, no system prompt
    [{"role": "user", "content": "What is NATS JetStream?"}],
    # shared system prompt
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a prime number."}],
    # multi-turn
    [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Hi there."},
        {"role": "assistant", "content": "Hello. How can I help?"},
        {"role": "user", "content": "Tell me a fact about the sea."},
    ],
    # list-of-parts content
    [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM}]},
        {"role": "user", "content": [{"type": "text", "text": "First part."}, {"type": "text", "text": "Second part."}]},
    ],
    # unicode, emoji, newlines, text that looks like markup
    [
        {"role": "user", "content": "Grüße aus Köln — 你好, мир! 🚀\nLine two with <b>tags</b> and {braces}."},
        {"role": "assistant", "content": "¡Hola! ✓"},
        {"role": "user", "content": "ça va? ½ + ¼ = ¾"},
    ],
    # a developer message (becomes system for a template that does not know the role)
    [{"role": "developer", "content": "Reply in JSON."}, {"role": "user", "content": "Give me a key."}],
]


@pytest.fixture(scope="module")
def ingestor_model(tiny_model):
    return load_model(str(tiny_model), 4096, 16)


@pytest.fixture(scope="module")
def vllm_renderer(tiny_model):
    """vLLM's own renderer for the model (no engine): what `LLM.chat` and the OpenAI
    server use to turn messages into token ids."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.renderers.registry import renderer_from_config

    config = EngineArgs(model=str(tiny_model), max_model_len=4096).create_engine_config()
    return renderer_from_config(config)


def vllm_token_ids(renderer, messages) -> list[int]:
    from vllm.renderers.params import ChatParams

    _, prompt = renderer.render_messages(messages, ChatParams(chat_template_kwargs={"add_generation_prompt": True}))
    return list(renderer.tokenize_prompt(prompt, renderer.default_chat_tok_params)["prompt_token_ids"])


def plan_rows(model, rows, spec: m.JobSpec | None = None) -> tuple[dict, dict]:
    """Run rows through the ingestor's plan; (id -> token ids, id -> error)."""
    spec = spec or m.JobSpec(job="j", out_dir="/tmp/x")
    batch = [Incoming("pfx.ingest.j", json.dumps(rows).encode())]
    plan = plan_batch(batch, {"j": m.JobLookup(spec)}, model, lambda key: "node0")
    tokens = {p.id: tk.unpack(p.tokens) for ps in plan.prompts.values() for p in ps}
    errors = {r.id: r.error for rs in plan.errors.values() for r in rs}
    return tokens, errors


def test_token_ids_equal_vllm_chat_rendering(ingestor_model, vllm_renderer):
    rows = [{"id": i, "messages": conv} for i, conv in enumerate(CONVERSATIONS)]
    tokens, errors = plan_rows(ingestor_model, rows)
    assert errors == {}
    for i, conv in enumerate(CONVERSATIONS):
        assert tokens[i] == vllm_token_ids(vllm_renderer, conv), f"conversation {i}"
    # The ChatML markers are single special tokens and the assistant turn is open.
    assert tokens[1][0] == 3 and 4 in tokens[1]


def test_shared_system_prompt_is_a_shared_token_prefix(ingestor_model):
    rows = [{"id": i, "messages": [{"role": "system", "content": SYSTEM * 4}, {"role": "user", "content": q}]}
            for i, q in enumerate(["Why is the sky blue?", "How do tides work?"])]
    tokens, _ = plan_rows(ingestor_model, rows)
    a, b = tokens[0], tokens[1]
    common = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    system_only, _ = plan_rows(ingestor_model, [{"id": 0, "messages": [{"role": "system", "content": SYSTEM * 4}]}])
    # Everything up to the user's text is shared: the whole templated system turn.
    assert common >= len(system_only[0]) - 3  # minus the generation prompt


def test_messages_and_rendered_prompt_are_carried_through(ingestor_model):
    conv = CONVERSATIONS[1]
    spec = m.JobSpec(job="j", out_dir="/tmp/x")
    batch = [Incoming("pfx.ingest.j", json.dumps({"id": 7, "messages": conv, "label": "x"}).encode())]
    plan = plan_batch(batch, {"j": m.JobLookup(spec)}, ingestor_model, lambda key: "node0")
    (prompt,) = plan.prompts["node0"]
    columns = msgspec.msgpack.decode(plan.kept["j"][prompt.row])  # kept by the ingestor (no reference)
    assert columns["messages"] == conv and columns["label"] == "x"
    assert columns["prompt"].startswith("<|im_start|>system\n" + SYSTEM) and columns["prompt"].endswith("<|im_start|>assistant\n")


def test_job_chat_template_override_and_kwargs(ingestor_model):
    template = "{% for m in messages %}[{{ m['role'] }}|{{ greeting }}] {{ m['content'] }}\n{% endfor %}"
    spec = m.JobSpec(job="j", out_dir="/tmp/x", chat_template=template, chat_template_kwargs={"greeting": "hey"})
    batch = [Incoming("pfx.ingest.j", json.dumps({"id": 1, "messages": CONVERSATIONS[0]}).encode())]
    plan = plan_batch(batch, {"j": m.JobLookup(spec)}, ingestor_model, lambda key: "node0")
    (prompt,) = plan.prompts["node0"]
    assert msgspec.msgpack.decode(plan.kept["j"][prompt.row])["prompt"] == "[user|hey] What is NATS JetStream?\n"


BAD = {
    "not-a-list": ({"messages": "hello"}, "'messages' must be a list"),
    "empty": ({"messages": []}, "'messages' is empty"),
    "unknown-role": ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role 'wizard'"),
    "missing-content": ({"messages": [{"role": "user"}]}, "missing 'content'"),
    "bad-part": ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "want a text part"),
    "too-long": ({"messages": [{"role": "user", "content": "word " * 5000}]}, "prompt too long"),
}


def test_bad_chat_input_gives_error_rows_and_the_rest_goes_on(ingestor_model):
    rows = [{"id": name, **row} for name, (row, _) in BAD.items()] + [{"id": "good", "messages": CONVERSATIONS[0]}]
    tokens, errors = plan_rows(ingestor_model, rows)
    assert set(tokens) == {"good"}
    for name, (_, want) in BAD.items():
        assert want in errors[name], (name, errors[name])


def test_template_that_fails_to_render_is_an_error_row(ingestor_model):
    spec = m.JobSpec(job="j", out_dir="/tmp/x", chat_template="{{ raise_exception('no system messages here') }}")
    _, errors = plan_rows(ingestor_model, [{"id": 1, "messages": CONVERSATIONS[1]}], spec)
    assert "chat template failed to render" in errors[1] and "no system messages here" in errors[1]
    spec = m.JobSpec(job="j", out_dir="/tmp/x", chat_template="{% for m in messages %}")  # syntax error
    _, errors = plan_rows(ingestor_model, [{"id": 2, "messages": CONVERSATIONS[0]}], spec)
    assert "chat template failed to render" in errors[2]


def test_check_messages_and_content_format():
    with pytest.raises(ChatError, match="must be an object"):
        check_messages(["hi"])
    assert content_format("{% for part in message['content'] %}{{ part['text'] }}{% endfor %}") == "openai"
    assert content_format("{{ message['content'] }}") == "string"


def test_a_template_that_loops_for_minutes_is_an_error_row_within_its_limit(tiny_model):
    """Issue 40: a job's template of nested `range(100000)` loops stalled the planning
    thread every job shares. Each such row now ends at the time limit as an error row
    naming it; after `STRIKES` overruns that job's template is refused at once; other
    jobs' rows (the model's own template) render as before, in the same thread."""
    import time

    from prefixflow.services.ingestor.chat import STRIKES

    model = load_model(str(tiny_model), 4096, 16, chat_template_timeout=0.5)
    slow = m.JobSpec(job="j", out_dir="/tmp/x",
                     chat_template="{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x")
    start = time.monotonic()
    _, errors = plan_rows(model, [{"id": i, "messages": CONVERSATIONS[0]} for i in range(STRIKES + 5)], slow)
    took = time.monotonic() - start
    assert len(errors) == STRIKES + 5 and all("ran past its time limit of 0.5 s" in e for e in errors.values())
    assert sum("refused" in e for e in errors.values()) == 5, errors
    assert took < STRIKES * 0.5 + 10, f"{took:.1f} s: the overrunning renders were not stopped"
    tokens, errors = plan_rows(model, [{"id": "other", "messages": CONVERSATIONS[1]}])
    assert set(tokens) == {"other"} and not errors
