"""The workload's limit: a lower bound on any method's wall time, from the data and the
hardware alone. Pure logic.

It assumes the best any scheduler could do, and nothing a real one must pay:

1. **Ideal hit rate.** Every distinct engine block of prompt tokens (a block is named by
   its chain hash, as vLLM's prefix cache names it: the same tokens after the same
   prefix) is computed once in the whole fleet, as if one unbounded cache served every
   replica, and hit by every later prompt; a prompt's tokens past its last full block
   (and its last token) are always computed (`prefixflow.datagen.shapes.ideal_count`, the
   count `prefixflow dataset` prints). So the fleet computes `ideal_prefill_tokens`
   prompt tokens, and the ideal hit rate is 1 - that / all prompt tokens.
2. **Perfect balance.** That engine work, priced by the profile's step cost
   (`Profile.step_seconds`: c_pf per computed prompt token; c_dec and c_ctx per decode
   step of a request, whose context is at least its prompt; c0 per step, and a step
   makes at most `max_num_seqs` tokens), spread evenly over the replicas from when
   each is up (`cluster.work_bound`).
3. **The longest request.** A request of L output tokens needs L engine steps one after
   the other, each at least c0: no fleet finishes before the start-up plus that.

The limit is the larger of 2 and 3, plus the profile's tail. Every simulated method's
wall time is at least this (`tests/unit/test_plan.py` checks it on random workloads); the
gap says how much better than a method the best possible schedule could do.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from prefixflow.datagen.shapes import ideal_count
from prefixflow.sim.cluster import work_bound
from prefixflow.sim.cost import Profile
from prefixflow.sim.workload import Workload


@dataclass(frozen=True)
class Limit:
    wall_seconds: float
    ideal_hit_rate: float
    ideal_prefill_tokens: int
    engine_seconds: float
    """Replica-seconds of engine work at the ideal hit rate."""

    def row(self) -> dict:
        return {"wall_seconds": round(self.wall_seconds, 2), "ideal_hit_rate": round(self.ideal_hit_rate, 4),
                "ideal_prefill_tokens": self.ideal_prefill_tokens, "engine_seconds": round(self.engine_seconds, 2)}


def ideal_prefill_tokens(wl: Workload, block_size: int) -> int:
    """Prompt tokens the fleet must compute at least: the dataset generator's count with
    an unbounded cache (`prefixflow.datagen.shapes.ideal_count`) over the workload's ids."""
    ids = [np.frombuffer(t, dtype=">u4") for t in wl.tokens]
    count = ideal_count(ids, block_size)
    return count.prompt_tokens - count.cached_tokens


def workload_limit(wl: Workload, profile: Profile, replicas: int, ready: list[float] | None = None) -> Limit:
    """The limit of `wl` on `replicas` replicas of `profile` (see the module docstring),
    each up from its `ready` time (default: all at the profile's start-up; a staggered
    fleet's: `cluster.replica_ready_times`)."""
    prompt = wl.total_prompt_tokens()
    prefill = ideal_prefill_tokens(wl, profile.block_size)
    out = np.asarray(wl.output_len, dtype=np.int64)
    lens = np.fromiter((wl.prompt_len(i) for i in range(len(wl))), dtype=np.int64, count=len(wl))
    decode_steps = np.maximum(out - 1, 0)  # the first output token comes with the prefill
    steps = float(np.ceil(out.sum() / profile.max_num_seqs)) if len(wl) else 0.0
    engine = profile.speed * (profile.c_pf * prefill + profile.c_dec * float(decode_steps.sum())
                              + profile.c_ctx * float((decode_steps * lens).sum()) + profile.c0 * steps)
    ready = list(ready) if ready is not None else [profile.startup_s] * replicas
    chain = min(ready) + profile.speed * profile.c0 * float(out.max() if len(wl) else 0)
    wall = max(work_bound(ready, engine), chain) + profile.tail_s
    return Limit(wall, 1 - prefill / prompt if prompt else 0.0, prefill, engine)
