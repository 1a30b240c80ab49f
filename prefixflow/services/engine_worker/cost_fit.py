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


class StepFit:
    """What one engine step costs: seconds = s0 + a x computed prompt tokens + b x generated
    tokens, a least-squares fit *with* the fixed cost s0 (`CostFit` shares it between the
    tokens, right for routing at the load the engine runs at), over samples weighted by
    recency like `CostFit`. The ETA needs s0 apart (`prefixflow/shared/eta.py`): how fast
    rows go depends on how many share each step, which changes when a job's outputs
    grow. `model()` is (s0, a, b) once measured: no coefficient negative (where the free
    fit makes one negative, the best fit with it held at 0), a and b not both zero."""

    def __init__(self, tau: float = 30.0, min_steps: int = 20) -> None:
        self.tau, self.min_steps = tau, min_steps
        self.steps = self.prefill_steps = 0
        # Weighted sums of 1, p, d, t and their products (the normal equations).
        self.n = self.sp = self.sd = self.st = self.spp = self.spd = self.sdd = self.spt = self.sdt = self.stt = 0.0
        self.fitted: tuple[float, float, float] | None = None

    def add(self, seconds: float, computed: int, generated: int) -> None:
        if not (0 < seconds < 3600) or (computed <= 0 and generated <= 0):
            return
        keep = math.exp(-seconds / self.tau)
        p, d, t = float(computed), float(generated), seconds
        self.n = keep * self.n + 1.0
        self.sp, self.sd, self.st = keep * self.sp + p, keep * self.sd + d, keep * self.st + t
        self.spp, self.spd, self.sdd = keep * self.spp + p * p, keep * self.spd + p * d, keep * self.sdd + d * d
        self.spt, self.sdt, self.stt = keep * self.spt + p * t, keep * self.sdt + d * t, keep * self.stt + t * t
        self.steps += 1
        self.prefill_steps += computed > 0
        if self.steps >= self.min_steps and self.prefill_steps >= 2:
            self.fitted = self.solve() or self.fitted

    def solve(self) -> tuple[float, float, float] | None:
        """The non-negative fit of least weighted squared error: the free fit, else the
        best with one or two coefficients held at 0."""
        m = [[self.n, self.sp, self.sd], [self.sp, self.spp, self.spd], [self.sd, self.spd, self.sdd]]
        v = [self.st, self.spt, self.sdt]
        best, best_err = None, math.inf
        for free in ((0, 1, 2), (0, 1), (0, 2), (1, 2), (1,), (2,)):
            sub = _solve([[m[i][j] for j in free] for i in free], [v[i] for i in free])
            if sub is None or any(x < 0 for x in sub):
                continue
            x = [0.0, 0.0, 0.0]
            for i, xi in zip(free, sub, strict=True):
                x[i] = xi
            if x[1] + x[2] <= 0:
                continue
            err = self.stt - 2 * sum(x[i] * v[i] for i in range(3)) + sum(
                x[i] * m[i][j] * x[j] for i in range(3) for j in range(3))
            if err < best_err - 1e-15:
                best, best_err = (x[0], x[1], x[2]), err
        return best

    def model(self) -> tuple[float, float, float] | None:
        return self.fitted


def _det(a: list[list[float]]) -> float:
    if len(a) == 1:
        return a[0][0]
    if len(a) == 2:
        return a[0][0] * a[1][1] - a[0][1] * a[1][0]
    return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """x with m x = v for a symmetric m of size 1-3 (Cramer's rule), None when m is
    (nearly) singular."""
    d = _det(m)
    scale = math.prod(m[i][i] for i in range(len(m)))
    if scale <= 0 or abs(d) <= 1e-9 * scale:
        return None
    return [_det([[v[r] if c == col else m[r][c] for c in range(len(m))] for r in range(len(m))]) / d
            for col in range(len(m))]
