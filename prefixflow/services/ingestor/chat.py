"""Chat rows: validate OpenAI-style `messages` and render them with the model's chat
template, before tokenization (pure logic, no I/O; tested against vLLM's own rendering in
`tests/heavy/test_chat.py`).

Rendering follows vLLM's chat path (`vllm/renderers/hf.py`, `safe_apply_chat_template`):
the tokenizer's `apply_chat_template` with `add_generation_prompt=True`, the template's
content format ("string": a list of text parts is joined with newlines, as vLLM's
`parse_chat_messages` does; "openai": the parts are passed as they are), `developer`
turned into `system` when the template does not know it; the text is then tokenized with
no special tokens added (vLLM's `default_chat_tok_params`). A shared system prompt or
few-shot block thus becomes a shared *token* prefix for bucketing and routing.

`transformers` is imported only when the first chat row arrives, so plain-prompt jobs
keep the ingestor's fast start.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

from prefixflow.shared.process.deadline import TimeLimit, time_limit

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
"""Roles a message may have (OpenAI's chat roles)."""


class ChatError(ValueError):
    """A chat row that cannot be rendered (its error row says why)."""


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validate `messages` (OpenAI shape) and return them with every `content` a string
    or a list of text parts; raise `ChatError` naming the first problem."""
    if not isinstance(messages, list):
        raise ChatError(f"'messages' must be a list of messages, not {type(messages).__name__}")
    if not messages:
        raise ChatError("'messages' is empty")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ChatError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = msg.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise ChatError(f"messages[{i}]: unknown role {role!r} (want one of {', '.join(sorted(ROLES))})")
        if "content" not in msg or msg["content"] is None:
            raise ChatError(f"messages[{i}] ({role}): missing 'content'")
        content = msg["content"]
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise ChatError(f"messages[{i}].content[{j}]: want a text part {{'type': 'text', 'text': ...}}")
        elif not isinstance(content, str):
            raise ChatError(f"messages[{i}] ({role}): 'content' must be a string or a list of text parts")
        out.append(msg)
    return out


_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(\[\s*['\"]content['\"]\s*\]|\.content)")


def content_format(template: str) -> str:
    """'openai' when the template iterates over a message's content parts, else 'string'
    (vLLM detects this from the template's syntax tree; this covers the usual spellings)."""
    return "openai" if _CONTENT_LOOP.search(template) else "string"


def normalize(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """The conversation as vLLM hands it to the template."""
    fmt = content_format(template)
    knows_developer = "developer" in template
    out = []
    for msg in messages:
        msg = dict(msg)
        content = msg["content"]
        if fmt == "string" and isinstance(content, list):
            msg["content"] = "\n".join(part["text"] for part in content)
        elif fmt == "openai" and isinstance(content, str):
            msg["content"] = [{"type": "text", "text": content}]
        if msg["role"] == "developer" and not knows_developer:
            msg["role"] = "system"
        out.append(msg)
    return out


def load_template(value: str) -> str:
    """A `--chat-template` value: a file's contents, else the template text itself."""
    if value and "{" not in value and Path(value).is_file():
        return Path(value).read_text()
    return value


TEMPLATE_TIMEOUT = 2.0
"""CPU seconds one row's chat template may render (`--chat-template-timeout`)."""
STRIKES = 3
"""Times a job's own chat template may run past the limit before its further rows are
refused at once (so a job's bad template costs other jobs at most this many limits)."""
STRUCK_TEMPLATES = 1024
"""Job templates whose overruns are remembered (the oldest forgotten first)."""


class ChatRenderer:
    """Renders conversations with one model's chat template (thread-safe; the tokenizer
    is loaded on first use). Each render has a time limit (`timeout` seconds; the row
    becomes an error row naming it), enforced in the calling thread
    (`prefixflow/shared/process/deadline.py`): a template that loops for minutes costs the
    planning thread, which every job shares, `timeout` per row, and a job's own template
    (`chat_template`) that overran `STRIKES` times costs nothing more: its rows are
    refused at once."""

    def __init__(self, model: str, timeout: float = TEMPLATE_TIMEOUT) -> None:
        self.model, self.timeout = model, timeout
        self._tokenizer = None
        self._lock = threading.Lock()
        self._strikes: OrderedDict[str, int] = OrderedDict()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model)
            return self._tokenizer

    def render(self, messages: Any, chat_template: str = "", kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of a conversation, ending with the assistant's turn opened.
        Raises `ChatError` for bad messages or a template that fails to render."""
        messages = check_messages(messages)
        tok = self.tokenizer()
        template = chat_template or tok.chat_template
        if not template:
            raise ChatError(f"model {self.model!r} has no chat template (give the job a chat_template)")
        key = hashlib.blake2b(chat_template.encode(), digest_size=16).hexdigest() if chat_template else ""
        if key and self._strikes.get(key, 0) >= STRIKES:
            raise ChatError(f"{over_time(self.timeout)} {STRIKES} times: this job's rows that use it are refused")
        try:
            return render_text(tok.apply_chat_template, normalize(messages, template), template, kwargs or {},
                               self.timeout)
        except ChatOverTime:
            if key:
                with self._lock:
                    self._strikes[key] = self._strikes.pop(key, 0) + 1
                    while len(self._strikes) > STRUCK_TEMPLATES:
                        self._strikes.popitem(last=False)
            raise


class ChatOverTime(ChatError):
    """A chat template that ran past its time limit."""


def over_time(seconds: float) -> str:
    return f"chat template ran past its time limit of {seconds:g} s (--chat-template-timeout; docs/limits.md)"


def render_text(apply: Callable[..., Any], conversation: list[dict[str, Any]], template: str, kwargs: dict[str, Any],
                timeout: float = 0.0) -> str:
    """The rendered text (`timeout`: seconds it may take, 0 for no limit); ChatError for
    any failure, a render past its time limit included."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("tokenize", "return_dict", "chat_template", "conversation")}
    kwargs.setdefault("add_generation_prompt", True)
    try:
        with time_limit(timeout):
            text = apply(conversation, chat_template=template, tokenize=False, **kwargs)
    except TimeLimit:
        raise ChatOverTime(over_time(timeout)) from None
    except Exception as exc:  # noqa: BLE001 - any template error is this row's error
        raise ChatError(f"chat template failed to render: {exc}") from None
    if not isinstance(text, str) or not text:
        raise ChatError("chat template rendered nothing")
    return text


@lru_cache(maxsize=8)
def renderer_for(model: str, timeout: float = TEMPLATE_TIMEOUT) -> ChatRenderer:
    return ChatRenderer(model, timeout)
