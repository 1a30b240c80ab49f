"""What an engine spends on a prompt token and on an output token, measured. Pure logic.

The router counts a replica's load in engine cost (`prefixflow/services/router/policies.py`,
`Fleet.charge`): a prompt's uncached prompt tokens, plus its output tokens at what an
output token costs relative to an uncached prompt token. That ratio differs by machine
and by load: on a GPU a decode step is bound by memory and a prefill by compute (an
output token costs tens of prompt tokens); on the 2-core CPU of the tests about 2.

Each engine step is a sample: its duration, the prompt tokens it computed (cached ones
excluded: vLLM's `PromptTokenStats.computed`) and the tokens it generated. The fit is a
least-squares line through the origin, seconds = a x computed + b x generated, over
samples weighted by recency (time constant `tau` seconds of busy time): the fixed cost of
a step is shared between its tokens, which is what a token costs at the load the engine
runs at. `ratio` = b / a, reported once both are measured and positive; a step mix that
cannot separate them (every step alike) keeps the last ratio. The simulator feeds the
same class from its simulated steps.
"""

from __future__ import annotations

import math

MIN_RATIO, MAX_RATIO = 0.05, 200.0
"""Bounds of a reported ratio (a fit outside them is noise)."""


class CostFit:
    def __init__(self, tau: float = 30.0, min_steps: int = 20) -> None:
        self.tau = tau
        self.min_steps = min_steps
        self.steps = 0
        """Samples seen."""
        self.prefill_steps = 0
        """Samples that computed prompt tokens (the prompt cost needs some)."""
        self.spp = self.spd = self.sdd = self.spt = self.sdt = 0.0
        self.ratio = 0.0
        """Output token cost / uncached prompt token cost (0: not measured yet)."""
        self.prompt_seconds = 0.0
        self.output_seconds = 0.0
        """The fitted seconds per uncached prompt token and per output token (0: not yet)."""

    def add(self, seconds: float, computed: int, generated: int) -> None:
        """One engine step that took `seconds` and computed / generated these tokens."""
        if seconds <= 0 or (computed <= 0 and generated <= 0):
            return
        keep = math.exp(-seconds / self.tau)
        p, d = float(computed), float(generated)
        self.spp = keep * self.spp + p * p
        self.spd = keep * self.spd + p * d
        self.sdd = keep * self.sdd + d * d
        self.spt = keep * self.spt + p * seconds
        self.sdt = keep * self.sdt + d * seconds
        self.steps += 1
        self.prefill_steps += computed > 0
        if self.steps >= self.min_steps and self.prefill_steps >= 2:
            self.solve()

    def solve(self) -> None:
        det = self.spp * self.sdd - self.spd * self.spd
        if det <= 1e-6 * self.spp * self.sdd:  # (nearly) collinear: no separate costs
            return
        a = (self.spt * self.sdd - self.sdt * self.spd) / det
        b = (self.sdt * self.spp - self.spt * self.spd) / det
        if a <= 0 or b <= 0:
            return
        self.prompt_seconds, self.output_seconds = a, b
        self.ratio = min(max(b / a, MIN_RATIO), MAX_RATIO)
