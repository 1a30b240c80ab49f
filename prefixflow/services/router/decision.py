"""The router's decisions: pure logic, no NATS, no asyncio (as vLLM's `Scheduler` is driven
by `EngineCore`). Two drivers call the same `Decider`:
- the router service (`prefixflow/services/router/service.py`): its status, cache-event
  and request handlers, with the monotonic clock;
- the simulator (`prefixflow/sim/services.py`), with its discrete-event clock.

One route decision reads: `Decider.decide` -> the policy (`policies.py`: candidates from
the fleet's open replicas, adapters, hot prefixes, the prefix match, the split) -> the
fleet records it (`fleet.py`: charge, history, caps) -> a `RouteReply`.

What the decider keeps besides the fleet and the policy:
- the answers to the last `ANSWERS_KEPT` requests by (bucketer, bucket id): a request
  asked again because its reply was lost gets the same answer, not a second assignment;
- a version of the fleet's state, bumped by every status, cache event and assignment: a
  policy answers "no room" only when no replica is open, and changes nothing then; with
  nothing changed since such an answer (replicas only close as time passes) the next one
  is "no room" too, answered without asking the policy again.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from prefixflow.services.router.assignments import Assignments
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import Policy, make_policy
from prefixflow.shared.process.config import RouterConfig
from prefixflow.shared.wire import messages as m

ANSWERS_KEPT = 4096
"""Route answers kept for requests asked again (a bucketer retries within seconds)."""
RETRY_CAPPED = 0.05
"""Seconds a bucketer waits before asking again when every live replica is at its cap
(the next status may have freed room; the router's freed-room notice cuts it short)."""
RETRY_NONE_LIVE = 1.0
"""Seconds a bucketer waits before asking again when no replica is live (none up yet)."""


@dataclass(slots=True)
class Decision:
    """One answer and what the service counts of it."""

    reply: m.RouteReply
    chosen: Assignments | None = None
    """The replicas chosen (None for a retry-after or a repeated request)."""
    outcome: str = "routed"
    """routed | split (one bucket over several replicas) | retry_after | repeated."""


class Decider:
    """The router's state (fleet, policy) and every decision made on it."""

    def __init__(self, cfg: RouterConfig) -> None:
        self.cfg = cfg
        self.fleet = Fleet(
            dead_after=cfg.dead_after,
            cap_tokens=cfg.replica_cap_tokens,
            history=cfg.history,
            cap_windows=cfg.cap_windows,
            start_windows=cfg.start_windows,
            lead_seconds=cfg.lead_seconds,
            hash_block_size=cfg.hash_block_size,
        )
        self.policy: Policy = self.make_policy(cfg.policy)
        self.routed = 0
        """Requests assigned (not counting retry-after answers)."""
        self.split = 0
        """Of them, buckets cut over several replicas."""
        self.answered: collections.OrderedDict[tuple[str, str], m.RouteReply] = collections.OrderedDict()
        """The last `ANSWERS_KEPT` assignments by (bucketer, bucket id)."""
        self.version = 0
        """Bumped by every change of the fleet's state (status, cache events, assignment)."""
        self.refused_at = -1
        """The version at the last decision that found no open replica."""
        self.retry_after = RETRY_CAPPED
        """The retry-after of that decision."""

    def make_policy(self, name: str) -> Policy:
        cfg = self.cfg
        return make_policy(name, slack_tokens=cfg.load_slack_tokens, split_factor=cfg.split_factor,
                           hot_factor=cfg.hot_factor)

    # --- what the replicas report -----------------------------------------------------

    def observe(self, now: float, status: m.EngineStatus) -> bool:
        """Apply a status; True when it freed room on a replica that can take work (the
        service then tells the bucketers)."""
        self.version += 1
        fleet = self.fleet
        r = fleet.replicas.get(status.replica)
        before = r.outstanding if r is not None else None
        fleet.observe(
            status.replica,
            now,
            ready=status.ready,
            outstanding=status.outstanding_tokens,
            done_tokens=status.done_tokens,
            kv_blocks=status.kv_blocks,
            engine_block_size=status.block_size,
            window=status.window,
            cache_epoch=status.cache_epoch,
            ts=status.ts,
            decode_cost=status.decode_cost,
            adapters=status.adapters,
            lora_slots=status.lora_slots,
            loras=status.loras,
        )
        r = fleet.replicas[status.replica]
        freed = before is None or r.outstanding < before
        return freed and fleet.is_open(r, now)  # O(1): every replica reports often

    def on_cache_events(self, events: m.CacheEvents) -> None:
        self.version += 1
        self.fleet.apply_cache_events(events.replica, events.epoch, events.seq, events.ops)

    # --- what the bucketers ask ---------------------------------------------------------

    def room(self, now: float) -> m.RouterRoom:
        """The fleet's free room (-1: unbounded); none for a policy without early release."""
        room = self.fleet.room(now) if self.policy.eager else 0.0
        tokens = -1 if room == float("inf") else int(room)
        return m.RouterRoom(tokens, len(self.fleet.live(now)), self.policy.eager)

    def decide(self, now: float, req: m.RouteRequest) -> Decision:
        """Route one request; a request asked again gets its first answer."""
        asked = (req.bucketer, req.bucket)
        if req.bucket and asked in self.answered:
            return Decision(self.answered[asked], outcome="repeated")
        decision = self.route(now, req)
        if req.bucket and decision.chosen is not None:
            self.answered[asked] = decision.reply
            if len(self.answered) > ANSWERS_KEPT:
                self.answered.popitem(last=False)
        return decision

    def route(self, now: float, req: m.RouteRequest) -> Decision:
        if self.version == self.refused_at:
            return Decision(m.RouteReply(retry_after=self.retry_after), outcome="retry_after")
        policy = self.policy
        if req.parts:
            chosen = policy.route_parts(self.fleet, now, [(p.prompts, p.tokens, p.key, p.output, p.lora) for p in req.parts],
                                        req.key, defer=True)
        else:
            chosen = policy.route(self.fleet, now, req.prompts, req.tokens, req.key, req.output, req.lora, defer=True)
        if chosen is None:
            self.refused_at = self.version
            self.retry_after = RETRY_NONE_LIVE if not self.fleet.live(now) else RETRY_CAPPED
            return Decision(m.RouteReply(retry_after=self.retry_after), outcome="retry_after")
        self.version += 1
        self.routed += 1
        split = sum(r is not None for r, _ in chosen) > 1 and not req.parts  # one bucket over several replicas
        self.split += split
        reply = m.RouteReply([m.Assignment(r.name if r else "", n, cost)
                              for (r, n), cost in zip(chosen, policy.last_costs, strict=True)])
        return Decision(reply, chosen, "split" if split else "routed")

    # --- the router's own moves ----------------------------------------------------------

    def place(self, now: float, prompts: int, tokens: int, key, output: int = -1,
              lora: str = "") -> tuple[Assignments, list[int]] | None:
        """Route a batch with the current policy, as a whole (failover re-places a dead
        replica's work): the assignments and what each was charged, or None."""
        chosen = self.policy.route(self.fleet, now, prompts, tokens, key, output, lora)
        if chosen is None:
            return None
        self.version += 1
        return chosen, self.policy.last_costs

    def touched(self) -> None:
        """The fleet changed outside the decider (failover: a reconnect's grace makes
        replicas live again): the next decision asks the policy."""
        self.version += 1

    def set_policy(self, name: str) -> None:
        """Switch policy (benchmarks compare policies on warm engines); the prefix history
        is forgotten so the new policy starts clean. An unknown name: ValueError."""
        self.policy = self.make_policy(name)
        self.version += 1
        self.fleet.forget_history()
        for r in self.fleet.replicas.values():
            r.routed_prompts = 0
