"""A routing decision's assignments: (replica, prompts) pieces of a bucket, in its prompt
order, and their bookkeeping in the fleet. Pure logic, no I/O.

A None replica marks prompts deferred: handed back to the asker (a bucketer puts them
back in its buffer) because the replicas chosen have no room for them (`fit_room`, the
bounded lead).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.router.fleet import Fleet, Replica

Assignments = list[tuple[Replica | None, int]]
"""(replica, prompts) in the bucket's prompt order; a None replica: prompts deferred."""


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
    outstanding work, in engine cost, rounded up to whole prompts), the rest of it as a
    (None, n) assignment: prompts the asker keeps for later (a bucketer puts them back
    in its buffer), where a replica that comes up later or runs dry first can take them.
    At least one prompt is placed. Without it a replica just under its cap takes a
    whole bucket (up to the bucketer's `max_bucket` prompts): minutes of work on a GPU,
    queued there while replicas started since stay idle."""
    keeps = []
    for r, n in placed:
        room = fleet.cap(r) - r.outstanding
        cost = fleet.charge(r, n, prompts, tokens, output, key) if math.isfinite(room) else 0
        keeps.append(min(n, max(0, math.ceil(n * room / cost))) if cost > room else n)
    if placed and not any(keeps):  # progress: the first piece takes one
        keeps[0] = 1
    out: Assignments = []
    for (r, n), keep in zip(placed, keeps, strict=True):
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
