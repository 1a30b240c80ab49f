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
Input columns do not travel with the results: a result names where its row's columns are
kept (`src`, `row`; `services/sink/inputs.py`), and the part takes them from there with
their exact Arrow types. Every part of a job is written against one schema, fixed by its
first part (read back from disk on a restart), so no part is ever rewritten.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog

from shared.wire.ids import IdSet
from shared.wire.messages import JobSpec, Result

log = structlog.get_logger()

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


def as_text(column: pa.ChunkedArray | pa.Array) -> pa.Array | pa.ChunkedArray:
    """A column as strings: a cast where Arrow has one, else JSON text per value."""
    try:
        return column.cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in column.to_pylist()], pa.string())


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
    }
    out = {name: pa.array(values, OUTPUT_TYPES[name]) for name, values in cols.items()}
    if embed_type is not None:
        out["embedding"] = pa.array([r.embedding or None for r in results], embed_type)
    return out


def conform(table: pa.Table, schema: pa.Schema) -> tuple[pa.Table, list[str]]:
    """`table` with exactly the columns of `schema`, in its order and types: missing
    columns null, a value that does not cast to a string column as JSON text, any other
    that does not cast null. Returns the table and what had to give (for a log line)."""
    arrays, notes = [], []
    for f in schema:
        if f.name not in table.column_names:
            arrays.append(pa.nulls(table.num_rows, f.type))
            continue
        col = table.column(f.name)
        if col.type == f.type:
            arrays.append(col)
            continue
        try:
            arrays.append(col.cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            if pa.types.is_string(f.type):
                arrays.append(as_text(col))
            else:
                notes.append(f"{f.name}: {col.type} does not fit {f.type} (null)")
                arrays.append(pa.nulls(table.num_rows, f.type))
    dropped = [n for n in table.column_names if schema.get_field_index(n) < 0]
    if dropped:
        notes.append(f"columns not in the job's schema dropped: {dropped}")
    return pa.Table.from_arrays(arrays, schema=schema), notes


@dataclass
class PartStats:
    """What one written part held (the sink's metrics)."""

    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Error text -> rows."""
    replicas: dict[str, list[int]] = field(default_factory=dict)
    """Replica -> [prompt, cached, output tokens] of its ok rows."""

    @classmethod
    def of(cls, results: list[Result]) -> PartStats:
        stats = cls()
        for r in results:
            if r.error is not None:
                stats.errors[r.error] = stats.errors.get(r.error, 0) + 1
                continue
            stats.ok += 1
            acc = stats.replicas.get(r.replica)
            if acc is None:
                acc = stats.replicas[r.replica] = [0, 0, 0]
            acc[0] += r.prompt_tokens
            acc[1] += r.cached_tokens
            acc[2] += r.output_tokens
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
        self.pending: list[tuple[Result, float | None]] = []
        """Results queued for the next part, with when they reached the results stream."""
        self.schema: pa.Schema | None = None
        """Every part's schema: fixed by the first part written (read back on a restart)."""
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
            if self.schema is None:
                self.schema = pq.read_schema(part).remove_metadata()

    def add(self, result: Result, finished_at: float | None = None) -> bool:
        """Queue a result for the next part (`finished_at`: when it reached the results
        stream, for a result that does not say when it finished); False if this id was
        already taken."""
        # NOTE: ids compare as text (IdSet), so a restart that reads back ids a mixed-type
        # job wrote as strings still recognises a redelivered int id.
        if not self.seen.add(result.id):
            return False
        self.pending.append((result, finished_at))
        self.done = False
        return True

    def sources(self) -> set[int]:
        """The blobs of input columns the queued rows need (`InputCache.fetch`)."""
        return {r.src for r, _ in self.pending if r.src >= 0}

    def drop_pending(self) -> None:
        """Forget queued rows that could not be written (their messages are redelivered)."""
        for r, _ in self.pending:
            self.seen.discard(r.id)
        self.pending = []

    def flush(self, inputs: Callable[[int], pa.Table | None] | None = None) -> int:
        """Write the queued rows as one part, their input columns taken from
        `inputs(src)` (a blob's record batch, None if there is none); returns the number
        written."""
        if not self.pending:
            return 0
        results = [r for r, _ in self.pending]
        table = self._to_table(results, [f for _, f in self.pending], inputs or (lambda src: None))
        final = self.dir / f"part-{self.next_part:06d}.parquet"
        tmp = final.with_suffix(".tmp")
        pq.write_table(table, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.next_part += 1
        stats = self.last_part = PartStats.of(results)
        self.rows += len(results)
        self.errors += len(results) - stats.ok
        for acc in stats.replicas.values():
            for i in range(3):
                self.tokens[i] += acc[i]
        self.pending = []
        return len(results)

    def _inputs(self, results: list[Result], inputs: Callable[[int], pa.Table | None]) -> pa.Table | None:
        """The input columns of each result's row, in the results' order (None: no row
        has any). Rows of one blob are taken together; rows with none get nulls."""
        by_src: dict[int, list[int]] = {}
        for i, r in enumerate(results):
            by_src.setdefault(r.src, []).append(i)
        pieces, order = [], []
        names: dict[str, pa.DataType] = {}
        for src, idx in by_src.items():
            table = inputs(src) if src >= 0 else None
            if table is None:
                continue
            rows = pa.array([results[i].row for i in idx], pa.int64())
            if len(rows) and (pc.min(rows).as_py() < 0 or pc.max(rows).as_py() >= table.num_rows):
                log.error("input row out of range: its input columns are null", job=self.job, src=src)
                continue
            pieces.append(table.take(rows))
            order.extend(idx)
            for f in table.schema:
                names.setdefault(f.name, f.type)
        if not pieces:
            return None
        schema = pa.schema(list(names.items()))
        pieces = [conform(piece, schema)[0] for piece in pieces]
        have = set(order)
        missing = [i for i in range(len(results)) if i not in have]
        if missing:
            pieces.append(pa.Table.from_arrays([pa.nulls(len(missing), f.type) for f in schema], schema=schema))
            order.extend(missing)
        joined = pa.concat_tables(pieces)
        back = pa.array(sorted(range(len(order)), key=order.__getitem__), pa.int64())
        return joined.take(back)

    def _to_table(self, results: list[Result], finished: list[float | None], inputs: Callable[[int], pa.Table | None]) -> pa.Table:
        kept = self._inputs(results, inputs)
        embed_type = None
        if self.schema is not None and self.schema.get_field_index("embedding") >= 0:
            embed_type = self.schema.field("embedding").type
        elif any(r.embedding for r in results):  # embed jobs: fixed-size float32
            embed_type = pa.list_(pa.float32(), len(next(r.embedding for r in results if r.embedding)))
        generated = generated_columns(results, finished, embed_type)
        ids = [r.id for r in results]
        columns: dict[str, pa.Array | pa.ChunkedArray] = {}
        if kept is not None and "id" in kept.column_names and all(r.src >= 0 for r in results):
            columns["id"] = kept.column("id")  # the input's own id column, its type kept
        elif all(isinstance(i, int) for i in ids):
            columns["id"] = pa.array(ids, pa.int64())
        else:
            columns["id"] = pa.array([str(i) for i in ids], pa.string())
        if kept is not None:
            for name in kept.column_names:
                if name != "id":
                    columns[input_column(name)] = kept.column(name)
        columns.update(generated)
        table = pa.table(columns)
        if self.schema is None:
            self.schema = table.schema
            return table
        table, notes = conform(table, self.schema)
        if notes:
            log.warning("part conformed to the job's schema", job=self.job, notes=notes)
        return table

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
