"""Parsing and validating one ingest message: pure functions, no I/O.

An ingest message is a JSON object or a msgpack map with at least `id` (int or string)
and `prompt` (non-empty string), `messages` (a chat conversation, rendered by the plan) or
`prompt_token_ids` (pre-tokenized: a list of token ids, not carried to the output); every other field is an input column carried through to
the output. The publisher may also send the id in the `Pfx-Id` header (JSON-encoded):
then even a message whose body cannot be decoded yields an error row for that id. A
message may also be an array of such objects (what `prefixflow submit` sends: far fewer
messages per prompt); each element is validated on its own.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire.messages import INGEST_SRC_BASE, LORA_FIELD, ROW_FIELD, SRC_FIELD, PromptId
from prefixflow.shared.wire.structured import ROW_FIELDS

ID_HEADER = "Pfx-Id"
PLAN_FIELDS = frozenset(("prompt", "messages", "prompt_token_ids", LORA_FIELD, *ROW_FIELDS))
"""Fields of a row the plan reads (the rest are input columns, kept aside)."""

_json = msgspec.json.Decoder(dict[str, Any])
_msgpack = msgspec.msgpack.Decoder(dict[str, Any])
_json_any = msgspec.json.Decoder()
_msgpack_any = msgspec.msgpack.Decoder()
_id_decoder = msgspec.json.Decoder(int | str)
_columns_encoder = msgspec.msgpack.Encoder()


class Record(msgspec.Struct):
    id: PromptId
    prompt: str
    columns: bytes
    """msgpack map of every field but `id` (so `prompt` is carried through too)."""
    tokens: bytes | None = None
    """Pre-tokenized input (`prompt_token_ids`), packed (`prefixflow.shared.prefix.tokens`): the ingestor
    skips tokenization."""
    messages: Any = None
    """Chat input (`messages`, OpenAI shape), when the row has no `prompt`: rendered with
    the chat template and checked by the plan (`prefixflow/services/ingestor/chat.py`)."""
    src: int = -1
    """The job's blob holding this row's input columns (`SRC_FIELD`); -1: the row's other
    fields (`columns`) are its input columns, to be kept by the ingestor."""
    row: int = -1


class Rejected(msgspec.Struct):
    id: PromptId | None
    """None when no id could be recovered (the message then goes to the dead-letter stream)."""
    error: str
    src: int = -1
    """Where the row's input columns are kept, when it said (its error row gets them)."""
    row: int = -1
    columns: bytes = b""
    """A raw row's own fields (msgpack map, as `Record.columns`) when its body was read:
    its error row keeps them, as a good row would."""


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
    return _record(body, hid)


def parse_many(data: bytes, headers: dict[str, str] | None = None) -> list[Record | Rejected]:
    """Like `parse`, but a body that is an array yields one result per element."""
    stripped = data.lstrip()[:1]
    if stripped == b"[" or (stripped and 0x90 <= stripped[0] <= 0x9F) or stripped in (b"\xdc", b"\xdd"):
        try:
            body = _json_any.decode(data) if stripped == b"[" else _msgpack_any.decode(data)
        except (msgspec.DecodeError, UnicodeDecodeError):
            return [parse(data, headers)]
        if isinstance(body, list):
            return [
                _record(e, None) if isinstance(e, dict) else Rejected(None, "malformed element: want an object")
                for e in body
            ]
    return [parse(data, headers)]


def _record(body: dict[str, Any], hid: PromptId | None) -> Record | Rejected:
    rid = body.pop("id", hid)
    if isinstance(rid, bool) or not isinstance(rid, int | str) or (isinstance(rid, int) and rid not in INT64):
        return Rejected(hid, "missing or invalid 'id' (want a 64-bit integer or a string)")
    src, row = body.pop(SRC_FIELD, -1), body.pop(ROW_FIELD, -1)
    if not (type(src) is int and type(row) is int and src >= -1 and row >= -1):
        return Rejected(rid, f"invalid {SRC_FIELD!r}/{ROW_FIELD!r} (want integers)")
    if src >= INGEST_SRC_BASE:
        return Rejected(rid, f"invalid {SRC_FIELD!r}: {src} is reserved")
    if src >= 0:  # the row's input columns are kept in a blob: carry only what the plan uses
        body = {k: v for k, v in body.items() if k in PLAN_FIELDS}
    ref = {"src": src, "row": row}
    token_ids = body.pop("prompt_token_ids", None)
    if src < 0:  # a raw row: its fields are its input columns, kept on its error row too
        ref["columns"] = _columns_encoder.encode(body)
    given = [k for k, v in (("prompt", body.get("prompt")), ("messages", body.get("messages")), ("prompt_token_ids", token_ids))
             if v is not None]
    if len(given) > 1:
        return Rejected(rid, **ref, error=f"the row has both {' and '.join(repr(k) for k in given)}: give exactly one")
    if token_ids is not None:
        packed = tk.pack_checked(token_ids)
        if packed is None:
            return Rejected(rid, **ref, error="invalid 'prompt_token_ids' (want a list of token ids)")
        if not packed:
            return Rejected(rid, **ref, error="empty prompt")
        return Record(rid, "", _columns_encoder.encode(body), packed, src=src, row=row)
    prompt = body.get("prompt")
    if prompt is None and body.get("messages") is not None:
        return Record(rid, "", _columns_encoder.encode(body), messages=body["messages"], src=src, row=row)
    if not isinstance(prompt, str):
        return Rejected(rid, **ref, error="missing 'prompt' (want a string, 'messages' or 'prompt_token_ids')")
    if not prompt.strip():
        return Rejected(rid, **ref, error="empty prompt")
    return Record(rid, prompt, _columns_encoder.encode(body), src=src, row=row)


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
