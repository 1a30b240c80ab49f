"""A job's Parquet output: dedupe by id, part files, summary. No NATS here.

Layout of a job's `out_dir`:
    part-000000.parquet, part-000001.parquet, ...   every row exactly once
    _summary.json                                     written when the job completes
    _report/                                          `prefixflow report` (plots)
(`pyarrow.parquet.read_table(out_dir)` skips names starting with `_`.)

Parts are written to a temporary name, fsynced and renamed, so a crash never leaves a
torn part. On (re)start the ids already in the parts are loaded, so a redelivered result
or a resumed job never writes a row twice.

Columns of a row: `id`, every input column, then the generated columns (`OUTPUT_TYPES`).
No input value is ever overwritten: an input column named like a generated column is kept
as `input_<name>` (`output` -> `input_output`). That makes `input_output` a name the sink
uses, so an input column already called `input_output` is kept as `input_input_output`,
and so on. The new name depends on the column's name alone, so an input column lands in
the same output column in every row, part and restart, whatever other columns a row has.
"""

from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shared.wire.ids import IdSet
from shared.wire.messages import JobSpec, Result, columns_decoder

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
}
"""Generated columns. `outputs` lists every completion of a prompt sampled with n > 1
(null otherwise; `output` is the first); `logprobs` holds per generated token of the first
completion its logprob and the top alternatives (null unless asked for). `bucket` is the id of the bucket the prompt was released in;
`started_at` / `finished_at` are Unix times the engine started and finished it
(`finished_at` falls back to when the result reached the results stream; both null where
unknown). `prefixflow report` plots the job over time from them."""


def _stringify_mixed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    mixed = set()
    for name in rows[0] if rows else ():
        kinds = {type(r[name]) for r in rows if r[name] is not None}
        if len(kinds) > 1:
            mixed.add(name)
        elif kinds & {list, dict}:
            # Nested values of one Python type can still disagree inside (a chat
            # `messages` column whose `content` is a string in one row, a list of parts
            # in another): such a column is written as JSON text.
            try:
                pa.array([r[name] for r in rows])
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                mixed.add(name)
    return [{k: (_json_if_nested(v) if k in mixed and v is not None else v) for k, v in r.items()} for r in rows]


def as_text(column: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """A column as strings: a cast where Arrow has one, else JSON text per value (nested
    input columns whose shape changes between rows, say a per-row `sampling` object with
    different keys, or `messages` that is sometimes not a list)."""
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string())


def _json_if_nested(v: Any) -> Any:
    return json.dumps(v, default=str) if isinstance(v, dict | list) else str(v)


class OutsideRoot(ValueError):
    """A job's `out_dir` resolves outside the sink's output root."""


def confine(root: str | Path, out_dir: str) -> Path:
    """Where to write a job whose spec says `out_dir`: the fully resolved directory
    (`..` folded, every symlink followed, a relative path taken under `root`), which
    must be `root` or inside it; else `OutsideRoot` with the reason.

    NOTE: this checks the path when the job is opened; a directory swapped for a symlink
    afterwards by someone with write access under the root is not caught (keep the root
    writable by the sink only)."""
    real_root = Path(os.path.realpath(root))
    if not out_dir or "\x00" in out_dir:
        raise OutsideRoot(f"invalid out_dir {out_dir!r}")
    path = Path(out_dir)
    real = Path(os.path.realpath(path if path.is_absolute() else real_root / path))
    if not real.is_relative_to(real_root):
        raise OutsideRoot(
            f"out_dir {out_dir!r} resolves to {str(real)!r}, outside the sink's output root "
            f"{str(real_root)!r} (--out-root / PFX_OUT_ROOT): job refused, nothing written"
        )
    return real


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


def result_row(r: Result, finished_at: float | None = None) -> dict[str, Any]:
    """The output row of a result; `finished_at` is used when the result has none."""
    row: dict[str, Any] = {"id": r.id}
    if r.columns:
        row.update((input_column(name), value) for name, value in columns_decoder.decode(r.columns).items())
    row.update(
        output=None if r.error else r.output,
        finish_reason=r.finish_reason.name.lower(),
        prompt_tokens=r.prompt_tokens,
        cached_tokens=r.cached_tokens,
        output_tokens=r.output_tokens,
        replica=r.replica or None,
        error=r.error,
        bucket=r.bucket or None,
        started_at=r.started_at or None,
        finished_at=r.finished_at or finished_at,
    )
    row["outputs"] = r.outputs or None
    row["logprobs"] = r.logprobs or None
    if r.embedding:  # embed jobs (a fixed-size float32 column; see `_to_table`)
        row["embedding"] = r.embedding
    return row


@dataclass
class PartStats:
    """What one written part held (the sink's metrics)."""

    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Error text -> rows."""
    replicas: dict[str, list[int]] = field(default_factory=dict)
    """Replica -> [prompt, cached, output tokens] of its ok rows."""

    @classmethod
    def of(cls, rows: list[dict[str, Any]]) -> PartStats:
        stats = cls()
        for r in rows:
            error = r["error"]
            if error is not None:
                stats.errors[error] = stats.errors.get(error, 0) + 1
                continue
            stats.ok += 1
            acc = stats.replicas.get(r["replica"] or "")
            if acc is None:
                acc = stats.replicas[r["replica"] or ""] = [0, 0, 0]
            acc[0] += r["prompt_tokens"]
            acc[1] += r["cached_tokens"]
            acc[2] += r["output_tokens"]
        return stats


class JobOutput:
    def __init__(self, job: str, out_dir: str | Path) -> None:
        self.job = job
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.seen = IdSet()
        self.rows = 0
        self.errors = 0
        self.tokens = [0, 0, 0]
        """Prompt, cached and output tokens of the ok rows on disk (the job's progress)."""
        self.last_part: PartStats | None = None
        """What the last part written held."""
        self.pending: list[dict[str, Any]] = []
        self.types: dict[str, pa.DataType | None] = {}
        """Column -> Arrow type, stable across parts (a part where a column is all null
        still gets its type, so the directory reads as one table)."""
        self.part_columns: set[str] | None = None
        """Columns every part on disk has (None: not read yet); see `_backfill`."""
        self.next_part = 0
        self.done = False
        """`_summary.json` is written and no row was queued since: the job need not be
        checked again (the sink forgets done jobs first when it has too many open)."""
        self._load_existing()

    def parts(self) -> list[Path]:
        return sorted(self.dir.glob("part-*.parquet"))

    def _load_existing(self) -> None:
        for part in self.parts():
            table = pq.read_table(part, columns=["id", "error", "prompt_tokens", "cached_tokens", "output_tokens"])
            self.seen.update(table.column("id").to_pylist())
            self.rows += table.num_rows
            self.errors += table.num_rows - pc.sum(pc.is_null(table.column("error"))).as_py()
            ok = table.filter(pc.is_null(table.column("error")))
            for i, col in enumerate(("prompt_tokens", "cached_tokens", "output_tokens")):
                self.tokens[i] += int(pc.sum(ok.column(col)).as_py() or 0)
            self.next_part = max(self.next_part, int(part.stem.split("-")[1]) + 1)
            for f in pq.read_schema(part):
                if self.types.get(f.name) is None and not pa.types.is_null(f.type):
                    self.types[f.name] = f.type
                self.types.setdefault(f.name, None)

    def add(self, result: Result, finished_at: float | None = None) -> bool:
        """Queue a result for the next part (`finished_at`: when it reached the results
        stream, for a result that does not say when it finished); False if this id was
        already taken."""
        # NOTE: ids compare as text (IdSet), so a restart that reads back ids a mixed-type
        # job wrote as strings still recognises a redelivered int id.
        if not self.seen.add(result.id):
            return False
        row = result_row(result, finished_at)
        for name in row:
            self.types.setdefault(name, OUTPUT_TYPES.get(name))
        self.pending.append(row)
        self.done = False
        return True

    def drop_pending(self) -> None:
        """Forget queued rows that could not be written (their messages are redelivered)."""
        for row in self.pending:
            self.seen.discard(row["id"])
        self.pending = []

    def flush(self) -> int:
        """Write the queued rows as one part; returns the number written."""
        if not self.pending:
            return 0
        rows = self.pending
        table = self._to_table(rows)
        self._backfill(table.schema)
        final = self.dir / f"part-{self.next_part:06d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.next_part += 1
        stats = self.last_part = PartStats.of(rows)
        self.rows += len(rows)
        self.errors += len(rows) - stats.ok
        for acc in stats.replicas.values():
            for i in range(3):
                self.tokens[i] += acc[i]
        self.pending = []
        return len(rows)

    def _to_table(self, rows: list[dict[str, Any]]) -> pa.Table:
        aligned = [{n: r.get(n) for n in self.types} for r in rows]
        try:
            inferred = pa.Table.from_pylist(aligned)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Mixed Python types in a column (say int and str ids in one job): write the
            # part with those columns as strings rather than leave the rows stuck.
            inferred = pa.Table.from_pylist(_stringify_mixed(aligned))
        fields = []
        for f in inferred.schema:
            known = self.types.get(f.name)
            if known is None:
                known = pa.string() if pa.types.is_null(f.type) else f.type
                if f.name == "embedding" and pa.types.is_list(f.type):  # embed jobs: fixed-size float32
                    dim = next(len(r["embedding"]) for r in aligned if r.get("embedding"))
                    known = pa.list_(pa.float32(), dim)
                self.types[f.name] = known
            fields.append(pa.field(f.name, known))
        try:
            return inferred.cast(pa.schema(fields))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            pass
        # A column changed type mid-job (say int ids, then a string id): make every such
        # column a string column, in this part and in the parts already written, so the
        # directory still reads as one table.
        for f in inferred.schema:
            known = self.types.get(f.name)
            if known is not None and known != f.type and not pa.types.is_null(f.type):
                self._promote_to_string(f.name)
        for i, f in enumerate(inferred.schema):
            if self.types.get(f.name) == pa.string() and f.type != pa.string():
                inferred = inferred.set_column(i, pa.field(f.name, pa.string()), as_text(inferred.column(f.name)))
        fields = [pa.field(f.name, self.types.get(f.name) or f.type) for f in inferred.schema]
        return inferred.cast(pa.schema(fields))

    def _backfill(self, schema: pa.Schema) -> None:
        """Give the parts already written every column this part adds (all null), so the
        directory reads as one table: pyarrow takes a directory's schema from its first
        part, and a column first seen later (chat `messages` after a part of error rows, a
        per-row `choice`) would otherwise vanish from `read_table(OUT)`. Rare: once per new
        column."""
        names = set(schema.names)
        parts = self.parts()
        if self.part_columns is None:  # first flush of this writer: what is on disk
            self.part_columns = set.intersection(*(set(pq.read_schema(p).names) for p in parts)) if parts else names
        if not parts or names <= self.part_columns:
            self.part_columns = names if not parts else self.part_columns
            return
        for part in parts:
            have = pq.read_schema(part)
            missing = [f for f in schema if have.get_field_index(f.name) < 0]
            if not missing:
                continue
            table = pq.read_table(part)
            for f in missing:
                table = table.append_column(f, pa.nulls(table.num_rows, f.type))
            tmp = part.with_suffix(".tmp")
            pq.write_table(table, tmp)
            os.replace(tmp, part)
        self.part_columns = names  # every part now has them (each part has every known column)

    def _promote_to_string(self, name: str) -> None:
        if self.types.get(name) == pa.string():
            return
        self.types[name] = pa.string()
        for part in self.parts():
            table = pq.read_table(part)
            if name in table.column_names and table.schema.field(name).type != pa.string():
                i = table.column_names.index(name)
                table = table.set_column(i, pa.field(name, pa.string()), as_text(table.column(name)))
                tmp = part.with_suffix(".tmp")
                pq.write_table(table, tmp)
                os.replace(tmp, part)

    def summarize(self, spec: JobSpec, finished_at: float | None = None) -> dict[str, Any]:
        """Totals over every part, overall and per replica; written to `_summary.json`.
        Parts are read one at a time (memory stays bounded by a part, not the job)."""
        finished_at = finished_at or time.time()
        wall = max(finished_at - spec.created_at, 1e-9) if spec.created_at else None
        cols = ["error", "prompt_tokens", "cached_tokens", "output_tokens", "replica"]
        overall = [0, 0, 0, 0, 0]  # rows, errors, prompt, cached, output tokens
        per_replica: dict[str, list[int]] = {}
        first_finished: float | None = None
        for part in self.parts():
            has_times = "finished_at" in pq.read_schema(part).names
            t = pq.read_table(part, columns=cols + (["finished_at"] if has_times else []))
            _add_totals(overall, t)
            if "finished_at" in t.column_names:
                times = t.column("finished_at")
                done = pc.min(pc.filter(times, pc.greater_equal(times, spec.created_at or 0))).as_py()
                if done is not None:
                    first_finished = done if first_finished is None else min(first_finished, done)
            for name in pc.unique(t.column("replica")).to_pylist():
                if name:
                    _add_totals(per_replica.setdefault(name, [0, 0, 0, 0, 0]), t.filter(pc.equal(t.column("replica"), name)))

        def totals(acc: list[int]) -> dict[str, Any]:
            rows, errors, prompt, cached, output = acc
            out = dict(
                rows=rows,
                errors=errors,
                prompt_tokens=prompt,
                cached_tokens=cached,
                output_tokens=output,
                prefix_cache_hit_rate=round(cached / prompt, 4) if prompt else 0.0,
            )
            if wall and rows:
                out["output_tokens_per_second"] = round(output / wall, 2)
                out["total_tokens_per_second"] = round((prompt + output) / wall, 2)
            return out

        summary = dict(job=spec.job, **totals(overall), wall_seconds=round(wall, 3) if wall else None)
        summary["created_at"] = spec.created_at or None
        if spec.created_at and first_finished is not None and first_finished >= spec.created_at:
            # When an engine finished the first prompt of this run (rows carry `finished_at`);
            # the row lands within the sink's --flush-seconds. `prefixflow bench batching` reports it.
            summary["first_result_seconds"] = round(first_finished - spec.created_at, 3)
        if spec.model:
            summary["model"] = spec.model
        summary["finished_at"] = round(finished_at, 3)
        summary["replicas"] = {name: totals(per_replica[name]) for name in sorted(per_replica)}
        return summary

    def write_summary(self, spec: JobSpec, finished_at: float | None = None) -> dict[str, Any]:
        summary = self.summarize(spec, finished_at)
        tmp = self.dir / "_summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        os.replace(tmp, self.dir / "_summary.json")
        self.done = True
        return summary


def _add_totals(acc: list[int], t: pa.Table) -> None:
    """Add a table's rows, error rows and token sums of its ok rows to `acc`."""
    ok = t.filter(pc.is_null(t.column("error")))
    acc[0] += t.num_rows
    acc[1] += t.num_rows - ok.num_rows
    for i, col in enumerate(("prompt_tokens", "cached_tokens", "output_tokens"), start=2):
        acc[i] += int(pc.sum(ok.column(col)).as_py() or 0)
