"""A routing decision's assignments: (replica, prompts) pieces of a bucket, in its prompt
order, and their bookkeeping in the fleet. Pure logic, no I/O.

A None replica marks prompts deferred: handed back to the asker (a bucketer puts them
back in its buffer) because the replicas chosen have no room for them (`fit_room`, the
bounded lead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prefixflow.services.router.fleet import Fleet, Replica

Assignments = list[tuple[Replica | None, int]]
"""(replica, prompts) in the bucket's prompt order; a None replica: prompts deferred."""

MIN_CUT_PROMPTS = 32
"""A cut leaves at least this many prompts of a piece on its replica (all of a smaller
piece). Each piece computes its prefix once where it lands; cut to the last prompt, a
group's kept prompts went out a few at a time to whichever replica had just freed room:
in the simulator's seed at 128 L4s the hit rate fell from 49.5 % to 34.8 % and the job
took 623 s instead of 548 s. (Proportionate runs at 16 L4s and at 128 staggered, pieces of
at least 8 / 16 / 32 / 48 / 64 prompts: 556 / 548 / 542 / 543 / 551 s and 149 / 149 /
150 / 157 / 160 s; to the last prompt 569 and 150 s; whole buckets with two windows
before the rate, the old default, 556 and 237 s.)"""


def commit(fleet: Fleet, chosen: Assignments, prompts: int, tokens: int, output: int, key: Sequence[int],
           lora: str) -> tuple[list[int], list[int]]:
    """Charge and assign the placed pieces of a decision (the deferred ones cost nothing):
    the prefix blocks of `key` each placed replica's history held before, and the cost of
    every assignment."""
    placed = [(r, n) for r, n in chosen if r is not None]
    matches = [fleet.best_match(r, key)[0] for r, _ in placed] if key else []
    charged = fleet.charges(placed, prompts, tokens, output, key)
    fleet.assign_all(placed, charged, key, lora)
    costs = iter(charged)
    return matches, [0 if r is None else next(costs) for r, _ in chosen]


def fit_room(fleet: Fleet, placed: Assignments, prompts: int, tokens: int, output: int,
             key: Sequence[int]) -> Assignments:
    """Bounded lead: each piece cut to what its replica has room for (`Fleet.cap` less its
    outstanding work, in engine cost, rounded up to whole prompts, at least
    `MIN_CUT_PROMPTS`), the rest of it as a (None, n) assignment: prompts the asker keeps
    for later (a bucketer puts them back in its buffer), where a replica that comes up
    later or runs dry first can take them. Without it a replica just under its cap takes
    a whole bucket (up to the bucketer's `max_bucket` prompts): minutes of work on a GPU,
    queued there while replicas started since stay idle."""
    out: Assignments = []
    for r, n in placed:
        room = fleet.cap(r) - r.outstanding
        keep = n
        if math.isfinite(room):
            cost = fleet.charge(r, n, prompts, tokens, output, key)
            if cost > room:
                keep = max(min(n, MIN_CUT_PROMPTS), math.ceil(n * room / cost))
        for piece in ((r, keep), (None, n - keep)):
            if piece[1]:
                if out and out[-1][0] is None and piece[0] is None:
                    out[-1] = (None, out[-1][1] + piece[1])
                else:
                    out.append(piece)
    return out


def extend_merged(out: Assignments, placed: Assignments, out_costs: list[int], costs: Sequence[int]) -> None:
    """Append assignments to `out` (and their costs to `out_costs`), merging one for the
    replica `out` ends with."""
    for (r, n), cost in zip(placed, costs, strict=True):
        if out and out[-1][0] is r:
            out[-1] = (r, out[-1][1] + n)
            out_costs[-1] += cost
        else:
            out.append((r, n))
            out_costs.append(cost)
