"""The engine-worker's feeding window: pure logic, no I/O (the simulator drives it too).

The worker keeps at most `window` prompts in flight in its engine. The window follows
what the engine manages to run at once (its KV cache decides): twice the most requests
ever seen running, between 16 and the configured `--window`. That keeps vLLM's queue
from running dry without pulling work out of the bucketer (where it can still be
grouped) long before the engine can use it. An engine with no KV cache to respect (the
echo engine reports no blocks) keeps the configured window.
"""

from __future__ import annotations

MIN_WINDOW = 16
START_WINDOW = 64
"""The window before the engine has reported anything running (capped by --window)."""


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
        window = max(MIN_WINDOW, min(configured, 2 * max_running))
    return window, max_running
