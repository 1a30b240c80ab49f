"""When to restart a local cluster's processes: backoff and restart budget, no I/O.

`prefixflow run` supervises its processes (`prefixflow.launch.local_cluster.LocalCluster.supervise`
does the process handling); the decisions live here so they can be tested on their own.

- `Backoff` is one process's history. `on_exit(now)` answers with the delay before the
  restart (1 s, doubling with each exit in a row, at most 30 s) or `GiveUp` once the
  process has used its budget (5 restarts within 10 minutes). A process that stayed up
  for `stable_after` seconds starts again from the first delay.
- `Supervisor` holds one `Backoff` per process and knows which processes are engine
  replicas: a replica that spends its budget is dropped (`Drop`: the job goes on on the
  others, the router fails its work over), and the whole run gives up only when no
  replica is left, or when a singleton (nats-server, a service) spends its budget.

NOTE: no well-kept library does this in-process: honcho stops everything when one
process exits, supervisord and circus are daemons with their own event loops (and
circus retries at a fixed interval with a consecutive-failure cap, not a budget over a
window), and retry libraries (tenacity, backoff) wrap calls, not process lifetimes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    first_delay: float = 1.0
    """Seconds before the first restart."""
    factor: float = 2.0
    """Each exit in a row multiplies the delay by this."""
    max_delay: float = 30.0
    """The delay never exceeds this (seconds)."""
    budget: int = 5
    """At most this many restarts of one process within `window` seconds."""
    window: float = 600.0
    """The budget's sliding window (seconds)."""
    stable_after: float = 60.0
    """A process up this long counts as healthy again: its next exit starts over at `first_delay`."""


@dataclass(frozen=True)
class GiveUp:
    """Stop trying: the run fails with `reason`."""

    reason: str


@dataclass(frozen=True)
class Drop:
    """Do not restart this replica; the others carry on."""

    reason: str


Decision = float | GiveUp | Drop
"""Seconds to wait before restarting, or why not."""


@dataclass
class Backoff:
    """One process's restart history."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    restarts: deque[float] = field(default_factory=deque)
    """Exit times within the window that were granted a restart."""
    streak: int = 0
    """Exits in a row without a stable run in between."""
    started_at: float | None = None
    spent: str | None = None
    """Set once the budget is spent: every later exit gives up too."""

    def on_start(self, now: float) -> None:
        self.started_at = now

    def on_exit(self, now: float) -> float | GiveUp:
        """The process exited at `now`: the delay before its restart, or `GiveUp`."""
        p = self.policy
        if self.spent is not None:
            return GiveUp(self.spent)
        if self.started_at is not None and now - self.started_at >= p.stable_after:
            self.streak = 0
        while self.restarts and now - self.restarts[0] >= p.window:
            self.restarts.popleft()
        if len(self.restarts) >= p.budget:
            self.spent = f"{len(self.restarts)} restarts within {p.window / 60:g} min"
            return GiveUp(self.spent)
        delay = min(p.max_delay, p.first_delay * p.factor**self.streak)
        self.streak += 1
        self.restarts.append(now)
        return delay


class Supervisor:
    """Restart decisions for a set of named processes, some of them engine replicas."""

    def __init__(self, names: list[str], replicas: set[str], policy: RestartPolicy | None = None) -> None:
        unknown = replicas - set(names)
        if unknown:
            raise ValueError(f"replicas not among the processes: {sorted(unknown)}")
        self.policy = policy or RestartPolicy()
        self.backoff = {n: Backoff(self.policy) for n in names}
        self.replicas = set(replicas)
        self.dropped: set[str] = set()
        self.restarts: dict[str, int] = {n: 0 for n in names}
        """Restarts granted per process (the run's final report)."""
        self.forgiven: set[str] = set()
        """Processes whose next exit was caused from outside (`forgive`)."""

    def forgive(self, name: str) -> None:
        """`name` was just killed on purpose (the torture harness's fault injection, an
        operator): its next exit is restarted at once and not counted against its budget,
        which is for exits of the process's own making (a crash loop)."""
        self.forgiven.add(name)

    def started(self, name: str, now: float) -> None:
        self.backoff[name].on_start(now)

    def exited(self, name: str, now: float) -> Decision:
        """`name` exited unexpectedly at `now`: restart after the returned delay, drop
        it (a replica out of budget while others remain), or give the run up."""
        if name in self.forgiven:
            self.forgiven.discard(name)
            self.restarts[name] += 1
            return self.policy.first_delay
        decision = self.backoff[name].on_exit(now)
        if not isinstance(decision, GiveUp):
            self.restarts[name] += 1
            return decision
        why = f"{name} exited again after {decision.reason}"
        if name not in self.replicas:
            return GiveUp(why)
        self.dropped.add(name)
        left = sorted(self.replicas - self.dropped)
        if not left:
            return GiveUp(f"{why}; no engine replica can come back")
        return Drop(f"{why}; carrying on with {', '.join(left)}")
