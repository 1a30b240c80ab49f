"""A running job's ETA from a model of its remaining work, not only from rows per second.
Pure logic.

Rows are not alike: a job whose second half generates 4x longer outputs runs its second
half slower, and rows/s measured on the first half says it ends far too soon. The model
counts work in the router's unit (`prefixflow/services/router/fleet.py`): a row's uncached
prompt tokens plus its output tokens at `decode_cost` prompt tokens each (what an output
token costs an engine relative to an uncached prompt token; engine-workers measure it,
`prefixflow/services/engine_worker/cost_fit.py`).

- **Remaining work**: the rows not written yet, each with the uncached prompt tokens of
  the rows written so far (their mean prompt, at the hit rate so far), plus the output
  tokens the job was planned to generate (`JobSpec.planned_output_tokens`: every row's
  `max_tokens` times its `n`, summed by the client as it publishes) less those generated so far, at
  `decode_cost`. A job whose rows stop at EOS before `max_tokens` is predicted long.
- **Rate**: the work the sink saw written per second over its rate window (uncached
  prompt tokens/s + `decode_cost` x output tokens/s).

ETA = remaining work / rate. Without a plan or token rates (a job published on the raw
ingest subject, an older sink) it falls back to remaining rows / rows per second.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DECODE_COST = 1.0
"""An output token's cost in uncached prompt tokens when no engine has measured it (the
router's default)."""


@dataclass(frozen=True)
class Progress:
    """What the sink has written of a job, and how fast."""

    rows: int
    total: int | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    planned_output_tokens: int = 0
    """The whole job's output budget (0: unknown)."""
    rows_rate: float = 0.0
    uncached_rate: float = 0.0
    """Uncached prompt tokens written per second (the sink's window)."""
    output_rate: float = 0.0
    """Output tokens written per second (the sink's window)."""


@dataclass(frozen=True)
class EtaModel:
    decode_cost: float = DEFAULT_DECODE_COST

    def remaining_work(self, p: Progress) -> float | None:
        """Work (prompt-token units) left, or None without a plan or a row written."""
        if p.total is None or not p.planned_output_tokens or p.rows <= 0:
            return None
        left_rows = max(p.total - p.rows, 0)
        uncached_per_row = max(p.prompt_tokens - p.cached_tokens, 0) / p.rows
        left_output = max(p.planned_output_tokens - p.output_tokens, 0) if left_rows else 0
        return left_rows * uncached_per_row + self.decode_cost * left_output

    def rate(self, p: Progress) -> float:
        """Work per second written lately."""
        return p.uncached_rate + self.decode_cost * p.output_rate

    def eta_seconds(self, p: Progress) -> float | None:
        """Seconds until every row is written; None while unknown (not sealed, nothing
        written lately)."""
        if p.total is None:
            return None
        if p.rows >= p.total:
            return 0.0
        work, rate = self.remaining_work(p), self.rate(p)
        if work is not None and rate > 0:
            return work / rate
        if p.rows_rate > 0:
            return (p.total - p.rows) / p.rows_rate
        return None


def output_budget(rows: list[dict], default: int, default_n: int = 1) -> int:
    """The output tokens these input rows ask for at most: each row's own `sampling`
    `max_tokens` (or OpenAI's `max_completion_tokens`), else the job's `default`, for
    each of its `n` completions (its own `n`, else the job's `default_n`)."""
    total = 0
    for row in rows:
        own = row.get("sampling")
        value = (own.get("max_tokens") or own.get("max_completion_tokens")) if isinstance(own, dict) else None
        n = own.get("n") if isinstance(own, dict) else None
        total += (value if isinstance(value, int) and value > 0 else default) * (
            n if isinstance(n, int) and n > 0 else default_n)
    return total


def fleet_decode_cost(measured) -> float | None:
    """The replicas' mean measured cost of an output token (their statuses' `decode_cost`;
    0: not measured), or None if none has measured it."""
    costs = [c for c in measured if c > 0]
    return sum(costs) / len(costs) if costs else None
