"""What the sink reports of a job as it goes: its status (rows and errors on disk, tokens,
rows per second over the last `RATE_WINDOW` seconds, or done with its summary) and the
metrics of every part it writes."""

from __future__ import annotations

import time
from collections import deque

from prefixflow.services.sink import lifecycle
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.bus.provision import job_retention
from prefixflow.shared.process import metrics
from prefixflow.shared.wire import messages as m

MAX_REPLICAS = 4096
"""Replicas whose costs a job's status averages (a bound on what result batches can add)."""
MAX_COST = 1000.0
"""The largest output token cost a result batch may report (a message is not trusted)."""
RATE_WINDOW = 30.0
"""Seconds of progress a job's rate (rows per second, hence its ETA) is measured over at
most; a job younger than twice that is measured over the later half of its life (its
start-up, while engines and buffers fill, would hold its rate low for 30 s: the echo
ETA benchmark said +22 % at 25 % with the whole window, +6 % with half the life)."""


class Progress:
    """Open jobs -> (monotonic time, rows, uncached prompt tokens, output tokens on disk)
    over the last RATE_WINDOW seconds."""

    def __init__(self) -> None:
        self.seen: dict[str, deque[tuple[float, int, int, int]]] = {}
        self.opened: dict[str, float] = {}
        """Open jobs -> when their first status was made (monotonic)."""
        self.costs: dict[str, dict[str, float]] = {}
        """Open jobs -> replica -> the output token cost its last result batch carried."""
        self.steps: dict[str, dict[str, m.StepModel]] = {}
        """Open jobs -> replica -> the step model its last result batch carried."""

    def forget(self, job: str) -> None:
        self.seen.pop(job, None)
        self.opened.pop(job, None)
        self.costs.pop(job, None)
        self.steps.pop(job, None)

    def note_cost(self, job: str, replica: str, cost: float) -> None:
        """A result batch of `job` from `replica` says an output token costs its engine
        `cost` uncached prompt tokens (bounded: one entry per replica that wrote rows)."""
        if not (0 < cost <= MAX_COST):  # NaN, infinite or absurd: from no engine's fit (it reports 0.05-200)
            return
        costs = self.costs.setdefault(job, {})
        if replica in costs or len(costs) < MAX_REPLICAS:
            costs[replica] = float(cost)

    def note_step(self, job: str, replica: str, step: m.StepModel) -> None:
        """A result batch of `job` from `replica` carries its engine's step model (checked:
        a message is not trusted; bounded like the costs)."""
        if not step.valid():
            return
        steps = self.steps.setdefault(job, {})
        if replica in steps or len(steps) < MAX_REPLICAS:
            steps[replica] = step

    def step(self, job: str) -> tuple[m.StepModel | None, int]:
        """The mean of the job's replicas' last step models, and how many there are."""
        steps = list(self.steps.get(job, {}).values())
        if not steps:
            return None, 0
        n = len(steps)
        mean = lambda f: sum(getattr(x, f) for x in steps) / n  # noqa: E731
        return m.StepModel(mean("s0"), mean("prompt_s"), mean("output_s"), round(mean("batch_tokens")),
                           max(round(mean("slots")), 1), round(mean("kv_tokens"))), n

    def decode_cost(self, job: str) -> float:
        """The mean over the job's replicas of their last measured cost (0: none measured)."""
        costs = self.costs.get(job)
        return round(sum(costs.values()) / len(costs), 3) if costs else 0.0

    def status(self, job: str, out: JobOutput, spec: m.JobSpec, summary: dict | None) -> m.JobStatus:
        """The job's status: progress, or done with its summary (no per-replica totals)."""
        now = time.time()
        done = summary is not None
        prompt, cached, output = out.tokens
        rates = (0.0, 0.0, 0.0) if done else self.rates(job, out.rows, prompt - cached, output)
        step, replicas = (None, 0) if done else self.step(job)
        return m.JobStatus(
            job, out.rows, out.errors, spec.total, done, now, lifecycle.status_summary(summary),
            created_at=spec.created_at, rate=rates[0], uncached_rate=rates[1], output_rate=rates[2],
            planned_output_tokens=spec.planned_output_tokens, decode_cost=self.decode_cost(job),
            prompt_tokens=prompt, cached_tokens=cached, output_tokens=output, expires_at=now + job_retention(),
            duplicates=out.duplicates, step=step, replicas=replicas,
            cancelled=done and bool(spec.ended_at(now)) and (spec.total is None or out.rows < spec.total),
        )

    def rates(self, job: str, rows: int, uncached: int, output: int) -> tuple[float, float, float]:
        """Rows, uncached prompt tokens and output tokens per second the job made over the
        last RATE_WINDOW seconds (0 until there is a second of history)."""
        now = time.monotonic()
        window = min(RATE_WINDOW, (now - self.opened.setdefault(job, now)) / 2)
        seen = self.seen.setdefault(job, deque())
        seen.append((now, rows, uncached, output))
        while len(seen) > 2 and now - seen[1][0] >= window:
            seen.popleft()
        t0, *first = seen[0]
        if now - t0 < 1.0:
            return 0.0, 0.0, 0.0
        return tuple(round((x - x0) / (now - t0), 2) for x, x0 in zip((rows, uncached, output), first))


def count_part(stats) -> None:
    """Metrics of a part on disk: rows out, error rows by reason, tokens by replica."""
    if stats is None:
        return
    metrics.PROMPTS_OUT.labels("ok").inc(stats.ok)
    metrics.SINK_DEDUPLICATED_ROWS.inc(stats.deduplicated)
    metrics.SINK_MERGED_ROWS.inc(stats.merged)
    n_errors = sum(stats.errors.values())
    if n_errors:
        metrics.PROMPTS_OUT.labels("error").inc(n_errors)
        for text, n in stats.errors.items():
            metrics.ERROR_ROWS.labels(metrics.error_reason(text)).inc(n)
    for replica, (prompt, cached, output) in stats.replicas.items():
        metrics.SINK_PROMPT_TOKENS.labels(replica).inc(prompt)
        metrics.SINK_CACHED_TOKENS.labels(replica).inc(cached)
        metrics.SINK_OUTPUT_TOKENS.labels(replica).inc(output)
