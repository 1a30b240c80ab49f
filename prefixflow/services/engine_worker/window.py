"""The engine-worker's feeding window: pure logic, no I/O (the simulator drives it too).

The worker keeps at most `window` prompts in flight in its engine. The window sizes
itself from what it measures, instead of a fixed setting:

- **Throughput.** The window follows what the engine manages to run at once (its KV
  cache decides): twice the most requests ever seen running, between 16 and the
  configured `--window` (never above it). That keeps vLLM's queue from running dry without pulling work
  out of the bucketer (where it can still be grouped) long before the engine can use it.
  An engine with no KV cache to respect (the echo engine reports no blocks) keeps the
  configured window.
- **Latency of the first result (the probe).** When work reaches an engine that has had
  none for a while (the start of a job on a quiet cluster, a rebuilt engine), one prompt
  runs alone first. A decode step's cost grows with the number of sequences in it (on
  CPUs almost linearly; `docs/benchmarks.md`), so with long outputs a full window makes
  the first result wait for a whole wave; alone, it finishes in the shortest time the
  engine can generate it. Every second the probe measures its step time (tokens
  generated / sequences running) and projects when the first prompt finishes: while even
  twice that step time would still finish within `first_result_seconds`, it doubles the
  prompts it lets in (a GPU, whose decode steps cost about the same for 1 or 64
  sequences, is back to its full window within seconds); when the projection misses the
  budget, the probe gives up (waiting would cost throughput and buy nothing). It ends at
  the first completion; the full window follows at once.

`Window(..., adaptive=False)` is the static setting (the configured window from the
start, no probe), which `prefixflow bench batching` compares against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_WINDOW = 16
START_WINDOW = 64
"""The window before the engine has reported anything running (capped by --window)."""
PROBE_SIZE = 1
"""Prompts in flight during the probe."""
PROBE_AFTER_IDLE = 30.0
"""Seconds without work after which the next work starts with a probe again (a new job on a
quiet cluster). Shorter gaps (between two batches of one job) never throttle the engine."""
PROBE_JUDGE_EVERY = 1.0
"""Seconds between two looks at the probe's step time (the first includes its prefill)."""


def initial_window(configured: int) -> int:
    return min(configured, START_WINDOW)


def next_window(window: int, configured: int, kv_blocks: int, running: int, max_running: int) -> tuple[int, int]:
    """(new window, new max_running) after a look at the engine: `kv_blocks` is its KV
    capacity (0: none reported), `running` the requests it runs now, `max_running` the
    most seen so far."""
    if not kv_blocks:
        return configured, max_running
    max_running = max(max_running, running)
    if max_running:
        window = min(configured, max(MIN_WINDOW, 2 * max_running))
    return window, max_running


@dataclass
class Window:
    """One engine's window: `limit` is how many prompts may be in flight now.

    The worker calls `work_arrives` before it submits a prompt to an engine with nothing
    in flight, `completed` for every finished prompt, and `observe` on every status tick.
    Times are monotonic seconds; `generated` is the engine's count of generated tokens
    since it started (vLLM's iteration stats), used to measure the probe's rate."""

    configured: int
    adaptive: bool = True
    first_result_seconds: float = 10.0
    probing: bool = True
    """With `adaptive`: start each burst of work after a quiet spell with the probe (the
    worker's setting); False: size by `next_window` alone (the simulator's GPU fleets,
    where the first result's latency is not what is measured)."""
    size: int = 0
    """The throughput window (`next_window`)."""
    max_running: int = 0
    probe_since: float | None = None
    """When the running probe started (None: no probe)."""
    probe_tokens: int = 0
    """The probe prompt's token budget (max_tokens)."""
    probe_limit: int = PROBE_SIZE
    """Prompts in flight the probe allows now (doubled while the first result stays on time)."""
    probe_steps: float = 0.0
    """Decode steps the engine made since the probe started (tokens the first prompt has)."""
    judged_at: float = 0.0
    judged_generated: int = 0
    last_work: float | None = None
    """When the engine last had work in flight (None: never, since start or rebuild)."""
    probes: int = field(default=0)

    def __post_init__(self) -> None:
        self.size = initial_window(self.configured) if self.adaptive else self.configured

    @property
    def limit(self) -> int:
        return min(self.probe_limit, self.size) if self.probe_since is not None else self.size

    def work_arrives(self, now: float, inflight: int, max_tokens: int, generated: int) -> None:
        """A prompt is about to be submitted with `inflight` already in the engine."""
        quiet = self.last_work is None or now - self.last_work >= PROBE_AFTER_IDLE
        if self.adaptive and self.probing and inflight == 0 and quiet and self.probe_since is None:
            self.probe_since, self.probe_tokens, self.probe_limit, self.probe_steps = now, max_tokens, PROBE_SIZE, 0.0
            self.judged_at, self.judged_generated = now, generated
            self.probes += 1
        self.last_work = now

    def completed(self, now: float) -> None:
        self.last_work = now
        self.probe_since = None

    def reset(self) -> None:
        """The engine was rebuilt: it starts anew (cold, with a probe)."""
        self.probe_since = self.last_work = None
        self.max_running = 0
        self.__post_init__()

    def observe(self, now: float, kv_blocks: int, running: int, generated: int, inflight: int) -> None:
        """A look at the engine: size the throughput window, and judge the probe."""
        if inflight:
            self.last_work = now
        if not self.adaptive:
            return
        if self.probe_since is None:
            self.size, self.max_running = next_window(self.size, self.configured, kv_blocks, running, self.max_running)
            return
        if now - self.judged_at < PROBE_JUDGE_EVERY:
            return
        elapsed = now - self.probe_since
        steps = (generated - self.judged_generated) / max(running, 1)
        if steps <= 0:  # still in prefill (or stalled): judge it by its time alone
            if elapsed > self.first_result_seconds:
                self.probe_since = None
            return
        step_time = (now - self.judged_at) / steps
        self.judged_at, self.judged_generated = now, generated
        self.probe_steps += steps
        left = max(self.probe_tokens - self.probe_steps, 0)
        if elapsed + left * step_time > self.first_result_seconds:
            self.probe_since = None  # cannot make it: full throughput from now on
        elif elapsed + 2 * left * step_time <= self.first_result_seconds:
            self.probe_limit = min(2 * self.probe_limit, self.size)  # on time even at twice the step time
