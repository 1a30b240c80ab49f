"""A job's Parquet output: dedupe by id, part files, summary. No NATS here.

Layout of a job's `out_dir` (`prefixflow/services/sink/parts.py`):
    part-000000-000099.parquet, part-000100-000230.parquet, ...   merged, ~`target_bytes` each
    part-000231.parquet, part-000232.parquet, ...                 one per flush, not merged yet
    _summary.json                                                 written when the job completes
    _report/                                                      `prefixflow report` (plots)
(`pyarrow.parquet.read_table(out_dir)` reads every row once: it skips names starting
with `_` or `.`.)

Each flush writes a small part durably (temporary name, fsync, rename): that is what lets
the sink ack. Once the small parts not merged yet hold `target_bytes` (128 MiB), they are
merged, streaming, into one file, and the tail is merged when the job completes: a job of
B bytes ends in about B / target_bytes + 1 files, and every byte is rewritten once. On
(re)start a crash's leftovers are cleaned up (`parts.recover`), the ids already written
are loaded, so a redelivered result or a resumed job never writes a row twice, and the
totals are counted once from the files; after that they are kept as parts are written,
so a summary reads no file.

Columns: `prefixflow/services/sink/schema.py`. A job's schema grows, it never loses
(`prefixflow/shared/widening.py`): it is the union of its rows' columns, each widened to
hold every value exactly. A part is written under the schema as it is then (recorded in
`_common_metadata` before the part); files written under a narrower one are rewritten
under the final schema when the job completes (`write_summary`), so a reader of the
directory after the job gets every row with the widest types. Mid-job, read the
directory with the record's schema (`pyarrow.dataset.dataset(OUT, schema=...)`): a plain
read takes the first file's schema.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import structlog

from prefixflow.services.sink.parts import Part
from prefixflow.services.sink.roots import OutsideRoot, confine
from prefixflow.services.sink.store import OutputStore, open_store
from prefixflow.services.sink.growth import RewriteFailed, file_kinds, int_id_mask, typed_ids, with_int_ids
from prefixflow.services.sink.schema import INPUT_PREFIX, OUTPUT_TYPES, as_text, generated_columns, input_column
from prefixflow.services.sink.summary import TOTALS_COLUMNS, PartStats, Totals
from prefixflow.shared.wire.ids import IdSet
from prefixflow.shared.wire.limits import TIMED_OUT
from prefixflow.shared.wire.messages import JobSpec, Result
from prefixflow.shared.widening import SchemaGrowth, conform, type_text

__all__ = [
    "INPUT_PREFIX", "OUTPUT_TYPES", "TARGET_BYTES", "JobOutput", "OutsideRoot", "PartStats",
    "as_text", "confine", "generated_columns", "input_column",
]

log = structlog.get_logger()

TARGET_BYTES = 128 << 20
"""Small parts are merged into files of about this many bytes (`JobOutput(target_bytes=)`)."""


def is_timeout(result: Result) -> bool:
    """The error row of a row past its deadline (`JobSpec.row_timeout`)."""
    return result.error is not None and result.error.startswith(TIMED_OUT)


class JobOutput:
    def __init__(
        self, job: str, out_dir: str | Path | OutputStore, target_bytes: int = TARGET_BYTES,
        compact_in_flush: bool = True,
    ) -> None:
        """`out_dir`: a local directory, an output URI or a store (`store.py`);
        `target_bytes`: merged files' size (at most the store's cap); `compact_in_flush`:
        `flush` merges when due (else the caller runs `compact`, e.g. in a thread of its own)."""
        self.job = job
        self.store = open_store(out_dir)
        self.dir = self.store.local_dir
        """The local directory (None: the output is in an object store)."""
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        cap = self.store.target_cap
        self.target_bytes = min(target_bytes, cap) if cap else target_bytes
        self.compact_in_flush = compact_in_flush
        self.seen = IdSet()
        self.duplicates = 0
        self.timed_out = IdSet()
        """Ids whose row is the error row of a row past its deadline (`limits.TIMED_OUT`)."""
        self.late = 0
        """Results dropped since the job was opened here because their row had timed out
        already (a row aborted for its deadline, then run again after a redelivery)."""
        self.last_added = 0.0
        """When a row was last queued (monotonic; 0: none since opened)."""
        """Rows received again and dropped (their id was taken) since the job was opened here."""
        self.totals = Totals()
        """Rows, errors, tokens overall and per replica of the rows on disk."""
        self.last_part: PartStats | None = None
        """What the last part written held."""
        self.pending: list[tuple[Result, float | None]] = []
        """Results queued for the next part, with when they reached the results stream."""
        self.growth = SchemaGrowth(trailing=[*OUTPUT_TYPES, "embedding"])
        """The job's columns so far: the union of its parts' (read back on a restart)."""
        self.schema: pa.Schema | None = None
        """The job's schema so far (`growth`'s; None before the first part)."""
        self.next_part = 0
        self.done = False
        """`_summary.json` is written and no row was queued since: the job need not be
        checked again (the sink forgets done jobs first when it has too many open)."""
        self._small: list[tuple[Part, int]] = []
        """Small parts not merged yet, in order, with the bytes of their rows (`data_bytes`)."""
        self._lock = threading.Lock()  # guards `_small` (flush and compact may run in two threads)
        self._compacting = threading.Lock()  # one merge at a time
        self._load_existing()

    @property
    def rows(self) -> int:
        return self.totals.overall[0]

    @property
    def errors(self) -> int:
        return self.totals.overall[1]

    @property
    def tokens(self) -> list[int]:
        """Prompt, cached and output tokens of the ok rows on disk (the job's progress)."""
        return self.totals.overall[2:5]

    def parts(self) -> list[Path]:
        """The job's Parquet files, in part order (paths in the store's file system)."""
        return [p.path for p in self.store.scan()]

    def _load_existing(self) -> None:
        """Read back what a previous run wrote: ids, totals, schema (a few columns of one
        file at a time), after cleaning up what a crash left."""
        found = self.store.recover()
        for part in found:
            pf = pq.ParquetFile(self.store.source(part))
            schema = pf.schema_arrow
            table = pf.read(columns=[c for c in TOTALS_COLUMNS if c in schema.names])
            ids = typed_ids(table.column("id"), int_id_mask(schema, table.num_rows))
            self.seen.update(ids)
            timed_out = pc.starts_with(table.column("error"), TIMED_OUT)
            if pc.any(timed_out).as_py():
                given = ids.tolist() if isinstance(ids, np.ndarray) else ids  # Python ints: typed ids
                self.timed_out.update(i for i, late in zip(given, timed_out.to_pylist()) if late)
            self.totals.add_table(table, part.first)
            self.next_part = max(self.next_part, part.last + 1)
            self.growth.add(file_kinds(self.store.source(part)))
        if found:
            self.schema = self.growth.schema()
            self.store.write_record(self.schema)
        last_merged = max((p.last for p in found if p.merged), default=-1)
        self._small = [(p, self.store.data_bytes(p)) for p in found if not p.merged and p.first > last_merged]

    def add(self, result: Result, finished_at: float | None = None) -> bool:
        """Queue a result for the next part (`finished_at`: when it reached the results
        stream, for a result that does not say when it finished); False if this id was
        already taken."""
        # NOTE: ids keep their type (IdSet): 5 and "5" are two rows; a restart reads a
        # text id column back with its integer ids as integers (`growth.typed_ids`).
        if not self.seen.add(result.id):
            self.duplicates += 1
            if result.id in self.timed_out and not is_timeout(result):  # its error row stays
                self.late += 1
            return False
        if is_timeout(result):
            self.timed_out.add(result.id)
        self.pending.append((result, finished_at))
        self.last_added = time.monotonic()
        self.done = False
        return True

    def sources(self) -> set[int]:
        """The blobs of input columns the queued rows need (`InputCache.fetch`)."""
        return {r.src for r, _ in self.pending if r.src >= 0}

    def drop_pending(self) -> None:
        """Forget queued rows that could not be written (their messages are redelivered)."""
        for r, _ in self.pending:
            self.seen.discard(r.id)
            if is_timeout(r):
                self.timed_out.discard(r.id)
        self.pending = []

    def flush(self, inputs: Callable[[int], pa.Table | None] | None = None) -> int:
        """Write the queued rows as one small part, their input columns taken from
        `inputs(src)` (a blob's record batch, None if there is none); then, with
        `compact_in_flush`, merge small parts if they hold `target_bytes`. Returns the
        number of rows written."""
        if not self.pending:
            return 0
        results = [r for r, _ in self.pending]
        finished = [f for _, f in self.pending]
        table = self._to_table(results, finished, inputs or (lambda src: None))
        n = self.next_part
        part = self.store.write_part(table, n)
        self.next_part += 1
        with self._lock:
            self._small.append((part, self.store.data_bytes(part)))
        times = table.column("finished_at").to_pylist() if "finished_at" in table.column_names else []
        self.last_part = self.totals.add_results(results, times, n)
        self.pending = []
        if self.compact_in_flush and self.compact_due():
            self._compact_quietly()
        return len(results)

    def compact_due(self) -> bool:
        """The small parts not merged yet hold `target_bytes`: `compact` has work."""
        with self._lock:
            return sum(size for _, size in self._small) >= self.target_bytes

    def compact(self, final: bool = False) -> int:
        """Merge small parts, oldest first, into files of about `target_bytes`; with
        `final` (the job is complete) also the rest into one file. Safe to run in another
        thread than `flush`. Returns the number of files written."""
        written = 0
        with self._compacting:
            while True:
                with self._lock:
                    run, schema = list(self._small), self.schema
                take, size = [], 0
                for part, nbytes in run:
                    take.append(part)
                    size += nbytes
                    if size >= self.target_bytes:
                        break
                if size < self.target_bytes and not (final and len(take) > 1):
                    return written
                if len(take) > 1:
                    assert schema is not None  # NOTE: taken with `run`: it holds every part of it
                    self.store.merge(take, schema)
                    written += 1
                # NOTE: a lone small part of `target_bytes` or more is big enough as it is.
                with self._lock:
                    self._small = self._small[len(take):]

    def _compact_quietly(self, final: bool = False) -> None:
        """`compact`, a failure logged: the small parts stay (every row is on disk
        already), the merge is tried again later."""
        try:
            self.compact(final)
        except Exception as exc:  # noqa: BLE001 - the rows are written; only the merge failed
            log.error("merging parts failed; retried later", job=self.job, error=repr(exc))

    def _inputs(self, results: list[Result], inputs: Callable[[int], pa.Table | None]) -> pa.Table | None:
        """The input columns of each result's row, in the results' order (None: no row
        has any). Rows of one blob are taken together; rows with none get nulls."""
        by_src: dict[int, list[int]] = {}
        for i, r in enumerate(results):
            by_src.setdefault(r.src, []).append(i)
        pieces, order = [], []
        growth = SchemaGrowth()
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
            growth.add_table(pieces[-1])
        if not pieces:
            return None
        schema = growth.schema()
        pieces = [conform(piece, schema) for piece in pieces]
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
        if self.growth.add_table(table) or self.schema is None:
            before = self.schema
            schema = self.growth.schema()
            self.store.write_record(schema)  # NOTE: before the part: the record holds every part's columns
            with self._lock:
                self.schema = schema
            if before is not None:
                log.info("job schema grew", job=self.job, columns=widened(before, schema))
        table = conform(table, self.schema)
        if pa.types.is_string(table.schema.field("id").type):
            mask = np.array([isinstance(r.id, int) for r in results], bool)
            table = table.replace_schema_metadata(with_int_ids(table.schema, mask).metadata)
        return table

    def _read_times(self, part: int) -> pa.ChunkedArray | None:
        """The `finished_at` column of the file holding small part `part` (a summary reads
        it only when that part holds rows finished both before and after the job's
        `created_at`)."""
        for _ in range(2):  # NOTE: a merge in another thread may just have renamed it
            for p in self.store.scan():
                if p.first <= part <= p.last:
                    try:
                        return pq.read_table(self.store.source(p), columns=["finished_at"]).column("finished_at")
                    except FileNotFoundError:
                        break
        return None

    def summarize(self, spec: JobSpec, finished_at: float | None = None) -> dict[str, Any]:
        """Totals over every row on disk, overall and per replica, and the job's columns
        with their types; written to `_summary.json`. Kept as parts are written: no file
        is read."""
        summary = self.totals.summary(spec, finished_at, self._read_times)
        summary["late_results"] = self.late
        if self.schema is not None:
            summary["columns"] = {f.name: type_text(f.type) for f in self.schema}  # the job's final schema, once complete
        return summary

    def rewrite_narrower(self) -> int:
        """Rewrite every file written under a narrower schema than the job's (the job is
        complete: its schema is final). Returns the number of files rewritten; raises
        `RewriteFailed` (every row is on disk still, in its old file)."""
        if self.schema is None:
            return 0
        rewritten = 0
        with self._compacting:
            for part in self.store.scan():
                try:
                    if pq.ParquetFile(self.store.source(part)).schema_arrow.equals(self.schema):
                        continue
                    self.store.rewrite(part, self.schema)
                except OSError as exc:
                    raise RewriteFailed(f"{part.path.name} not rewritten under the job's schema: {exc}") from exc
                rewritten += 1
        if rewritten:
            log.info("files rewritten under the job's final schema", job=self.job, files=rewritten)
        return rewritten

    def write_summary(self, spec: JobSpec, finished_at: float | None = None) -> dict[str, Any]:
        """Merge the small parts left, rewrite files of a narrower schema, then write
        `_summary.json` (with the job's columns and their types)."""
        self._compact_quietly(final=True)
        self.rewrite_narrower()
        summary = self.summarize(spec, finished_at)
        self.store.put_bytes("_summary.json", (json.dumps(summary, indent=2) + "\n").encode())
        self.done = True
        return summary


def widened(before: pa.Schema, after: pa.Schema) -> dict[str, str]:
    """What grew between two schemas of a job: column -> "new" or "old type -> new type"."""
    out = {}
    for f in after:
        if before.get_field_index(f.name) < 0:
            out[f.name] = f"new {type_text(f.type)}"
        elif before.field(f.name).type != f.type:
            out[f.name] = f"{type_text(before.field(f.name).type)} -> {type_text(f.type)}"
    return out
