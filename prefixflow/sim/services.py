"""The router and the bucketers in the simulated cluster: glue around the services' own
decision cores, driven by the cluster's clock (`prefixflow.sim.cluster`).

- `RouterSim` holds the router's `Decider` (`prefixflow/services/router/decision.py`):
  statuses arrive after a hop and go to `Decider.observe`, route requests to
  `Decider.decide`, room questions to `Decider.room`; a freed-room answer becomes the
  router's notice to every bucketer.
- `BucketerSim` holds a bucketer's `Release` (`prefixflow/services/bucketer/release.py`,
  one lane: the simulated workload is one job) and plays the service's intake and
  dispatch loops around it: the same calls in the same order, the same waits
  (`INTAKE_WAIT`, `DISPATCH_WAIT`, `SEND_CONCURRENCY`, `RETRY_WAIT`), NATS as a fixed hop.

Nothing here decides: a rule or a constant of a decision lives in the services and is
imported (`tests/unit/test_sim_no_rules.py` fails on a copy).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import msgspec

from prefixflow.services.bucketer.buffer import Bucket, Item
from prefixflow.services.bucketer.release import (DISPATCH_WAIT, INTAKE_WAIT, RETRY_WAIT, SEND_CONCURRENCY, Inflow,
                                                  Release)
from prefixflow.services.router.decision import Decider
from prefixflow.shared.wire import messages as m

# `Sim` in annotations: `prefixflow.sim.cluster.Sim`, the clock that drives this (not imported: it imports this module).

JOB = "sim"
"""The simulated workload's job id (its bucketers' one lane)."""


class RouterSim:
    """The router service (`Router`) around its `Decider`."""

    def __init__(self, sim: Sim, policy: str) -> None:
        self.sim = sim
        self.core = Decider(msgspec.structs.replace(sim.opts.router, policy=policy))
        self.trace: list | None = [] if sim.opts.record else None
        """With `Options.record`: ("status", time, EngineStatus) and ("route", time,
        RouteRequest, RouteReply), in the order the router saw them."""

    @property
    def decisions(self) -> int:
        return self.core.routed

    @property
    def splits(self) -> int:
        return self.core.split

    def status_arrives(self, now: float, status: m.EngineStatus) -> None:
        """`Router.run`'s status subscription: apply it; freed room is announced."""
        if self.trace is not None:
            self.trace.append(("status", now, status))
        if self.core.observe(now, status):
            # One NATS publish every bucketer receives; a notice still on its way to a
            # bucketer covers this one too (setting an event twice = once).
            hop = self.sim.profile.hop_s
            for b in self.sim.bucketers:
                if not b.freed_in_flight:
                    b.freed_in_flight = True
                    self.sim.at(now + hop, b.on_freed)

    def ask(self, now: float, req: m.RouteRequest) -> m.RouteReply:
        """`Router.on_route`: the decider's answer."""
        reply = self.core.decide(now, req).reply
        if self.trace is not None:
            self.trace.append(("route", now, req, reply))
        return reply


class BucketerSim:
    """One bucketer's intake and dispatch loops (`Bucketer.intake`, `Bucketer.dispatch`,
    `Bucketer.send`) around its `Release`."""

    def __init__(self, sim: Sim, node: str) -> None:
        self.sim = sim
        self.node = node
        self.core = Release(sim.opts.bucketer)
        self.pending: deque[list[int]] = deque()
        """Messages on this node's bucket stream, not yet taken."""
        self.intake_scheduled = False
        self.dispatching = False
        """A dispatch iteration is sending buckets."""
        self.tick_at = math.inf
        self.freed_waiters: list[Callable[[float], None]] = []
        self.freed_in_flight = False
        self.sends_left = 0
        self.chunks: deque[list[tuple[str, Bucket]]] = deque()

    def inflow(self) -> Inflow:
        """Messages here not yet taken; the ingestors' input not all published yet."""
        return Inflow({JOB: len(self.pending)} if self.pending else {}, () if self.sim.ingest_done else (JOB,))

    # intake -----------------------------------------------------------------------------

    def deliver(self, now: float, msg: list[int]) -> None:
        self.pending.append(msg)
        self.schedule_intake(now)

    def schedule_intake(self, now: float) -> None:
        if not self.intake_scheduled:
            self.intake_scheduled = True
            self.sim.at(now, self.intake)

    def intake(self, now: float) -> None:
        """One round of `Bucketer.intake`: pull what `Release.fetch` allows."""
        self.intake_scheduled = False
        if not self.pending:
            return
        n = self.core.fetch(JOB, 1, self.inflow())
        if not n:  # the lane is full: backpressure until the dispatcher releases
            self.intake_scheduled = True
            self.sim.at(now + INTAKE_WAIT, self.intake)
            return
        wl = self.sim.wl
        for _ in range(min(n, len(self.pending))):
            for i in self.pending.popleft():
                t = wl.tokens[i]
                out = int(wl.output_len[i])
                # As `Bucketer.take`: weight `Prompt.work_tokens`, output `Prompt.max_tokens`.
                self.core.insert(JOB, 1, Item(t, now, i, None, len(t) // 4 + out, wl.lora_of(i), out))
        if self.pending:
            self.schedule_intake(now)
        self.wake(now)

    # dispatch ---------------------------------------------------------------------------

    def wake(self, now: float) -> None:
        if not self.dispatching:
            self.sim.at(now, self.dispatch)

    def on_freed(self, now: float) -> None:
        self.freed_in_flight = False
        waiters, self.freed_waiters = self.freed_waiters, []
        for w in waiters:
            w(now)
        self.wake(now)

    def dispatch(self, now: float, tick: bool = False) -> None:
        """One round of `Bucketer.dispatch`."""
        if self.dispatching:
            return
        if tick and now < self.tick_at - 1e-12:
            return  # a stale timer: an earlier wake ran the loop since
        core = self.core
        inflow = self.inflow()
        budget = core.budget(self.sim.router.core.room(now)) if core.wants_room(now, inflow) else core.no_budget()
        before = len(core)
        released = core.release(now, inflow, budget)
        if len(core) < before:
            self.schedule_intake(now)
        if released:
            self.dispatching = True
            self.chunks = deque(released[i : i + SEND_CONCURRENCY] for i in range(0, len(released), SEND_CONCURRENCY))
            self.next_chunk(now)
        else:
            self.idle_wait(now)

    def idle_wait(self, now: float) -> None:
        if self.sim.done >= self.sim.n and not self.core:
            return
        self.tick_at = now + DISPATCH_WAIT
        self.sim.at(self.tick_at, self.dispatch, True)

    def next_chunk(self, now: float) -> None:
        if not self.chunks:
            self.dispatching = False
            self.idle_wait(now)
            return
        chunk = self.chunks.popleft()
        self.sends_left = len(chunk)
        hop = self.sim.profile.hop_s
        for job, b in chunk:
            self.sim.at(now + hop, self.send, job, b)

    def send(self, now: float, job: str, bucket: Bucket, request: m.RouteRequest | None = None) -> None:
        """`Bucketer.send`: ask the router (again on retry-after, after its delay or the
        next freed-room notice), then publish each replica's prompts."""
        if request is None:  # built once per send, as the service encodes it once
            request = self.core.route_request(self.node, bucket)
        reply = self.sim.router.ask(now, request)
        hop = self.sim.profile.hop_s
        if not reply.assignments:
            state = {"done": False}

            def retry(t: float) -> None:
                if not state["done"]:
                    state["done"] = True
                    self.sim.at(t + hop, self.send, job, bucket, request)

            self.freed_waiters.append(retry)
            self.sim.at(now + hop + (reply.retry_after or RETRY_WAIT), lambda t: retry(t - hop))
            return
        max_batch = self.sim.opts.bucketer.max_batch
        cost = self.sim.cost
        for placed in self.core.place(job, bucket, reply.assignments):
            for it, share in zip(placed.items, placed.shares):
                cost[it.payload] = share
            w = self.sim.workers_by_name[placed.replica]
            items = placed.items
            for k in range(0, len(items), max_batch):
                self.sim.at(now + 2 * hop, w.receive, [it.payload for it in items[k : k + max_batch]], tuple(bucket.key))
        self.sim.at(now + 3 * hop, self.sent)

    def sent(self, now: float) -> None:
        self.sends_left -= 1
        if self.sends_left == 0:
            self.next_chunk(now)
