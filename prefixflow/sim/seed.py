"""The reference table (Daft, 128 x L4, Qwen3-8B, 200k prompts) and how close we come.

Published: naive 977 s / 29.2 %, continuous 869 s / 26.5 %, global sort 563 s / 54.5 %,
dynamic prefix bucketing 482 s / 54 % (2.03x naive); scaling efficiency 0.97 at 64 GPUs
and 0.87 at 128.

The published hit rates are vLLM's prefix-cache counters of that time, which count a
lookup every time a request is looked at for admission: also the retries of a request
that waits for blocks (vllm#43736, fixed 2026) and the recomputation of preempted
requests (vllm#25780, fixed in 0.11). They are compared with the simulator's
`logged_hit_rate`, which counts the same way; `hit_rate` (cached tokens at the first
admission / prompt tokens, vLLM's `num_cached_tokens`) cannot exceed 50 % on this
dataset, and sorted's 54.5 % is above that: the proof that the published figure is the
counters'.

Scaling efficiency: E(N) = T(32) x 32 / (T(N) x N), the same job on N GPUs against 32
(the publication does not name its baseline; 32 is the smallest configuration its
64 / 128 points suggest).
"""

from __future__ import annotations

from itertools import pairwise

PUBLISHED = {
    "naive": (977.0, 0.292),
    "continuous": (869.0, 0.265),
    "sorted": (563.0, 0.545),
    "daft": (482.0, 0.54),
}
"""method -> (wall seconds, prefix-cache hit rate). `daft` is the row "dynamic prefix
bucketing": the reference's own bucketing and routing rules, as prefixflow implements them."""
PUBLISHED_SPEEDUP = 977.0 / 482.0
REFERENCE_NODES = 8
"""Bucketing streams of the reference run (Daft read the data `into_partitions(8)`, each
partition bucketed on its own): the seed runs with 8 bucketers whatever the replicas."""
PUBLISHED_SCALING = {64: 0.97, 128: 0.87}
SCALING_BASE = 32
FIT_ROWS = ("naive", "sorted")

HIT_TOLERANCE = 0.05
SPEEDUP_TOLERANCE = 0.15
SCALING_TOLERANCE = 0.05
ORDER = ("naive", "continuous", "sorted", "daft")
"""Slowest to fastest, as published."""


def fit(sim_rows: dict[str, float], startup: float) -> tuple[float, float]:
    """(speed, sort overhead seconds) so that the naive and sorted rows match the
    published times, from simulated walls at speed 1 with no sort overhead. Wall =
    startup + speed x work (+ sort overhead for sorted)."""
    speed = (PUBLISHED["naive"][0] - startup) / (sim_rows["naive"] - startup)
    sort_s = PUBLISHED["sorted"][0] - startup - speed * (sim_rows["sorted"] - startup)
    return speed, max(sort_s, 0.0)


def efficiency(walls: dict[int, float], base: int = SCALING_BASE) -> dict[int, float]:
    return {n: walls[base] * base / (t * n) for n, t in walls.items()}


def check(rows: dict[str, dict], scaling: dict[int, float] | None = None) -> list[tuple[str, bool, str]]:
    """Each tolerance of the issue: (what, met, detail). `rows`: method -> row dict with
    wall_seconds and logged_hit_rate."""
    out = []
    for method, (_, hit) in PUBLISHED.items():
        if method in rows:
            got = rows[method]["logged_hit_rate"]
            out.append((f"hit rate {method}", abs(got - hit) <= HIT_TOLERANCE, f"{got:.1%} vs {hit:.1%} (±{HIT_TOLERANCE:.0%} points)"))
    have = [m for m in ORDER if m in rows]
    walls = [rows[m]["wall_seconds"] for m in have]
    if len(have) > 1:
        out.append(("method ordering", all(a > b for a, b in pairwise(walls)),
                    " > ".join(f"{m} {rows[m]['wall_seconds']:.0f} s" for m in have)))
    if "naive" in rows and "daft" in rows:
        sp = rows["naive"]["wall_seconds"] / rows["daft"]["wall_seconds"]
        out.append(("bucketing speed-up over naive", abs(sp / PUBLISHED_SPEEDUP - 1) <= SPEEDUP_TOLERANCE,
                    f"{sp:.2f}x vs {PUBLISHED_SPEEDUP:.2f}x (±{SPEEDUP_TOLERANCE:.0%})"))
    for n, e in (scaling or {}).items():
        if n in PUBLISHED_SCALING:
            ref = PUBLISHED_SCALING[n]
            out.append((f"scaling efficiency at {n}", abs(e - ref) <= SCALING_TOLERANCE, f"{e:.3f} vs {ref:.2f} (±{SCALING_TOLERANCE})"))
    return out
