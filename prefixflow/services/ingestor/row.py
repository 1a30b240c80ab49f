"""One valid row, made ready to tokenize: chat rendering, the row's own sampling and its
LoRA adapter. Pure logic (the plan calls it in its worker thread); errors are ValueErrors whose text is
the row's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from prefixflow.services.ingestor.validate import Record
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.sampling import ROW_FIELDS, row_sampling

_columns = msgspec.msgpack.Decoder(dict[str, Any])
_encoder = msgspec.msgpack.Encoder()

LORA_FIELD = m.LORA_FIELD
MAX_LORA_NAME = 256


def model_names(*models: str) -> frozenset[str]:
    """The names that mean the base model: each model's path or id and its last component."""
    return frozenset(n for model in models if model for n in (model, model.rstrip("/").rsplit("/", 1)[-1]) if n)


def row_lora(columns: dict[str, Any], base: frozenset[str]) -> str:
    """The adapter a row asks for ("" for none, or for a name in `base`: the base model's
    names); raises ValueError for a value that cannot name one. Whether an engine serves
    it is the engine-worker's to say (its error row)."""
    value = columns.get(LORA_FIELD)
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise ValueError(f"'{LORA_FIELD}' must be a string (a LoRA adapter's name), not {type(value).__name__}")
    if value in base:
        return ""
    if len(value) > MAX_LORA_NAME or not value.isprintable() or value != value.strip():
        raise ValueError(f"invalid LoRA adapter name {value[:64]!r} (printable, no surrounding spaces, "
                         f"at most {MAX_LORA_NAME} characters)")
    return value


def prepare_row(
    rec: Record, spec: m.JobSpec, render_chat: Callable[[Any, str, dict], str] | None,
    base: frozenset[str] = frozenset(),
) -> tuple[Record, m.SamplingSpec, bytes, str]:
    """(the record, with a chat row's `prompt` rendered; its sampling; that sampling
    packed for the wire, empty when it is the job's; its LoRA adapter, empty for the base
    model, whose names are `base` and the job's `model`)."""
    needs_columns = rec.messages is not None or _may_override(rec.columns) or LORA_FIELD.encode() in rec.columns
    if not needs_columns:
        return rec, spec.sampling, b"", ""
    columns = _columns.decode(rec.columns) if rec.columns else {}
    lora = row_lora(columns, base | model_names(spec.model))
    sampling, packed = spec.sampling, b""
    own = row_sampling(spec.sampling, columns)
    if own is not None:
        sampling, packed = own, _encoder.encode(own)
    if rec.messages is not None:
        if render_chat is None:
            raise ValueError("this ingestor cannot render chat messages")
        text = render_chat(rec.messages, spec.chat_template, spec.chat_template_kwargs)
        # Both `messages` and the rendered `prompt` are carried through to the output.
        columns.setdefault("prompt", text)
        rec = Record(rec.id, text, _encoder.encode(columns), None, rec.messages, rec.src, rec.row)
    return rec, sampling, packed, lora


def _may_override(columns: bytes) -> bool:
    """Cheap pre-check on the packed columns: any per-row sampling field name in them."""
    return bool(columns) and any(name.encode() in columns for name in ROW_FIELDS)
