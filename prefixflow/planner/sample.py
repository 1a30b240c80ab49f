"""A job's input as the simulator's workload, sampled: what `prefixflow plan` predicts.

1. **Read** the input through the same sources and readers as `run` and `submit`
   (`prefixflow/client/sources.py`, `prefixflow/client/readers.py`: a file, a directory, a
   glob or a URI; Parquet, JSONL, CSV), one batch at a time.
2. **Sample**: a uniform random sample of at most `k` rows (reservoir sampling, one
   pass, memory `k` rows whatever the input's size), kept in input order (the order the
   job publishes them in). `Reservoir` is the pure part.
3. **Tokenize** each sampled row as the ingestor does (`prefixflow/services/ingestor/row.py`
   and `model.py`): `prompt_token_ids` as given, `prompt` text with the model's
   tokenizer, chat `messages` rendered with its chat template and tokenized without
   special tokens. Its output length is its sampling's `max_tokens` (the job's, or the
   row's own `sampling` column): the rows are assumed to run to it (`min_tokens`,
   `ignore_eos` or a model that does not stop early), so a job whose rows stop at EOS
   sooner takes less. A row the ingestor would refuse (no prompt, bad messages, bad
   sampling) is counted as an error row and left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixflow.client import readers
from prefixflow.client.columns import INPUT_COLUMNS, MODEL_COLUMNS
from prefixflow.client.sources import InputError, Source
from prefixflow.shared.prefix.tokens import pack_checked
from prefixflow.shared.wire.messages import SamplingSpec
from prefixflow.sim.workload import Workload


class Reservoir:
    """A uniform sample of at most `k` items of a stream (Algorithm R), by stream index.
    Pure: `offer(n)` says which of the next `n` items to keep and where."""

    def __init__(self, k: int, seed: int = 0) -> None:
        if k < 1:
            raise ValueError("a sample needs k >= 1")
        self.k = k
        self.seen = 0
        self.rng = np.random.default_rng(seed)
        self.slots: list[tuple[int, Any]] = []
        """(stream index, item) per kept item, in slot order."""

    def offer(self, n: int) -> list[tuple[int, int]]:
        """The next `n` items: (offset in them, slot) for each to keep, in order (a later
        one may take an earlier one's slot: keep them in this order)."""
        out = []
        fill = min(max(self.k - self.seen, 0), n)
        out.extend((i, self.seen + i) for i in range(fill))
        if fill < n:
            index = np.arange(self.seen + fill, self.seen + n)
            slots = self.rng.integers(0, index + 1)
            out.extend((int(i) + fill, int(s)) for i, s in enumerate(slots) if s < self.k)
        self.seen += n
        return out

    def put(self, slot: int, index: int, item: Any) -> None:
        if slot == len(self.slots):
            self.slots.append((index, item))
        else:
            self.slots[slot] = (index, item)

    def items(self) -> list[Any]:
        """The sample in stream order."""
        return [item for _, item in sorted(self.slots, key=lambda s: s[0])]


def sample_rows(source: Source, k: int, seed: int = 0) -> tuple[list[dict[str, Any]], int]:
    """(at most `k` of the input's rows, their model columns only, in input order; the
    input's row count)."""
    res = Reservoir(k, seed)
    for shard in source.shards:
        for batch, raw in readers.batches(shard):
            names = batch.schema.names
            if not set(INPUT_COLUMNS) & set(names):
                raise InputError(f"{shard.path}: no 'prompt', 'messages' or 'prompt_token_ids' column (columns: {names})")
            base = res.seen
            keep = res.offer(batch.num_rows)
            if not keep:
                continue
            model = [n for n in MODEL_COLUMNS if n in names]
            offsets = sorted({i for i, _ in keep})
            if raw is not None:
                rows = {i: {n: raw[i][n] for n in model if n in raw[i]} for i in offsets}
            else:
                picked = batch.select(model).take(offsets).to_pylist()
                rows = dict(zip(offsets, picked))
            for i, slot in keep:
                res.put(slot, base + i, rows[i])
    return res.items(), res.seen


@dataclass
class Tokenized:
    workload: Workload
    errors: int = 0
    """Sampled rows the ingestor would refuse (left out of the workload)."""
    reasons: dict[str, int] = field(default_factory=dict)


def tokenize(rows: list[dict[str, Any]], model: str, sampling: SamplingSpec, chat: dict[str, Any] | None = None,
             name: str = "input") -> Tokenized:
    """The rows as a workload (see the module docstring)."""
    from prefixflow.shared.prefix.tokenize import load_tokenizer
    from prefixflow.shared.wire.sampling import row_sampling

    chat = chat or {}
    tok = load_tokenizer(model)
    renderer = None
    ids: list[list[int] | None] = [None] * len(rows)
    outs = np.zeros(len(rows), dtype=np.int32)
    texts: dict[int, str] = {}
    chats: dict[int, str] = {}
    reasons: dict[str, int] = {}

    def refuse(why: str) -> None:
        reasons[why] = reasons.get(why, 0) + 1

    for i, row in enumerate(rows):
        try:
            own = row_sampling(sampling, row)
        except ValueError as exc:
            refuse(f"bad sampling: {str(exc)[:80]}")
            continue
        outs[i] = (own or sampling).max_tokens
        if row.get("prompt_token_ids") is not None:
            ids[i] = list(row["prompt_token_ids"]) if isinstance(row["prompt_token_ids"], (list, tuple)) else None
            if not ids[i] or pack_checked(ids[i]) is None:
                ids[i] = None
                refuse("bad prompt_token_ids")
        elif row.get("messages") is not None:
            if renderer is None:
                from prefixflow.services.ingestor.chat import renderer_for

                renderer = renderer_for(model)
            try:
                chats[i] = renderer.render(row["messages"], chat.get("chat_template", ""), chat.get("chat_template_kwargs"))
            except ValueError as exc:
                refuse(f"bad messages: {str(exc)[:80]}")
        elif isinstance(row.get("prompt"), str) and row["prompt"]:
            texts[i] = row["prompt"]
        else:
            refuse("no prompt")
    for found, special in ((texts, True), (chats, False)):
        if found:
            keys = list(found)
            for i, enc in zip(keys, tok.encode_batch_fast([found[k] for k in keys], add_special_tokens=special)):
                ids[i] = enc.ids
    keep = [i for i, row_ids in enumerate(ids) if row_ids]
    tokens = [pack_checked(ids[i]) for i in keep]
    lora = [rows[i].get("lora") or "" for i in keep]
    wl = Workload(name, tokens, outs[keep], None, {"sampled_rows": len(rows)}, lora if any(lora) else None)
    return Tokenized(wl, len(rows) - len(keep), reasons)
