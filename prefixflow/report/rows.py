"""A job's output rows as the report reads them (`prefixflow/report/job_report.py`): only the
columns it needs, one row group at a time, and above `SAMPLE_ROWS` rows a seeded uniform
sample, so a report of any job size takes seconds and bounded memory."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prefixflow.shared import outputs
from prefixflow.shared.outcomes import usage_error
from prefixflow.shared.outputs import is_output_uri

COLUMNS = ("id", "replica", "error", "prompt_tokens", "cached_tokens", "output_tokens", "finished_at", "started_at", "bucket")


SAMPLE_ROWS = 20_000
"""Most output rows the report reads in full (`--sample-rows`): above it, a seeded uniform
sample of this many rows feeds the plots and prefix groups (tokenizing), and the figures
say so; the summary's totals still cover every row."""
SAMPLE_SEED = 0
DICTIONARY_COLUMNS = ("replica", "error", "bucket")
PROMPT_BYTES = 64 * 1024 * 1024
"""A sampled report reads `prompt` (for the prefix groups) only from random row groups
holding about this many bytes of it (uncompressed, from the footers): the sampled rows
of the other row groups have no prompt."""


@dataclass
class JobRows:
    """A job's output, as the report needs it (every row, or a sample: `total` > rows)."""

    out_dir: Path
    table: pa.Table
    summary: dict[str, Any] | None
    t0: float
    """Job start (Unix time): the summary's `created_at`, else the earliest row time."""
    t1: float
    """Job end: the summary's `finished_at`, else the latest finish."""
    notes: list[str] = field(default_factory=list)
    total: int = 0
    """Rows in the output (`table` holds all of them, or a sample)."""
    parts: list[Path] = field(default_factory=list)

    @property
    def job(self) -> str:
        return (self.summary or {}).get("job") or self.out_dir.name

    @property
    def wall(self) -> float:
        return max(self.t1 - self.t0, 1e-6)

    @property
    def scale(self) -> float:
        """Output rows per row of `table` (1 unless sampled): sums over the sample times this."""
        return self.total / self.table.num_rows if self.table.num_rows else 1.0

    @property
    def sampled(self) -> bool:
        return self.total > self.table.num_rows

    def replicas(self) -> list[str]:
        names = pc.unique(self.table.column("replica")).to_pylist()
        return sorted(n for n in names if n)

    def ok(self) -> pa.Table:
        return self.table.filter(pc.is_null(self.table.column("error")))


def _row_groups(parts: list[Path]):
    """(file, row group index, rows) of every row group of `parts`, from the footers only."""
    for part in parts:
        meta = pq.ParquetFile(part).metadata
        for i in range(meta.num_row_groups):
            yield part, i, meta.row_group(i).num_rows


def _prompt_groups(parts: list[Path], seed: int, budget: int = PROMPT_BYTES) -> set[tuple[Path, int]]:
    """Random row groups whose `prompt` columns hold about `budget` bytes (at least one)."""
    sized = []
    for part in parts:
        meta = pq.ParquetFile(part).metadata
        names = [meta.schema.column(j).name for j in range(meta.num_columns)]
        if "prompt" not in names:
            continue
        col = names.index("prompt")
        sized += [((part, i), meta.row_group(i).column(col).total_uncompressed_size) for i in range(meta.num_row_groups)]
    chosen: set[tuple[Path, int]] = set()
    used = 0
    for k in np.random.default_rng(seed + 1).permutation(len(sized)):
        if chosen and used + sized[k][1] > budget:
            break
        chosen.add(sized[k][0])
        used += sized[k][1]
    return chosen


def _read_parts(parts: list[Path], columns: tuple[str, ...], keep: np.ndarray | None = None,
                prompts_from: set[tuple[Path, int]] | None = None) -> pa.Table:
    """`columns` of the rows of `parts` (those at the sorted global row numbers `keep`, or
    all), one row group at a time, so memory holds one row group and the kept rows;
    `prompt` only from the row groups `prompts_from` (None: all)."""
    tables = []
    offset = 0
    for part, i, n in _row_groups(parts):
        lo, hi = (np.searchsorted(keep, offset), np.searchsorted(keep, offset + n)) if keep is not None else (0, n)
        offset += n
        if hi <= lo:
            continue
        # NOTE: strings as dictionaries (not materialized for the rows the sample skips: 2x faster)
        f = pq.ParquetFile(part, read_dictionary=[c for c in DICTIONARY_COLUMNS if c in columns])
        names = set(f.schema_arrow.names)
        if prompts_from is not None and (part, i) not in prompts_from:
            names.discard("prompt")
        t = f.read_row_group(i, columns=[c for c in columns if c in names])
        if keep is not None:
            t = t.take(pa.array(keep[lo:hi] - (offset - n)))
        for c in DICTIONARY_COLUMNS:
            if c in t.column_names and pa.types.is_dictionary(t.schema.field(c).type):
                t = t.set_column(t.column_names.index(c), c, t.column(c).cast(t.schema.field(c).type.value_type))
        for c in columns:
            if c not in names:
                typ = pa.float64() if c.endswith("_at") else pa.int64() if c.endswith("_tokens") else pa.string()
                t = t.append_column(c, pa.nulls(t.num_rows, typ))
        tables.append(t.select(list(columns)))
    if not tables:
        return pa.table({c: pa.nulls(0) for c in columns})
    return pa.concat_tables(tables, promote_options="permissive")


def output_files(out_dir: str | Path) -> tuple[list[Any], dict[str, Any] | None]:
    """A job output's Parquet files (paths, or open files of an object store: the ones
    its `_manifest.json` names) and its summary (None: not written yet)."""
    if is_output_uri(str(out_dir)):
        fs, base = outputs.filesystem(str(out_dir))
        return [fs.open_input_file(p) for p in outputs.committed_files(str(out_dir))], outputs.read_json(
            fs, f"{base}/_summary.json")
    out_dir = Path(out_dir)
    summary_path = out_dir / "_summary.json"
    return sorted(out_dir.glob("part-*.parquet")), json.loads(summary_path.read_text()) if summary_path.exists() else None


def load(out_dir: str | Path, *, with_prompts: bool = True, sample: int = SAMPLE_ROWS, seed: int = SAMPLE_SEED) -> JobRows:
    """The output rows the report needs: every row, or a seeded uniform sample of `sample`
    rows when there are more (only the needed columns, one row group at a time)."""
    parts, summary = output_files(out_dir)
    out_dir = Path(out_dir)
    if not parts:
        raise usage_error(f"{out_dir}: no part-*.parquet files (is this a job's output directory?)")
    columns = COLUMNS
    if with_prompts and any("prompt" in pq.read_schema(p).names for p in parts):
        columns = (*COLUMNS, "prompt")
    total = sum(n for _, _, n in _row_groups(parts))
    keep = None
    if sample and total > sample:
        keep = np.sort(np.random.default_rng(seed).choice(total, size=sample, replace=False))
    prompts_from = _prompt_groups(parts, seed) if keep is not None and "prompt" in columns else None
    table = _read_parts(parts, columns, keep, prompts_from)
    notes = [] if summary else ["the job has no _summary.json yet (not finished): the report covers the rows written so far"]
    if keep is not None:
        notes.append(f"sampled {sample:,} of {total:,} rows (uniformly, seed {seed}) for the plots; "
                     "rates are scaled to every row, the totals above are the summary's")
    if prompts_from is not None:
        have = table.num_rows - table.column("prompt").null_count
        notes.append(f"prefix groups: from the {have:,} sampled rows in {len(prompts_from)} randomly chosen row groups "
                     f"(about {PROMPT_BYTES >> 20} MiB of prompts); group sizes are those of the sample")
    fin = table.column("finished_at")
    start = table.column("started_at")
    firsts = [x for x in (pc.min(fin).as_py(), pc.min(start).as_py()) if x is not None]
    t0 = (summary or {}).get("created_at") or (min(firsts) if firsts else 0.0)
    t1 = (summary or {}).get("finished_at") or pc.max(fin).as_py() or t0 + 1.0
    if fin.null_count == len(fin):
        notes.append("no row has finished_at (output written before it was recorded): no time plots")
    return JobRows(out_dir, table, summary, float(t0), float(t1), notes, total, parts)


def bucket_sizes(job: JobRows) -> tuple[list[int], list[float]]:
    """Prompts per released bucket, and how many buckets each size stands for. Every row
    read: each bucket once, weight 1. Sampled: the exact size of each bucket a sampled row
    is in (counted over every row, reading only `bucket`), once per sampled row, weighted
    total / sample / size (a bucket is sampled in proportion to its size)."""
    rows = job.table.filter(pc.is_valid(job.table.column("bucket")))
    if not job.sampled:
        sizes = pc.value_counts(rows.column("bucket")).field("counts").to_pylist()
        return sizes, [1.0] * len(sizes)
    wanted = pc.unique(rows.column("bucket"))
    counts: dict[str, int] = dict.fromkeys(wanted.to_pylist(), 0)
    for part, i, _ in _row_groups(job.parts):
        f = pq.ParquetFile(part)
        if "bucket" not in f.schema_arrow.names:
            continue
        col = pq.ParquetFile(part, read_dictionary=["bucket"]).read_row_group(i, columns=["bucket"]).column("bucket")
        for chunk in col.chunks:
            if not pa.types.is_dictionary(chunk.type):
                chunk = chunk.dictionary_encode()
            n_of = np.bincount(chunk.indices.drop_null().to_numpy(), minlength=len(chunk.dictionary))
            for b, n in zip(chunk.dictionary.to_pylist(), n_of.tolist()):
                if n and b in counts:
                    counts[b] += n
    sizes = [counts[b] for b in rows.column("bucket").to_pylist()]
    return sizes, [job.scale / s for s in sizes]
