"""A job's totals, kept as its parts are written, and the `_summary.json` made from them.

`Totals` counts rows, error rows and the token sums of ok rows, overall and per replica,
and remembers per part the earliest and latest `finished_at`, so a summary never reads
the parts back. A restarted sink fills it once from the files (`add_table`: a few
columns of one file at a time).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from prefixflow.shared.wire.limits import TIMED_OUT
from prefixflow.shared.wire.messages import JobSpec, Result

TOKEN_COLUMNS = ("prompt_tokens", "cached_tokens", "output_tokens")
TOTALS_COLUMNS = ("id", "error", *TOKEN_COLUMNS, "replica", "finished_at", "dedupe")
"""What a restart reads back from each file (those it has)."""


@dataclass
class PartStats:
    """What one written part held (the sink's metrics)."""

    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    """Error text -> rows."""
    replicas: dict[str, list[int]] = field(default_factory=dict)
    """Replica -> [prompt, cached, output tokens] of its ok rows."""
    deduplicated: int = 0
    """Rows whose output is a copy of an identical deterministic row's (`Result.dedupe` 1)."""
    merged: int = 0
    """Rows that took a completion of a merged request (`Result.dedupe` 2)."""

    @classmethod
    def of(cls, results: list[Result]) -> PartStats:
        stats = cls()
        for r in results:
            if r.error is not None:
                stats.errors[r.error] = stats.errors.get(r.error, 0) + 1
                continue
            stats.ok += 1
            if r.dedupe:
                if r.dedupe == 1:
                    stats.deduplicated += 1
                else:
                    stats.merged += 1
            acc = stats.replicas.get(r.replica)
            if acc is None:
                acc = stats.replicas[r.replica] = [0, 0, 0]
            acc[0] += r.prompt_tokens
            acc[1] += r.cached_tokens
            acc[2] += r.output_tokens
        return stats


class Totals:
    """A job's totals over every row on disk. Each total is [rows, errors, prompt, cached,
    output tokens] (tokens of ok rows only); replicas without a name are not listed."""

    def __init__(self) -> None:
        self.overall = [0, 0, 0, 0, 0]
        self.timed_out = 0
        """Error rows of rows past their deadline (`limits.TIMED_OUT`)."""
        self.deduplicated = 0
        """Rows written whose output is a copy of an identical deterministic row's."""
        self.merged = 0
        """Rows written that took a completion of a request merged with identical sampled rows."""
        self.replicas: dict[str, list[int]] = {}
        # Per part with a finish time: its number, earliest and latest `finished_at`
        # (24 bytes a part; a restart keeps one entry per file).
        self._part = array("q")
        self._lo = array("d")
        self._hi = array("d")

    def add_results(self, results: list[Result], finished: Sequence[float | None], part: int) -> PartStats:
        """Count a part just written (`finished`: its `finished_at` column)."""
        stats = PartStats.of(results)
        self.overall[0] += len(results)
        self.timed_out += sum(1 for r in results if r.error is not None and r.error.startswith(TIMED_OUT))
        self.overall[1] += len(results) - stats.ok
        self.deduplicated += stats.deduplicated
        self.merged += stats.merged
        for acc in stats.replicas.values():
            for i in range(3):
                self.overall[2 + i] += acc[i]
        for r in results:
            if not r.replica:
                continue
            rep = self.replicas.get(r.replica)
            if rep is None:
                rep = self.replicas[r.replica] = [0, 0, 0, 0, 0]
            rep[0] += 1
            if r.error is not None:
                rep[1] += 1
            else:
                rep[2] += r.prompt_tokens
                rep[3] += r.cached_tokens
                rep[4] += r.output_tokens
        times = [t for t in finished if t is not None]
        if times:
            self._note_times(part, min(times), max(times))
        return stats

    def add_table(self, t: pa.Table, part: int) -> None:
        """Count a file read back from disk (its `TOTALS_COLUMNS`; `part`: its first part)."""
        failed = pc.is_valid(t.column("error"))
        errors = int(pc.sum(failed).as_py() or 0)
        cols = {"replica": t.column("replica"), "failed": failed.cast(pa.int64())}
        for name in TOKEN_COLUMNS:  # tokens of ok rows only
            cols[name] = pc.if_else(failed, 0, t.column(name).cast(pa.int64()))
        sums = pa.table(cols).group_by("replica").aggregate(
            [("failed", "count"), ("failed", "sum")] + [(name, "sum") for name in TOKEN_COLUMNS]
        )
        self.overall[0] += t.num_rows
        self.overall[1] += errors
        if errors:
            self.timed_out += int(pc.sum(pc.starts_with(t.column("error"), TIMED_OUT)).as_py() or 0)
        if "dedupe" in t.column_names:  # parts written before dedupe have no such column
            kinds = t.column("dedupe")
            self.deduplicated += int(pc.sum(pc.equal(kinds, "copy")).as_py() or 0)
            self.merged += int(pc.sum(pc.equal(kinds, "merged")).as_py() or 0)
        for row in sums.to_pylist():
            tokens = [int(row[f"{name}_sum"] or 0) for name in TOKEN_COLUMNS]
            for i in range(3):
                self.overall[2 + i] += tokens[i]
            if row["replica"]:
                rep = self.replicas.setdefault(row["replica"], [0, 0, 0, 0, 0])
                for i, value in enumerate([row["failed_count"], row["failed_sum"] or 0, *tokens]):
                    rep[i] += int(value)
        if "finished_at" in t.column_names:
            bounds = pc.min_max(t.column("finished_at")).as_py()
            if bounds["min"] is not None:
                self._note_times(part, bounds["min"], bounds["max"])

    def _note_times(self, part: int, lo: float, hi: float) -> None:
        self._part.append(part)
        self._lo.append(lo)
        self._hi.append(hi)

    def first_finished(self, after: float, read_times: Callable[[int], pa.ChunkedArray | None]) -> float | None:
        """The earliest `finished_at` >= `after`, from the kept bounds. Only a part whose
        rows finished both before and after `after` (a rerun's first part) is read back:
        `read_times(part)` gives the `finished_at` column of the file holding it."""
        lo, hi = np.frombuffer(self._lo, np.float64), np.frombuffer(self._hi, np.float64)
        later = lo[lo >= after]
        best = float(later.min()) if len(later) else None
        straddle = np.flatnonzero((lo < after) & (hi >= after))
        for part in sorted({self._part[i] for i in straddle.tolist()}):
            times = read_times(part)
            if times is None:
                continue
            done = pc.min(pc.filter(times, pc.greater_equal(times, after))).as_py()
            if done is not None and (best is None or done < best):
                best = done
        return best

    def summary(
        self, spec: JobSpec, finished_at: float | None, read_times: Callable[[int], pa.ChunkedArray | None]
    ) -> dict[str, Any]:
        """The job's `_summary.json`: totals overall and per replica, rates over the job's
        wall time, when the first row of this run finished."""
        finished_at = finished_at or time.time()
        wall = max(finished_at - spec.created_at, 1e-9) if spec.created_at else None

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

        summary = dict(job=spec.job, **totals(self.overall), wall_seconds=round(wall, 3) if wall else None)
        summary["timed_out_rows"] = self.timed_out
        summary["deduplicated_rows"] = self.deduplicated
        summary["merged_rows"] = self.merged
        summary["created_at"] = spec.created_at or None
        if spec.created_at:
            first_finished = self.first_finished(spec.created_at, read_times)
            if first_finished is not None:
                # When an engine finished the first prompt of this run (rows carry `finished_at`);
                # the row lands within the sink's --flush-seconds. `prefixflow bench batching` reports it.
                summary["first_result_seconds"] = round(first_finished - spec.created_at, 3)
        if spec.model:
            summary["model"] = spec.model
        ended = spec.ended_at(finished_at)
        if ended and (spec.total is None or self.overall[0] < spec.total):  # stopped before every row
            summary["cancelled"] = True
            summary["expired"] = spec.expired(finished_at)
            summary["cancelled_at"] = round(ended, 3)
            if spec.cancelled_by and not summary["expired"]:
                summary["cancelled_by"] = spec.cancelled_by
        summary["finished_at"] = round(finished_at, 3)
        summary["replicas"] = {name: totals(self.replicas[name]) for name in sorted(self.replicas)}
        return summary
