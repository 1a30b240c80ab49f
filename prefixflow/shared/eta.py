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

**The engines' step model** comes first where the job's engines report one (vLLM: each
fits its step time, `StepFit`, and reports its prompt budget, slots and KV cache; the
echo engine reports none). A token-work rate assumes a job's rate in work is the same
for short and long rows; on a continuous-batching engine it is not: rows of 16 output
tokens are limited by the step's prompt budget with half the slots empty, rows of 64 by
the slots, and a token's share of a step changes with the mix (on vLLM the work model
said +84 % at 25 % of the 4x job). `rows_per_second` gives an engine's steady rate for
rows of the remaining shape (the rows left, each with the mean uncached prompt and the
mean output budget left), and the rows the engines hold at the end finish over one
output length of cheap steps (`drain_seconds`). It assumes the job
has its engines to itself and the pipeline keeps them fed: a job that shares its
engines with others, or whose feed is slower than its engines, ends later than it says.
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


def steady_step(step, uncached: float, output: float, prompt: float) -> tuple[float, float]:
    """(rows a step starts, seconds a step takes) of one engine in steady state on rows of
    this shape (`rows_per_second`)."""
    out = max(float(output), 1.0)
    limits = [step.slots / out]
    if uncached > 0 and step.batch_tokens > 0:
        limits.append(step.batch_tokens / uncached)
    if step.kv_tokens > 0:
        limits.append(step.kv_tokens / (max(float(prompt), 0.0) + out) / out)
    r = min(limits)
    return r, step.s0 + step.prompt_s * r * max(float(uncached), 0.0) + step.output_s * r * out


def rows_per_second(step, uncached: float, output: float, prompt: float) -> float:
    """One engine's steady rate of rows that each compute `uncached` prompt tokens, hold
    `prompt` tokens and generate `output` tokens, by its step model (`step`: a
    `prefixflow.shared.wire.messages.StepModel`). Continuous batching in steady state:
    each step starts (and ends) r rows, where r is the least of what the step's prompt
    token budget admits (`batch_tokens` / uncached), what its slots keep running (a row
    runs `output` steps: `slots` / output) and what its KV cache holds; the step computes
    r x uncached prompt tokens and generates one token for each of the r x output rows
    running. Rate = r / the step's time. 0 when the model says nothing."""
    r, seconds = steady_step(step, uncached, output, prompt)
    return r / seconds if r > 0 and seconds > 0 else 0.0


def drain_seconds(step, replicas: int, rows: float, uncached: float, output: float, prompt: float) -> float | None:
    """Seconds until `rows` rows of this shape are done on `replicas` engines in steady
    state: the rows beyond those the engines hold (each runs r x output at once) start at
    r a step; the last ones held then finish over `output` more steps, each without
    prefill and with on average half the requests running (the drain: a step there is far
    cheaper than in steady state). None when the model says nothing."""
    r, t = steady_step(step, uncached, output, prompt)
    if r <= 0 or t <= 0 or replicas <= 0:
        return None
    out = max(float(output), 1.0)
    running = r * out
    queued = max(rows - replicas * running, 0.0)
    return queued / (replicas * r) * t + out * (step.s0 + step.output_s * running / 2)


@dataclass(frozen=True)
class EtaModel:
    decode_cost: float = DEFAULT_DECODE_COST
    step: object | None = None
    """The job's engines' step model (`StepModel`; None: none measured)."""
    replicas: int = 0
    """How many engines run the job (the step model is one engine's)."""

    def remaining_shape(self, p: Progress) -> tuple[float, float, float] | None:
        """A row left, on average: (uncached prompt tokens and prompt tokens, as the rows
        written so far; output tokens, the budget left over the rows left); None without
        a plan or a row written, or with nothing left."""
        if p.total is None or not p.planned_output_tokens or p.rows <= 0 or p.rows >= p.total:
            return None
        left_output = max(p.planned_output_tokens - p.output_tokens, 0)
        return (max(p.prompt_tokens - p.cached_tokens, 0) / p.rows, p.prompt_tokens / p.rows,
                left_output / (p.total - p.rows))

    def engine_eta(self, p: Progress) -> float | None:
        """Seconds until the rows left are done on the job's engines, by their step model
        (`drain_seconds`); None without one."""
        shape = self.remaining_shape(p)
        if shape is None or self.step is None or self.replicas <= 0:
            return None
        uncached, prompt, out_left = shape
        return drain_seconds(self.step, self.replicas, p.total - p.rows, uncached, out_left, prompt)

    def remaining_work(self, p: Progress) -> float | None:
        """Work (prompt-token units) left, or None without a plan or a row written."""
        if p.total is None or not p.planned_output_tokens or p.rows <= 0:
            return None
        left_rows = max(p.total - p.rows, 0)
        uncached_per_row = max(p.prompt_tokens - p.cached_tokens, 0) / p.rows
        left_output = max(p.planned_output_tokens - p.output_tokens, 0) if left_rows else 0
        return left_rows * uncached_per_row + self.decode_cost * left_output

    def work_eta(self, p: Progress) -> float | None:
        """Remaining work / the work rate (the token-work model alone)."""
        work, rate = self.remaining_work(p), self.rate(p)
        return work / rate if work is not None and rate > 0 else None

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
        if (engines := self.engine_eta(p)) is not None:
            return engines
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
