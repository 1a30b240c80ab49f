"""The bucketer's release rule: pure logic, no NATS, no asyncio (as vLLM's `Scheduler` is
driven by `EngineCore`). Two drivers call the same `Release`:
- the bucketer service (`prefixflow/services/bucketer/service.py`): its intake loop asks
  `fetch` how many messages to pull and `insert`s their prompts; its dispatcher asks
  `wants_room`, the router's room (`budget`), then `release`, routes each bucket
  (`route_request`) and places it (`place`);
- the simulator (`prefixflow/sim/services.py`), with its discrete-event clock and the
  router's `Decider` called directly.

One dispatch round reads:
1. `wants_room(now, inflow)`: under eager release, is any lane flowing, or eligible
   (`eligible`: its oldest prompt waited `--eager-delay`, or `EAGER_MIN_WAIT` once its
   job's input has landed here or its lane is full), or are the reference rules on?
   Then the router is asked for its room;
2. `budget(reply)`: the room as a release budget; None (the reference rules: the
   router's policy releases nothing early, or it did not answer);
3. `release(now, inflow, budget)`: the lanes release (`lanes.Lanes.pop`): without a
   budget, a lane whose job has nothing left upstream and no input for `--idle-flush`
   seconds is flushed (its end of input), and a buffer at its bound releases its largest
   buckets (the reference's size rule);
4. `place(job, bucket, assignments)`: the router's answer applied: prompts to each
   replica with their share of the charge, the cut (prompts no replica had room for)
   back into the job's lane, its virtual time refunded.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from prefixflow.services.bucketer.buffer import Bucket, Item, PrefixBuffer
from prefixflow.services.bucketer.lanes import Lane, Lanes
from prefixflow.shared.process.config import BucketerConfig
from prefixflow.shared.wire import messages as m

SEND_CONCURRENCY = 32
"""Buckets routed and published at once (each waits for its route reply and publish ack;
one at a time would cap the rate at 1/RTT)."""
EAGER_MIN_WAIT = 0.1
"""Seconds the oldest prompt waits before eager release may ask whether input landed."""
FETCH_MESSAGES = 4
"""Prompt batches pulled from one job at once (each up to 512 prompts): how far past its
share a lane can get before its intake stops."""
DISPATCH_WAIT = 0.2
"""Seconds the dispatcher waits for a wake-up (input taken, room freed, a cut put back)
before it looks at the lanes again."""
INTAKE_WAIT = 0.05
"""Seconds the intake waits after a round that pulled nothing (nothing waiting, or every
lane with input waiting full: backpressure until the dispatcher releases)."""
RETRY_WAIT = 0.5
"""Seconds before asking the router again when its retry-after answer names none."""


@dataclass(frozen=True, slots=True)
class Inflow:
    """What the driver knows of each job's input still on its way to the lanes."""

    waiting: Mapping[str, int] = field(default_factory=dict)
    """Jobs with messages on this node's subjects not yet pulled, and how many."""
    upstream: Collection[str] = ()
    """Jobs with prompts not yet ingested (on their ingest subject)."""

    def settled(self, job: str) -> bool:
        """Nothing of `job` is still on its way here: its input has landed."""
        return job not in self.upstream and not self.waiting.get(job)


@dataclass(slots=True)
class Placed:
    """Prompts of a bucket for one replica, with what each was charged (`Prompt.cost`;
    empty: not told)."""

    replica: str
    items: list[Item]
    shares: list[int]


class Release:
    """One bucketer's lanes and the rule that releases them."""

    def __init__(self, cfg: BucketerConfig) -> None:
        self.cfg = cfg

        def make_buffer() -> PrefixBuffer:
            return PrefixBuffer(max_prompts=cfg.buffer_prompts, max_bytes=cfg.buffer_bytes, min_bucket=cfg.min_bucket,
                                max_bucket=cfg.max_bucket, threshold=cfg.threshold, max_wait=cfg.max_wait,
                                block_size=cfg.hash_block_size, pool_size=cfg.pool_size)

        self.lanes = Lanes(make_buffer, max_prompts=cfg.buffer_prompts, max_bytes=cfg.buffer_bytes,
                           min_share=cfg.pool_size, slack=FETCH_MESSAGES * m.MAX_PROMPTS_PER_MESSAGE,
                           headroom=cfg.buffer_prompts // 4, burst=cfg.new_job_burst)
        """One prefix buffer per job, released by weight (fair sharing)."""
        self.reference_rules = False
        """The router's policy releases nothing early (the reference's): its last room reply said so."""

    def __len__(self) -> int:
        return len(self.lanes)

    def __bool__(self) -> bool:
        return bool(self.lanes)

    # --- intake -----------------------------------------------------------------------

    def fetch(self, job: str, weight: float, inflow: Inflow) -> int:
        """Messages to pull for `job` now (0: its lane is full): whole messages while the
        lane has room, so it overshoots its share by less than one message per round."""
        room = self.lanes.room(job, weight, inflow.waiting)
        if room <= 0:
            return 0
        return max(1, min(FETCH_MESSAGES, inflow.waiting.get(job, 0), room // m.MAX_PROMPTS_PER_MESSAGE))

    def insert(self, job: str, weight: float, item: Item) -> None:
        self.lanes.insert(job, weight, item)

    # --- release ----------------------------------------------------------------------

    def eligible(self, lane: Lane, now: float, inflow: Inflow) -> bool:
        """Eager release once a job's input has landed (groups then go out whole, not as
        fragments of a burst still being ingested) or its lane is full (no more of its
        input can come in until some leaves: waiting only idles the replicas), or after
        --eager-delay anyway."""
        oldest = lane.buffer.oldest()
        waited = -1.0 if oldest is None else now - oldest
        return waited >= self.cfg.eager_delay or (waited >= EAGER_MIN_WAIT and (
            inflow.settled(lane.job) or self.lanes.room(lane.job, lane.weight, inflow.waiting) <= 0))

    def wants_room(self, now: float, inflow: Inflow) -> bool:
        """Whether to ask the router for its room before releasing (else `no_budget`)."""
        if not self.cfg.eager:
            return False
        return self.reference_rules or any(lane.flowing or self.eligible(lane, now, inflow)
                                           for lane in self.lanes.lanes.values() if len(lane.buffer))

    def no_budget(self) -> float | None:
        """The budget when the router is not asked: nothing early under eager release;
        the reference rules (None) with it off."""
        return 0.0 if self.cfg.eager else None

    def budget(self, reply: m.RouterRoom | None) -> float | None:
        """The router's room (None: it did not answer) as a release budget in work
        tokens; None when its policy releases nothing early (the reference's) or it is
        away: the lanes then follow the reference rules."""
        if reply is None:
            return None
        self.reference_rules = not reply.eager
        if self.reference_rules:
            return None
        return float("inf") if reply.tokens < 0 else float(reply.tokens)

    def release(self, now: float, inflow: Inflow, budget: float | None) -> list[tuple[str, Bucket]]:
        """The buckets to route now, as (job, bucket). Without the router's room (the
        reference rules): a job with nothing left upstream and no input for a while has
        reached its end of input here, so its lane is flushed. (A slow ingest batch can
        leave this node without input for longer than idle_flush; flushing then would cut
        every group of the burst in two.) With it, such a lane is eligible and goes out as
        room frees up, in its fair turn: a flush would put its whole backlog ahead of
        other jobs."""
        flush = [] if budget is not None else [
            job for job, lane in self.lanes.lanes.items()
            if len(lane.buffer) and now - lane.last_input >= self.cfg.idle_flush and inflow.settled(job)]
        return self.lanes.pop(now, budget=budget, flush=flush, eligible=lambda lane: self.eligible(lane, now, inflow))

    def drain(self, now: float) -> list[tuple[str, Bucket]]:
        """Everything, lane by lane (shutdown)."""
        return self.lanes.pop(now, budget=None, flush=list(self.lanes.lanes))

    # --- routing ----------------------------------------------------------------------

    @staticmethod
    def route_request(node: str, bucket: Bucket, bucket_id: str = "") -> m.RouteRequest:
        """What the router is asked for `bucket`: its prompts and work tokens, its key, its
        parts (a pooled batch's small buckets, a keyed bucket's groups) and its output
        budget (the router charges output tokens at what they cost)."""
        parts = []
        start = 0
        for n, key in bucket.parts:
            items = bucket.items[start : start + n]
            parts.append(m.RoutePart(n, PrefixBuffer.work(items), key, sum(it.output for it in items), items[0].lora))
            start += n
        output = sum(it.output for it in bucket.items)
        lora = "" if bucket.pooled or not bucket.items else bucket.items[0].lora  # a pooled batch: per part
        return m.RouteRequest(node, len(bucket.items), PrefixBuffer.work(bucket.items), bucket.key, parts, bucket_id,
                              output, lora)

    def place(self, job: str, bucket: Bucket, assignments: Sequence[m.Assignment]) -> list[Placed]:
        """The router's assignments applied to `bucket` (they cover its prompts in order):
        each replica's prompts with their shares of its charge (`messages.cost_shares` by
        work tokens: the replica reports them done in that unit); prompts assigned to no
        replica (no room for them now: bounded lead) go back into the job's lane."""
        out = []
        start = 0
        for a in assignments:
            items = bucket.items[start : start + a.prompts]
            start += a.prompts
            if not a.replica:
                self.lanes.put_back(job, items)
                continue
            shares = m.cost_shares(a.cost, [PrefixBuffer.work([it]) for it in items]) if a.cost > 0 else []
            out.append(Placed(a.replica, items, shares))
        return out
