"""Parsing and validating one ingest message: pure functions, no I/O.

An ingest message is a JSON object or a msgpack map with at least `id` (int or string)
and `prompt` (non-empty string); every other field is an input column carried through to
the output. The publisher may also send the id in the `Pfx-Id` header (JSON-encoded):
then even a message whose body cannot be decoded yields an error row for that id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages import PromptId

ID_HEADER = "Pfx-Id"

_json = msgspec.json.Decoder(dict[str, Any])
_msgpack = msgspec.msgpack.Decoder(dict[str, Any])
_id_decoder = msgspec.json.Decoder(int | str)
_columns_encoder = msgspec.msgpack.Encoder()


class Record(msgspec.Struct):
    id: PromptId
    prompt: str
    columns: bytes
    """msgpack map of every field but `id` (so `prompt` is carried through too)."""


class Rejected(msgspec.Struct):
    id: PromptId | None
    """None when no id could be recovered (the message then goes to the dead-letter stream)."""
    error: str


def header_id(headers: dict[str, str] | None) -> PromptId | None:
    raw = (headers or {}).get(ID_HEADER)
    if raw is None:
        return None
    try:
        return _id_decoder.decode(raw)
    except msgspec.DecodeError:
        return None


INT64 = range(-(2**63), 2**63)


def parse(data: bytes, headers: dict[str, str] | None = None) -> Record | Rejected:
    hid = header_id(headers)
    is_json = data.lstrip()[:1] == b"{"
    try:
        body = _json.decode(data) if is_json else _msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # NOTE: msgspec raises UnicodeDecodeError (not DecodeError) for invalid UTF-8 in a
        # string; a JSON body is text, so any invalid UTF-8 in it is the cause.
        bad_text = isinstance(exc, UnicodeDecodeError) or (is_json and _bad_utf8(data))
        return Rejected(hid, f"{'invalid UTF-8' if bad_text else 'malformed message'}: {exc}")
    if not isinstance(body, dict):
        return Rejected(hid, "malformed message: want a JSON object or msgpack map")
    rid = body.pop("id", hid)
    if isinstance(rid, bool) or not isinstance(rid, int | str) or (isinstance(rid, int) and rid not in INT64):
        return Rejected(hid, "missing or invalid 'id' (want a 64-bit integer or a string)")
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        return Rejected(rid, "missing 'prompt' (want a string)")
    if not prompt.strip():
        return Rejected(rid, "empty prompt")
    return Record(rid, prompt, _columns_encoder.encode(body))


def _bad_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def length_error(n_tokens: int, max_tokens: int, max_model_len: int) -> str | None:
    if n_tokens == 0:
        return "prompt has no tokens"
    if n_tokens + max_tokens > max_model_len:
        return (
            f"prompt too long: {n_tokens} tokens + max_tokens {max_tokens} "
            f"> max_model_len {max_model_len}"
        )
    return None
