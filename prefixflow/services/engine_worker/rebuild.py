"""How often a dead engine is rebuilt in place before the worker gives up: pure logic."""

from __future__ import annotations

from collections import deque

from prefixflow.shared.outcomes import Exit

GAVE_UP_EXIT_CODE = Exit.ENGINE_GAVE_UP
"""Exit code when the engine cannot be rebuilt (the supervisor restarts the process)."""


class EngineGaveUp(Exception):
    """The engine died (or failed to start) more often than the rebuild budget allows."""


class RebuildBudget:
    """At most `limit` rebuild attempts within any `window` seconds; the k-th attempt in
    the window waits `backoff * 2**(k-1)` seconds first (a failed start counts too)."""

    def __init__(self, limit: int, window: float, backoff: float) -> None:
        self.limit, self.window, self.backoff = limit, window, backoff
        self.times: deque[float] = deque()

    def next_delay(self, now: float, charge: bool = True) -> float | None:
        """Seconds to wait before an attempt made `now`; None once the budget is spent.
        `charge=False`: an engine death the isolation of suspect prompts explains
        (`isolate.charged`): rebuilt at once, not counted."""
        if not charge:
            return 0.0
        while self.times and now - self.times[0] >= self.window:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return None
        delay = self.backoff * 2 ** len(self.times)
        self.times.append(now)
        return delay
