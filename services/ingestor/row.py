"""One valid row, made ready to tokenize: chat rendering and the row's own sampling.
Pure logic (the plan calls it in its worker thread); errors are ValueErrors whose text is
the row's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from services.ingestor.validate import Record
from shared.wire import messages as m
from shared.wire.sampling import ROW_FIELDS, row_sampling

_columns = msgspec.msgpack.Decoder(dict[str, Any])
_encoder = msgspec.msgpack.Encoder()


def prepare_row(
    rec: Record, spec: m.JobSpec, render_chat: Callable[[Any, str, dict], str] | None
) -> tuple[Record, m.SamplingSpec, bytes]:
    """(the record, with a chat row's `prompt` rendered; its sampling; that sampling
    packed for the wire, empty when it is the job's)."""
    needs_columns = rec.messages is not None or _may_override(rec.columns)
    if not needs_columns:
        return rec, spec.sampling, b""
    columns = _columns.decode(rec.columns) if rec.columns else {}
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
    return rec, sampling, packed


def _may_override(columns: bytes) -> bool:
    """Cheap pre-check on the packed columns: any per-row sampling field name in them."""
    return bool(columns) and any(name.encode() in columns for name in ROW_FIELDS)
