"""`prefixflow plan`'s pure parts: fleets, prices, how a sample stands for the whole
input, and the predicted rows of the plan (docs/plan.md).

**A sample stands for the input by scaling the fleet with it.** A job of N rows on R
replicas is predicted from a uniform sample of n rows on r = R x n / N replicas (at
least one; then n = N x r / R, rounded): every replica gets as many rows as in the real
job, so the wall time of the sample's simulation is the job's. GPU-hours are that wall
time times R; the hit rate is the sample's. What the sample changes: a prefix shared by
m rows of the input is shared by about m x n / N rows of the sample, so rarely shared
prefixes look rarer (the predicted hit rate and speed are, if anything, low), and each
replica holds more distinct prefixes than in the real fleet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from prefixflow.shared.outcomes import usage_error
from prefixflow.sim.cost import PROFILES, Profile, load_profile

GPUS = {"L4": "l4-8b", "H100": "h100-8b", "CPU": "cpu-tiny"}
"""GPU names `--fleet` takes -> the simulator's profile (`prefixflow.sim.cost.PROFILES`)."""
PLAN_METHODS = ("prefix-aware", "sorted", "naive")
"""The methods a plan compares: prefixflow's own, a global sort, and vLLM's offline batches."""


@dataclass(frozen=True)
class Fleet:
    replicas: int
    gpu: str
    """The GPU's name as given (upper case)."""
    profile: str
    """Its simulator profile."""

    def __str__(self) -> str:
        return f"{self.replicas}x{self.gpu}"

    def load(self) -> Profile:
        return load_profile(self.profile)


def known_gpus() -> str:
    return ", ".join(f"{g} ({p})" for g, p in GPUS.items())


def parse_fleet(text: str) -> Fleet:
    """`16xL4`, `8xH100`, `2xCPU` (or `16xl4-8b`, a profile's name): a usage error naming
    the known GPUs otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*([A-Za-z0-9._-]+)\s*", text)
    if not m:
        raise usage_error(f"--fleet {text!r}: want COUNTxGPU, e.g. 16xL4 (GPUs: {known_gpus()})")
    replicas, gpu = int(m.group(1)), m.group(2)
    if replicas < 1:
        raise usage_error(f"--fleet {text!r}: want at least one GPU")
    name = gpu.upper()
    if name in GPUS:
        return Fleet(replicas, name, GPUS[name])
    if gpu.lower() in PROFILES:
        return Fleet(replicas, gpu.lower(), gpu.lower())
    raise usage_error(f"--fleet {text!r}: unknown GPU {gpu!r}; known: {known_gpus()}")


def parse_price(text: str) -> float:
    """A price per GPU-hour: `0.80/h`, `$0.80/h`, `0.80`."""
    m = re.fullmatch(r"\s*\$?\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:/\s*(?:h|hr|hour))?\s*", text)
    if not m:
        raise usage_error(f"--price {text!r}: want a price per GPU-hour, e.g. 0.80/h")
    return float(m.group(1))


def prices_for(fleets: list[Fleet], prices: list[float]) -> list[float | None]:
    """One price for every fleet, or one per fleet in order, or none."""
    if not prices:
        return [None] * len(fleets)
    if len(prices) == 1:
        return prices * len(fleets)
    if len(prices) != len(fleets):
        raise usage_error(f"{len(prices)} --price for {len(fleets)} --fleet: give one price, or one per fleet")
    return list(prices)


@dataclass(frozen=True)
class Scale:
    """How a sample of an input's rows stands for it on a fleet (module docstring)."""

    rows: int
    """The input's rows."""
    sample_rows: int
    """Rows of the sample simulated."""
    replicas: int
    """The fleet's replicas."""
    sample_replicas: int

    @property
    def exact(self) -> bool:
        return self.sample_rows == self.rows

    def describe(self) -> str:
        if self.exact:
            return f"every row ({self.rows:,}) on {self.replicas} replicas"
        return (f"a uniform sample of {self.sample_rows:,} of {self.rows:,} rows on {self.sample_replicas} of "
                f"{self.replicas} replicas ({self.rows / self.replicas:,.0f} rows per replica, as in the job)")


def scale(rows: int, sampled: int, replicas: int) -> Scale:
    """The fleet share for a sample of `sampled` rows of `rows` (at most `sampled` rows
    are simulated: fewer when the fleet cannot be cut that finely)."""
    if sampled >= rows or rows == 0:
        return Scale(rows, rows, replicas, replicas)
    r = max(1, min(replicas, math.floor(replicas * sampled / rows)))
    n = max(1, min(sampled, round(rows * r / replicas)))
    return Scale(rows, n, replicas, r)


def scaled_profile(profile: Profile, sc: Scale) -> Profile:
    """The profile for the sample's share of the fleet: work done once for the whole input
    (the ingestors' rate over all nodes, a global sort, tokenizing up front) takes as long
    as for every row, not for the sample's."""
    from dataclasses import asdict

    p = Profile.from_dict(asdict(profile))
    f = sc.rows / sc.sample_rows if sc.sample_rows else 1.0
    p.ingest_rate /= f
    p.sort_s_per_1k *= f
    p.tokenize_s_per_1k *= f
    return p


@dataclass(frozen=True)
class Prediction:
    """One method on one fleet, for the whole input."""

    fleet: str
    method: str
    wall_seconds: float
    gpu_hours: float
    cost: float | None
    hit_rate: float

    def row(self) -> dict:
        # NOTE: wall times rounded as the limit's (limit.Limit.row): the order survives it.
        return {"fleet": self.fleet, "method": self.method, "wall_seconds": round(self.wall_seconds, 2),
                "gpu_hours": round(self.gpu_hours, 4), "cost": None if self.cost is None else round(self.cost, 4),
                "hit_rate": round(self.hit_rate, 4)}


def predict(fleet: Fleet, method: str, wall_seconds: float, hit_rate: float, price: float | None) -> Prediction:
    """The whole job's prediction from its sample's simulated wall time (the same: rows per
    replica kept)."""
    hours = wall_seconds * fleet.replicas / 3600
    return Prediction(str(fleet), method, wall_seconds, hours, None if price is None else hours * price, hit_rate)
