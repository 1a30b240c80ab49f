"""The columns of a job's output rows: the generated ones (`OUTPUT_TYPES`) and where an
input column lands (`input_column`).

Columns of a row: `id`, every input column, then the generated columns (`OUTPUT_TYPES`).
A job's schema grows as its rows bring columns and values (`prefixflow/shared/widening.py`,
`prefixflow/services/sink/writer.py`): nothing is dropped or nulled to fit.
No input value is ever overwritten: an input column named like a generated column is kept
as `input_<name>` (`output` -> `input_output`). That makes `input_output` a name the sink
uses, so an input column already called `input_output` is kept as `input_input_output`,
and so on. The new name depends on the column's name alone, so an input column lands in
the same output column in every row, part and restart, whatever other columns a row has.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import pyarrow as pa

from prefixflow.shared.wire.messages import Result

OUTPUT_TYPES = {
    "output": pa.string(),
    "finish_reason": pa.string(),
    "prompt_tokens": pa.int64(),
    "cached_tokens": pa.int64(),
    "output_tokens": pa.int64(),
    "replica": pa.string(),
    "error": pa.string(),
    "bucket": pa.string(),
    "started_at": pa.float64(),
    "finished_at": pa.float64(),
    "outputs": pa.list_(pa.string()),
    "logprobs": pa.list_(pa.struct([
        ("token", pa.string()), ("logprob", pa.float64()),
        ("top", pa.list_(pa.struct([("token", pa.string()), ("logprob", pa.float64())]))),
    ])),
    "dedupe": pa.string(),
}
"""Generated columns. `outputs` lists every completion of a prompt sampled with n > 1
(null otherwise; `output` is the first); `logprobs` holds per generated token of the first
completion its logprob and the top alternatives (null unless asked for). `bucket` is the id of the bucket the prompt was released in;
`started_at` / `finished_at` are Unix times the engine started and finished it
(`finished_at` falls back to when the result reached the results stream; both null where
unknown). `prefixflow report` plots the job over time from them. `dedupe` says how a row
that was not generated on its own got its output (`prefixflow/services/engine_worker/dedupe.py`):
`copy` (an identical deterministic row's output), `merged` (one completion of a request
merged, `n`, with identical sampled rows); null: its own request."""

DEDUPE_NAMES = {1: "copy", 2: "merged"}
"""`Result.dedupe` -> the `dedupe` column's value."""


def as_text(column: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """A column as strings: a cast where Arrow has one, else JSON text per value."""
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string())


INPUT_PREFIX = "input_"


@functools.lru_cache(maxsize=4096)
def input_column(name: str) -> str:
    """The output column of input column `name`: `name` itself, unless it is a generated
    column's name, or that name behind one or more `input_` prefixes (the names the
    renaming itself uses); then `input_<name>`. One-to-one, so no two input columns meet."""
    base = name
    while base.startswith(INPUT_PREFIX):
        base = base[len(INPUT_PREFIX) :]
    return INPUT_PREFIX + name if base in OUTPUT_TYPES else name


def generated_columns(results: list[Result], finished: list[float | None], embed_type: pa.DataType | None) -> dict[str, pa.Array]:
    """The generated columns of these results, typed as `OUTPUT_TYPES` declares (and
    `embedding` as `embed_type`, in embed jobs)."""
    cols: dict[str, list[Any]] = {
        "output": [None if r.error else r.output for r in results],
        "finish_reason": [r.finish_reason.name.lower() for r in results],
        "prompt_tokens": [r.prompt_tokens for r in results],
        "cached_tokens": [r.cached_tokens for r in results],
        "output_tokens": [r.output_tokens for r in results],
        "replica": [r.replica or None for r in results],
        "error": [r.error for r in results],
        "bucket": [r.bucket or None for r in results],
        "started_at": [r.started_at or None for r in results],
        "finished_at": [r.finished_at or f for r, f in zip(results, finished)],
        "outputs": [r.outputs or None for r in results],
        "logprobs": [r.logprobs or None for r in results],
        "dedupe": [DEDUPE_NAMES.get(r.dedupe) for r in results],
    }
    out = {name: pa.array(values, OUTPUT_TYPES[name]) for name, values in cols.items()}
    if embed_type is not None:
        out["embedding"] = pa.array([r.embedding or None for r in results], embed_type)
    return out
