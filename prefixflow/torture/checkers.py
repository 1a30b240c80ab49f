"""The torture harness's checkers (Jepsen's, on what a job wrote): pure functions of a
round's dataset and what came out, each returning the violations it found (empty: the
invariant holds).

- `check_ids`: every input id exactly once, as a generated row or an error row; the
  bad rows and malformed messages as error rows; no id that was never sent.
- `check_columns`: every input column byte-exact against the input: a file's typed
  columns keep their Arrow type and value; a widened column (raw and JSONL rows) holds
  each value's canonical text (docs/schema-growth.md, `prefixflow.shared.widening.text`)
  or, for int + float, the same number; a non-null value is never nulled.
- `check_exit`: the command's exit code and the job's status tell the same story
  (0 done with every row; 1 failed; 2 refused; 75 paused).
- `check_summary`: `_summary.json` counts the rows and error rows that are on disk.

`read_output` reads OUT/ the way a user does after the job (every part file), each id
typed as it was given (a text id column's footer says which ids were integers).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from prefixflow.shared.widening import text as canonical_text
from prefixflow.torture.datasets import Dataset, id_key

SHOWN = 5
"""Examples named per violation (the rest counted)."""


@dataclass(frozen=True)
class Violation:
    invariant: str
    """`ids`, `columns`, `exit`, `summary`, `alive`, `clean-job`, `refusal`, `crash`, `resume`
    (a job paused for its disk, run again once the space is back, must complete)."""
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def _some(items: list[Any]) -> str:
    shown = ", ".join(repr(x)[:80] for x in items[:SHOWN])
    return shown + (f" ... ({len(items)} in all)" if len(items) > SHOWN else "")


# -- reading OUT/ --------------------------------------------------------------------------


@dataclass
class Output:
    rows: list[dict[str, Any]]
    """Every row on disk, its `id` as given (int or str)."""
    types: dict[str, pa.DataType]
    """Each column's type (the last file's: after the job every file has the final one)."""


def read_output(out: Path) -> Output:
    import pyarrow.parquet as pq

    from prefixflow.services.sink.growth import int_id_mask, typed_ids

    rows: list[dict[str, Any]] = []
    types: dict[str, pa.DataType] = {}
    for path in sorted(out.glob("part-*.parquet")):
        table = pq.read_table(path)
        types.update({f.name: f.type for f in table.schema})
        part = table.to_pylist()
        if "id" in table.column_names:
            ids = typed_ids(table.column("id"), int_id_mask(pq.read_schema(path), table.num_rows))
            for row, rid in zip(part, list(ids)):
                row["id"] = rid.item() if hasattr(rid, "item") else rid
        rows.extend(part)
    return Output(rows, types)


# -- ids -------------------------------------------------------------------------------------


def check_ids(ds: Dataset, out: Output) -> list[Violation]:
    sent = Counter(ds.ids())
    got = Counter(id_key(r.get("id")) for r in out.rows)
    found = []
    missing = [k[1] for k in sent if got[k] == 0]
    doubled = [k[1] for k in sent if got[k] > 1]
    unknown = [k[1] for k in got if k not in sent]
    if missing:
        found.append(Violation("ids", f"{len(missing)} ids never came out: {_some(missing)}"))
    if doubled:
        found.append(Violation("ids", f"{len(doubled)} ids came out more than once: {_some(doubled)}"))
    if unknown:
        found.append(Violation("ids", f"{len(unknown)} ids came out that were never sent: {_some(unknown)}"))
    errors = {id_key(r.get("id")): r.get("error") for r in out.rows}
    must_fail = ds.bad | {id_key(i) for i, _ in ds.malformed}
    not_failed = [k[1] for k in must_fail if k in errors and errors[k] is None]
    if not_failed:
        found.append(Violation("ids", f"{len(not_failed)} bad rows came out without an error: {_some(not_failed)}"))
    failed = [f"{k[1]!r}: {errors[k]}" for k in errors if errors[k] is not None and k not in must_fail and k in sent]
    if failed:
        found.append(Violation("ids", f"{len(failed)} good rows came out as error rows: {_some(failed)}"))
    return found


# -- columns -----------------------------------------------------------------------------------


def _exact(a: Any, b: Any) -> bool:
    """Equal as values, byte for byte where floats are concerned (NaN is NaN, -0.0 is not 0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        return all(_exact(a.get(k), b.get(k)) for k in keys)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_exact(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def typed_value(value: Any, type_: pa.DataType) -> Any:
    """`value` as a reader gets it back from a column of `type_` (an int as a timestamp...)."""
    return pa.array([value], type=type_).to_pylist()[0]


def same_value(given: Any, got: Any, type_: pa.DataType | None, declared: pa.DataType | None) -> bool:
    """Whether `got` (read from a column of `type_`) is `given` kept exactly: the declared
    type's value for a typed input column; else (raw and JSONL rows: one widening rule)
    the value itself, the same number in a float64 column, or its canonical text in a
    text column."""
    if declared is not None:
        return type_ is not None and type_.equals(declared) and _exact(typed_value(given, declared), got)
    if given is None or got is None:
        return given is None and got is None
    if _exact(given, got):
        return True
    if type_ is not None and (pa.types.is_string(type_) or pa.types.is_large_string(type_)):
        return got == canonical_text(given)
    if isinstance(given, int) and not isinstance(given, bool) and isinstance(got, float):
        return float(given) == got
    if isinstance(given, dict) and isinstance(got, dict):  # one shape: absent fields are null
        return all(same_value(given.get(k), got.get(k), None, None) for k in set(given) | set(got))
    return False


MODEL_ONLY = ("prompt_token_ids",)
"""Input columns the output does not keep (docs)."""


def check_columns(ds: Dataset, out: Output) -> list[Violation]:
    by_id = {id_key(r.get("id")): r for r in out.rows}
    declared = {f.name: f.type for f in ds.schema} if ds.schema is not None else {}
    wrong: list[str] = []
    for row in ds.rows:
        got = by_id.get(id_key(row["id"]))
        if got is None:
            continue  # check_ids says so
        for name, value in row.items():
            if name == "id" or name in MODEL_ONLY:
                continue
            if name not in out.types:
                if value is not None:
                    wrong.append(f"column {name!r} missing (id {row['id']!r})")
                continue
            if not same_value(value, got.get(name), out.types[name], declared.get(name)):
                wrong.append(f"id {row['id']!r} column {name!r}: sent {_short(value)}, got {_short(got.get(name))} "
                             f"({out.types[name]})")
    if wrong:
        return [Violation("columns", f"{len(wrong)} values not kept exactly: {_some(wrong)}")]
    return []


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else f"{text[:40]}...({len(text)} chars)"


# -- exit code, status, summary -------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What the command said and what the cluster's status said, after it."""

    code: int
    stderr: str = ""
    done: bool = False
    failed: bool = False
    paused: bool = False
    rows: int = 0


def check_exit(outcome: Outcome, expected_rows: int, *, refused: bool = False) -> list[Violation]:
    """The exit code agrees with the job's status (`refused`: the round expects exit 2)."""
    c, tail = outcome.code, outcome.stderr.strip()[-300:]
    if refused:
        return [] if c == 2 else [Violation("refusal", f"another input into a job's --out: exit {c}, not 2: {tail}")]
    if c == 0:
        if not outcome.done or outcome.failed or outcome.rows != expected_rows:
            return [Violation("exit", f"exit 0 but the status says done={outcome.done} failed={outcome.failed} "
                                      f"rows={outcome.rows} of {expected_rows}")]
        return []
    if c == 1:
        return [] if outcome.failed else [Violation("exit", f"exit 1 but the job is not failed: {tail}")]
    if c == 75:
        return [] if "paused" in outcome.stderr else [Violation("exit", f"exit 75 without saying paused: {tail}")]
    return [Violation("exit", f"exit code {c}: {tail}")]


def tree_digest(out: Path) -> str:
    """A digest of every file under `out` (names and bytes): "the output is untouched"."""
    h = hashlib.sha256()
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(out)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def check_summary(out_dir: Path, out: Output) -> list[Violation]:
    try:
        summary = json.loads((out_dir / "_summary.json").read_text())
    except (OSError, ValueError) as exc:
        return [Violation("summary", f"no readable _summary.json: {exc}")]
    errors = sum(r.get("error") is not None for r in out.rows)
    if summary.get("rows") != len(out.rows) or summary.get("errors") != errors:
        return [Violation("summary", f"_summary.json says {summary.get('rows')} rows ({summary.get('errors')} errors), "
                                     f"the files hold {len(out.rows)} ({errors})")]
    return []
