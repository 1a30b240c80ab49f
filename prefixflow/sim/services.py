"""The router's and the bucketers' loops, simulated: `RouterSim` makes the router service's
decisions (`Router.on_status`, `Router.decide`) with its own fleet and policy objects;
`BucketerSim` runs a bucketer's intake and dispatch loops around its own prefix buffer.
Driven by the cluster's clock (`prefixflow.sim.cluster`)."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import numpy as np

from prefixflow.services.bucketer.buffer import Bucket, Item, PrefixBuffer
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import make_policy
from prefixflow.shared.wire.messages import cost_shares

# `Sim` in annotations: `prefixflow.sim.cluster.Sim`, the clock that drives this (not imported: it imports this module).

EAGER_MIN_WAIT = 0.1
SEND_CONCURRENCY = 32
INTAKE_MESSAGES = 4
DISPATCH_TICK = 0.2
INTAKE_POLL = 0.05


class RouterSim:
    """The router service's decisions: `Router.on_status` and `Router.decide`."""

    def __init__(self, sim: Sim, policy: str) -> None:
        cfg = sim.opts.router
        self.sim = sim
        self.fleet = Fleet(dead_after=cfg.dead_after, cap_tokens=cfg.replica_cap_tokens, history=cfg.history,
                           cap_windows=cfg.cap_windows, start_windows=cfg.start_windows, lead_seconds=cfg.lead_seconds,
                           hash_block_size=cfg.hash_block_size)
        self.policy = make_policy(policy, slack_tokens=cfg.load_slack_tokens, split_factor=cfg.split_factor,
                                  hot_factor=cfg.hot_factor)
        self.trace: list | None = [] if sim.opts.record else None
        self.decisions = 0
        self.splits = 0
        self.version = 0
        """Bumped by every status and every assignment: the fleet's state changed."""
        self.failed_version = -1
        self.retry_after = 0.05
        """The version at the last decision that found no open replica."""

    def on_status(self, now: float, name: str, st: dict) -> None:
        if self.trace is not None:
            self.trace.append(("status", now, name, dict(st)))
        self.version += 1
        r = self.fleet.replicas.get(name)
        before = r.outstanding if r is not None else None
        self.fleet.observe(name, now, **st)
        r = self.fleet.replicas[name]
        freed = before is None or r.outstanding < before
        if freed and self.fleet.is_open(r, now):
            # One NATS publish every bucketer receives; a notice still on its way to a
            # bucketer covers this one too (setting an event twice = once).
            hop = self.sim.profile.hop_s
            for b in self.sim.bucketers:
                if not b.freed_in_flight:
                    b.freed_in_flight = True
                    self.sim.at(now + hop, b.on_freed)

    def room(self, now: float) -> float:
        return self.fleet.room(now) if self.policy.eager else 0.0

    def decide(self, now: float, prompts: int, tokens: int, key: list[int], parts: list[tuple], output: int = -1,
               lora: str = ""):
        if self.version == self.failed_version:
            # Every policy answers None only when no replica is open, and changes nothing
            # then; nothing happened since the last such answer (replicas only close with
            # time), so this one would be None too.
            return None
        if parts:
            chosen = self.policy.route_parts(self.fleet, now, parts, key, defer=True)
        else:
            chosen = self.policy.route(self.fleet, now, prompts, tokens, key, output, lora, defer=True)
        out = None if chosen is None else [("" if r is None else r.name, n, c)
                                           for (r, n), c in zip(chosen, self.policy.last_costs, strict=True)]
        if out is None:
            self.failed_version = self.version
            # Capped: retry once the next status may have freed room; none live: 1 s.
            self.retry_after = 1.0 if not self.fleet.live(now) else 0.05
        else:
            self.version += 1
        if self.trace is not None:
            self.trace.append(("route", now, prompts, tokens, list(key),
                               [(p[0], p[1], list(p[2]), *p[3:]) for p in parts], output, out, lora))
        if out is not None:
            self.decisions += 1
            self.splits += sum(1 for name, _, _ in out if name) > 1
        return out


class BucketerSim:
    """One bucketer's intake and dispatch loops (`prefixflow/services/bucketer/service.py`)."""

    def __init__(self, sim: Sim, node: str) -> None:
        cfg = sim.opts.bucketer
        self.sim = sim
        self.node = node
        self.cfg = cfg
        self.buffer = PrefixBuffer(max_prompts=cfg.buffer_prompts, max_bytes=cfg.buffer_bytes, min_bucket=cfg.min_bucket,
                                   threshold=cfg.threshold, max_wait=cfg.max_wait, block_size=cfg.hash_block_size,
                                   pool_size=cfg.pool_size, max_bucket=cfg.max_bucket)
        self.pending: deque[list[int]] = deque()
        """Messages on this node's bucket stream, not yet taken."""
        self.last_input = 0.0
        self.intake_scheduled = False
        self.dispatching = False
        """A dispatch iteration is sending buckets."""
        self.tick_at = math.inf
        self.freed_waiters: list[Callable[[float], None]] = []
        self.freed_in_flight = False
        self.sends_left = 0
        self.chunks: deque[list[Bucket]] = deque()

    # intake -----------------------------------------------------------------------------

    def deliver(self, now: float, msg: list[int]) -> None:
        self.pending.append(msg)
        self.schedule_intake(now)

    def schedule_intake(self, now: float) -> None:
        if not self.intake_scheduled:
            self.intake_scheduled = True
            self.sim.at(now, self.intake)

    def intake(self, now: float) -> None:
        self.intake_scheduled = False
        if self.buffer.over():
            self.last_input = now  # backpressure: input is waiting
            if self.pending or not self.sim.ingest_done:
                self.intake_scheduled = True
                self.sim.at(now + INTAKE_POLL, self.intake)
            return
        took = False
        wl = self.sim.wl
        for _ in range(INTAKE_MESSAGES):
            if not self.pending:
                break
            for i in self.pending.popleft():
                t = wl.tokens[i]
                self.buffer.insert(Item(t, now, i, None, len(t) // 4 + int(wl.output_len[i]), wl.lora_of(i)))
            took = True
        if took:
            self.last_input = now
            if self.pending:
                self.schedule_intake(now)
            self.wake(now)

    def caught_up(self) -> bool:
        return self.sim.ingest_done and not self.pending

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
        if self.dispatching:
            return
        if tick and now < self.tick_at - 1e-12:
            return  # a stale timer: an earlier wake ran the loop since
        cfg = self.cfg
        buf = self.buffer
        idle = bool(buf) and now - self.last_input >= cfg.idle_flush and self.caught_up()
        oldest = buf.oldest()
        waited = -1.0 if oldest is None else now - oldest
        settled = waited >= cfg.eager_delay or (waited >= EAGER_MIN_WAIT and self.caught_up())
        budget = 0.0
        if settled and not idle and cfg.eager:
            budget = self.sim.router.room(now)
        before = len(buf)
        buckets = buf.pop(now, flush=idle, budget=budget)
        if len(buf) < before:
            self.schedule_intake(now)
        if buckets:
            self.dispatching = True
            self.chunks = deque(buckets[i : i + SEND_CONCURRENCY] for i in range(0, len(buckets), SEND_CONCURRENCY))
            self.next_chunk(now)
        else:
            self.idle_wait(now)

    def idle_wait(self, now: float) -> None:
        if self.sim.done >= self.sim.n and not self.buffer:
            return
        self.tick_at = now + DISPATCH_TICK
        self.sim.at(self.tick_at, self.dispatch, True)

    def next_chunk(self, now: float) -> None:
        if not self.chunks:
            self.dispatching = False
            self.idle_wait(now)
            return
        chunk = self.chunks.popleft()
        self.sends_left = len(chunk)
        hop = self.sim.profile.hop_s
        for b in chunk:
            self.sim.at(now + hop, self.route, b)

    def route_request(self, bucket: Bucket) -> tuple[int, int, list[int], list[tuple], int, str]:
        """As `Bucketer.route_request`: (prompts, work tokens, key, parts, output budget,
        LoRA adapter)."""
        parts = []
        start = 0
        out_len = self.sim.wl.output_len
        for n, key in bucket.parts:
            items = bucket.items[start : start + n]
            parts.append((n, sum(it.weight for it in items), key, int(sum(out_len[it.payload] for it in items)),
                          items[0].lora))
            start += n
        output = int(sum(out_len[it.payload] for it in bucket.items))
        lora = "" if bucket.pooled or not bucket.items else bucket.items[0].lora
        return len(bucket.items), sum(it.weight for it in bucket.items), bucket.key, parts, output, lora

    def route(self, now: float, bucket: Bucket, request=None) -> None:
        if request is None:  # built once per send, as the service encodes it once
            request = self.route_request(bucket)
        prompts, tokens, key, parts, output, lora = request
        got = self.sim.router.decide(now, prompts, tokens, key, parts, output, lora)
        hop = self.sim.profile.hop_s
        if got is None:
            delay = self.sim.router.retry_after
            state = {"done": False}

            def retry(t: float) -> None:
                if not state["done"]:
                    state["done"] = True
                    self.sim.at(t + hop, self.route, bucket, request)

            self.freed_waiters.append(retry)
            self.sim.at(now + hop + delay, lambda t: retry(t - hop))
            return
        start = 0
        max_batch = self.sim.opts.bucketer.max_batch
        back = []
        for name, n, cost in got:
            items = bucket.items[start : start + n]
            start += n
            if not name:  # deferred: back into the buffer (`Bucketer.send`)
                back += items
                continue
            charge(self.sim.cost, items, cost)
            w = self.sim.workers_by_name[name]
            for k in range(0, len(items), max_batch):
                self.sim.at(now + 2 * hop, w.receive, [it.payload for it in items[k : k + max_batch]], tuple(bucket.key))
        if back:
            for it in back:
                self.buffer.insert(it)
        self.sim.at(now + 3 * hop, self.sent)

    def sent(self, now: float) -> None:
        self.sends_left -= 1
        if self.sends_left == 0:
            self.next_chunk(now)


def charge(costs: np.ndarray, items: list[Item], cost: int) -> None:
    """As `messages.charge_prompts`: the assignment's cost shared out over its prompts."""
    if cost > 0:
        for it, share in zip(items, cost_shares(cost, [it.weight for it in items]), strict=True):
            costs[it.payload] = share
