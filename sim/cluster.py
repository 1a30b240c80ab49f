"""The simulated cluster: a discrete-event clock driving the product's own decision code.

What runs for real (imported, called as the services call it):
- sharding: `shared.prefix.sharding.Sharder.pick` on each prompt's first-block key
  (`first_block_key`), as the ingestor's plan does;
- bucketing: `services.bucketer.buffer.PrefixBuffer` built from `BucketerConfig`'s
  defaults, driven like the bucketer's intake and dispatch loops (`pop` with the same
  `flush` / `budget` arguments; route requests built like `Bucketer.route_request`);
- routing: `services.router.fleet.Fleet` + `policies.make_policy`, fed with the engines'
  status fields and asked to `route` / `route_parts` like `Router.on_status` /
  `Router.decide`; load in engine cost: each worker fits what its simulated engine's
  tokens cost (`services.engine_worker.cost_fit.CostFit`, fed with its steps), each
  assignment's charge is shared out over its prompts (`messages.cost_shares`) and
  reported done in that unit;
- admission by KV memory (`services.engine_worker.admission.KvAdmission`);
- feeding: the engine-worker's window (`services.engine_worker.window`: `next_window`, or
  with `Options.window_probe` its adaptive `Window` with the first-result probe) and
  prefix-group priorities (`services.engine_worker.grouping.GroupPriorities`).

What is simulated: the engines (`sim.engine`), time (`sim.cost`), and NATS as a fixed
hop latency. `tests/unit/test_sim_decisions.py` checks that this driver and the
services' own objects make the same decisions on the same stream.

Methods (as `prefixflow bench methods` defines them):
- naive: batches of `naive_batch` prompts in dataset order; a replica takes the next
  batch when its whole current batch is done (vLLM's offline `LLM.generate`: all of a
  batch submitted at once, the offline token budget);
- continuous: dataset order, dealt round-robin in 16-prompt work batches, each worker
  keeping its window in flight;
- sorted: a global sort by token ids first (its cost counted), the sorted order cut
  into one contiguous range per replica, streamed;
- daft: the full pipeline with the reference routing (`daft`: no eager release, FCFS);
- prefix-aware (and round-robin, least-loaded): the full pipeline with that policy,
  eager release and prefix-group scheduling (the product's defaults).
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.bucketer.buffer import Bucket, Item, PrefixBuffer
from services.engine_worker.admission import KvAdmission, Ticket
from services.engine_worker.cost_fit import CostFit
from services.engine_worker.feeder import LORA_SCAN
from services.engine_worker.grouping import GroupPriorities
from services.engine_worker.window import initial_window, next_window
from services.router.fleet import Fleet
from services.router.policies import make_policy
from shared.prefix import sharding
from shared.wire.messages import cost_shares
from shared.prefix.block_keys import first_block_key
from shared.process.config import (
    BucketerConfig,
    EngineWorkerConfig,
    IngestorConfig,
    RouterConfig,
)
from sim.cost import Profile
from sim.engine import Engine, EngineConfig, Req
from sim.workload import Workload

DIRECT_METHODS = ("naive", "continuous", "sorted")
PIPELINE_METHODS = ("daft", "prefix-aware", "round-robin", "least-loaded")
METHODS = DIRECT_METHODS + PIPELINE_METHODS
DEFAULT_METHODS = ("naive", "continuous", "sorted", "daft", "prefix-aware")
WORK_BATCH = 16
"""Prompts per work message of the continuous and sorted methods (as the bench)."""
STATUS_MIN_GAP = 0.02
"""Seconds between two status messages at least (the engine-worker's)."""
EAGER_MIN_WAIT = 0.1
SEND_CONCURRENCY = 32
INTAKE_MESSAGES = 4
INGEST_MESSAGE = 256
"""Prompts per ingest -> bucketer message."""
STAGGER_SEED = 7
"""The order in which replicas come up under `Options.stagger` (fixed: methods compared
in one run see the same fleet)."""
DISPATCH_TICK = 0.2
INTAKE_POLL = 0.05


@dataclass
class Options:
    """Knobs of the simulated product (defaults: the services' own defaults)."""

    naive_batch: int = 512
    bucketer: BucketerConfig = field(default_factory=BucketerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    worker: EngineWorkerConfig = field(default_factory=lambda: EngineWorkerConfig(engine="vllm"))
    shard_epsilon: float = IngestorConfig().shard_epsilon
    nodes: int = 0
    """Bucketer nodes (0: replicas / profile.gpus_per_node)."""
    window_probe: bool = False
    """Drive the worker's adaptive `window.Window` (a fresh engine runs one prompt alone
    first) instead of `initial_window` / `next_window`. Off by default; the calibration
    benchmark turns it on because its real runs had it."""
    include_startup: bool = True
    stagger: tuple[float, float] | None = None
    """Replicas ready at staggered times, evenly spread over [lo, hi] seconds in a
    seeded order (a real fleet's GPUs load the model tens of seconds apart), instead of
    all at the profile's `startup_s`."""
    max_loras: int = 0
    """LoRA adapters an engine runs at once (vLLM's `--max-loras`; a workload with adapters
    needs it > 0; 0: no limit)."""
    record: bool = False
    """Keep a trace of every status and routing decision (decision-equivalence test)."""
    time_limit: float = 1e7


@dataclass
class Result:
    method: str
    replicas: int
    prompts: int
    wall_seconds: float
    hit_rate: float
    """Cached prompt tokens at first admission / prompt tokens (what prefixflow reports)."""
    logged_hit_rate: float
    """vLLM's prefix-cache counters as the reference read them: every lookup, retries and
    recomputation of preempted requests included (vLLM before 0.11)."""
    logged_hit_rate_no_preempted: float
    """The same without preempted requests' lookups (vLLM 0.11 and later, retries still counted)."""
    preemptions: int
    busy_fraction: float
    groups_split: int
    finish_times: np.ndarray
    replica_of: np.ndarray
    start_times: np.ndarray
    sim_seconds: float
    extra: dict = field(default_factory=dict)

    def row(self) -> dict:
        return {
            "method": self.method, "replicas": self.replicas, "prompts": self.prompts,
            "wall_seconds": round(self.wall_seconds, 2), "hit_rate": round(self.hit_rate, 4),
            "logged_hit_rate": round(self.logged_hit_rate, 4),
            "logged_hit_rate_no_preempted": round(self.logged_hit_rate_no_preempted, 4),
            "preemptions": self.preemptions, "busy_fraction": round(self.busy_fraction, 4),
            "groups_split": self.groups_split, "sim_seconds": round(self.sim_seconds, 2), **self.extra,
        }


@contextlib.contextmanager
def memoized_sharding():
    """`sharding.ranking` is a pure function of (key, nodes); the sharder calls it once
    per prompt (a blake2b per node). Memoized here for speed: same results."""
    original = sharding.ranking
    sharding.ranking = functools.lru_cache(maxsize=1 << 17)(original)
    try:
        yield
    finally:
        sharding.ranking = original


class Worker:
    """One engine-worker and its engine."""

    def __init__(self, sim: Sim, name: str, engine: Engine, prefix_groups: bool, admission: bool = False) -> None:
        self.sim = sim
        self.name = name
        self.engine = engine
        self.queue: deque[tuple[list[int], tuple[int, ...]]] = deque()
        """Work batches received: (prompt indexes, bucket key)."""
        self.inflight = 0
        self.inflight_tokens = 0
        self.done_tokens = 0
        self.completed = 0
        cfg = sim.opts.worker
        self.window_cfg = cfg.window
        self.window = initial_window(cfg.window)
        self.max_running = 0
        self.groups = GroupPriorities(block_size=cfg.hash_block_size, max_age=4 * cfg.window) if prefix_groups else None
        self.busy = False
        self.cost_fit = CostFit()
        """What its engine's prompt and output tokens cost, measured from its steps."""
        self.last_status = -1.0
        self.status_pending = False
        self.on_batch_done: Callable[[Worker], None] | None = None
        self.batch_left = 0
        self.probe = None
        """The worker's adaptive window with its probe (`window.Window`), when simulated."""
        if sim.opts.window_probe:
            from services.engine_worker.window import Window

            self.probe = Window(cfg.window, True, cfg.first_result_seconds)
            self.window = self.probe.limit
        self.admission: KvAdmission | None = None
        """The worker's admission by KV memory (`admission.KvAdmission`), when simulated."""
        self.tickets: dict[int, Ticket] = {}
        if admission:
            self.admission = KvAdmission(output_reserve=sim.opts.worker.kv_output_reserve)
            self.admission.resize(engine.cfg.num_blocks, engine.cfg.block_size)
        self.pending: deque[tuple[int, tuple[int, ...]]] = deque()
        """Prompts of held work batches not yet submitted, with their bucket key (with the
        probe or admission the worker feeds prompt by prompt)."""
        self.loras: Counter[str] = Counter()
        """Prompts held per LoRA adapter (its status reports them: `Feeder.loras`)."""
        self.engine_loras: Counter[str] = Counter()
        """Prompts in the engine per adapter (`Feeder.engine_loras`)."""

    # feeding --------------------------------------------------------------------------

    def pull(self, now: float) -> None:
        if self.probe is None and self.admission is None:
            while self.queue and self.inflight < self.window:
                batch = self.queue.popleft()[0]
                if self.sim.wl.lora:
                    self.engine_loras.update(a for a in map(self.sim.wl.lora_of, batch) if a)
                self.submit(batch, now)
            return
        # As the worker's feeder: held prompts go in one by one while the window (one
        # prompt during the probe) and the KV cache (admission) have room.
        while self.queue:
            batch, key = self.queue.popleft()
            self.pending.extend((i, key) for i in batch)
        take: list[int] = []
        wl, admission, probe = self.sim.wl, self.admission, self.probe
        if admission is not None:
            admission.clock = self.engine.stats.steps
        slots, j = self.sim.opts.max_loras if self.sim.adapters else 0, 0
        while j < len(self.pending) and self.inflight + len(take) < (probe.limit if probe is not None else self.window):
            i, key = self.pending[j]
            lora = wl.lora_of(i)
            if slots and lora and lora not in self.engine_loras and len(self.engine_loras) >= slots:
                j += 1  # as `Feeder.feed`: no slot for its adapter, the ones behind it go
                if j >= LORA_SCAN:
                    break
                continue
            if admission is not None:
                ticket = admission.ticket(wl.tokens[i], int(wl.output_len[i]), wl.lora_of(i))
                if not admission.admits(ticket):
                    break
                admission.admit(ticket)
                self.tickets[i] = ticket
            if self.probe is not None and self.inflight + len(take) == 0:
                self.probe.work_arrives(now, 0, int(wl.output_len[i]), self.engine.stats.decode_tokens)
            take.append(i)
            del self.pending[j]
            if lora:
                self.engine_loras[lora] += 1
        if take:
            self.submit(take, now)

    def submit(self, batch: list[int], now: float) -> None:
        sim = self.sim
        wl = sim.wl
        hashes = sim.hashes
        if sim.first_submit < 0:
            sim.first_submit = now
        for i in batch:
            sim.start_time[i] = now
            tokens = wl.tokens[i]
            prio = self.groups.priority(tokens) if self.groups is not None else 0
            out = int(wl.output_len[i])
            self.engine.add(Req(i, hashes[i], len(tokens) // 4, out, prio, now, lora=wl.lora_of(i)))
            self.inflight += 1
            self.inflight_tokens += int(sim.cost[i]) or len(tokens) // 4 + out
        if not self.busy and not self.engine.idle():
            self.busy = True
            sim.at(now, self.step)

    def step(self, now: float) -> None:
        dur = self.engine.schedule()
        self.sim.at(now + dur, self.step_done, dur)

    def step_done(self, now: float, dur: float) -> None:
        st = self.engine.stats
        before = st.prefill_tokens, st.decode_tokens
        finished = self.engine.complete(dur)
        self.cost_fit.add(dur, st.prefill_tokens - before[0], st.decode_tokens - before[1])
        if finished:
            sim = self.sim
            wl = sim.wl
            for req in finished:
                i = req.rid
                work = int(sim.cost[i]) or req.prompt_len + int(wl.output_len[i])  # `Prompt.load`
                self.inflight -= 1
                self.inflight_tokens -= work
                self.done_tokens += work
                self.completed += 1
                if req.lora:
                    for held in (self.loras, self.engine_loras):
                        held[req.lora] -= 1
                        if not held[req.lora]:
                            del held[req.lora]
                if self.admission is not None:
                    self.admission.release(self.tickets.pop(i), int(wl.output_len[i]))
                sim.finish_time[i] = now
                sim.replica_of[i] = self.index
                sim.cached[i] = req.cached
                sim.done += 1
                if self.probe is not None:
                    self.probe.completed(now)
            if self.on_batch_done is not None:
                self.batch_left -= len(finished)
                if self.batch_left <= 0:
                    self.on_batch_done(now, self)
            self.pull(now)
            if sim.router is not None:
                self.status_due(now)
        if self.engine.idle():
            self.busy = False
        else:
            self.step(now)

    # status ---------------------------------------------------------------------------

    def status_due(self, now: float) -> None:
        if self.status_pending:
            return
        t = max(now, self.last_status + STATUS_MIN_GAP)
        self.status_pending = True
        self.sim.at(t, self.publish_status)

    def publish_status(self, now: float) -> None:
        self.status_pending = False
        self.last_status = now
        eng = self.engine
        if self.probe is not None:
            self.probe.observe(now, eng.cfg.num_blocks, len(eng.running), eng.stats.decode_tokens, self.inflight)
            self.window = self.probe.limit
        else:
            self.window, self.max_running = next_window(
                self.window, self.window_cfg, eng.cfg.num_blocks, len(eng.running), self.max_running
            )
        status = {"ready": True, "outstanding": self.inflight_tokens, "done_tokens": self.done_tokens,
                  "kv_blocks": eng.cfg.num_blocks, "window": self.window, "engine_block_size": eng.cfg.block_size,
                  "decode_cost": self.cost_fit.ratio, "adapters": self.sim.adapters,
                  "lora_slots": self.sim.opts.max_loras if self.sim.adapters else 0, "loras": dict(self.loras)}
        self.sim.at(now + self.sim.profile.hop_s, self.sim.router.on_status, self.name, status)
        self.pull(now)

    def tick(self, now: float) -> None:
        """The status loop's periodic report (every status_interval when nothing is due)."""
        if self.sim.done >= self.sim.n:
            return
        if now - self.last_status >= self.sim.opts.worker.status_interval - 1e-9:
            self.publish_status(now)
        self.sim.at(now + self.sim.opts.worker.status_interval, self.tick)


class RouterSim:
    """The router service's decisions: `Router.on_status` and `Router.decide`."""

    def __init__(self, sim: Sim, policy: str) -> None:
        cfg = sim.opts.router
        self.sim = sim
        self.fleet = Fleet(dead_after=cfg.dead_after, cap_tokens=cfg.replica_cap_tokens, history=cfg.history,
                           cap_windows=cfg.cap_windows, lead_seconds=cfg.lead_seconds,
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
            chosen = self.policy.route_parts(self.fleet, now, parts, key)
        else:
            chosen = self.policy.route(self.fleet, now, prompts, tokens, key, output, lora)
        out = None if chosen is None else [(r.name, n, c) for (r, n), c in zip(chosen, self.policy.last_costs, strict=True)]
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
            self.splits += len(out) > 1
        return out


class BucketerSim:
    """One bucketer's intake and dispatch loops (`services/bucketer/service.py`)."""

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
        for name, n, cost in got:
            items = bucket.items[start : start + n]
            start += n
            charge(self.sim.cost, items, cost)
            w = self.sim.workers_by_name[name]
            for k in range(0, len(items), max_batch):
                self.sim.at(now + 2 * hop, w.receive, [it.payload for it in items[k : k + max_batch]], tuple(bucket.key))
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


class Sim:
    def __init__(self, wl: Workload, profile: Profile, replicas: int, method: str, opts: Options | None = None) -> None:
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
        self.wl = wl
        self.n = len(wl)
        self.profile = profile
        self.method = method
        self.opts = opts or Options()
        self.q: list = []
        self._seq = 0
        self.now = 0.0
        self.done = 0
        self.finish_time = np.full(self.n, np.nan)
        self.start_time = np.full(self.n, np.nan)
        """When each prompt entered its engine (the output's `started_at`)."""
        self.replica_of = np.full(self.n, -1, dtype=np.int32)
        self.cached = np.zeros(self.n, dtype=np.int64)
        self.cost = np.zeros(self.n, dtype=np.int64)
        """What the router charged for each prompt (`Prompt.cost`; 0: not routed by it)."""
        self.hashes = wl.engine_hashes(profile.block_size)
        self.router: RouterSim | None = None
        self.bucketers: list[BucketerSim] = []
        self.ingest_done = False
        self.first_submit = -1.0
        """When the first prompt entered an engine."""
        offline = method == "naive"
        pipeline = method in PIPELINE_METHODS
        prefix_groups = pipeline and method != "daft" and self.opts.worker.scheduling == "prefix-groups"
        ecfg = EngineConfig(
            num_blocks=profile.kv_blocks, block_size=profile.block_size, max_num_seqs=profile.max_num_seqs,
            max_batched_tokens=profile.max_batched_tokens_offline if offline else profile.max_batched_tokens,
            policy="priority" if prefix_groups else "fcfs", max_loras=self.opts.max_loras,
        )
        self.adapters = sorted(set(wl.lora) - {""}) if wl.lora else []
        """The LoRA adapters of the workload: every replica serves them all."""
        self.workers = []
        admission = prefix_groups and self.opts.worker.kv_admission  # the product's worker, not the reference's
        for k in range(replicas):
            w = Worker(self, f"r{k}", Engine(ecfg, profile.step_seconds), prefix_groups, admission)
            w.index = k
            w.receive = functools.partial(self._receive, w)
            self.workers.append(w)
        self.workers_by_name = {w.name: w for w in self.workers}
        self.t0 = 0.0
        self.starts: list[float] = [0.0]

    def _receive(self, w: Worker, now: float, batch: list[int], key: tuple[int, ...] = ()) -> None:
        if self.wl.lora:
            w.loras.update(a for a in map(self.wl.lora_of, batch) if a)
        w.queue.append((batch, key))
        w.pull(now)

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self.q, (t, self._seq, fn, args))

    # methods ------------------------------------------------------------------------------

    def ready_times(self) -> list[float]:
        """When each replica's engine is up (`Options.stagger`, else all at start-up)."""
        R = len(self.workers)
        if self.opts.stagger is None:
            return [self.profile.startup_s if self.opts.include_startup else 0.0] * R
        lo, hi = self.opts.stagger
        order = np.random.default_rng(STAGGER_SEED).permutation(R)
        return [lo + (hi - lo) * (order[i] + 0.5) / R for i in range(R)]

    def start(self) -> None:
        p, n, method = self.profile, self.n, self.method
        ready = self.ready_times()
        workers = self.workers
        R = len(workers)
        if method == "naive":
            prep = p.tokenize_s_per_1k * n / 1000
            batches = deque(list(range(i, min(i + self.opts.naive_batch, n))) for i in range(0, n, self.opts.naive_batch))

            def next_batch(now: float, w: Worker) -> None:
                if batches:
                    b = batches.popleft()
                    w.batch_left = len(b)
                    w.window = len(b)
                    w.submit(b, now)

            for w, t in zip(workers, ready):
                w.on_batch_done = next_batch
                w.window_cfg = 1 << 30
                self.at(t + prep, next_batch, w)
        elif method in ("continuous", "sorted"):
            prep = p.tokenize_s_per_1k * n / 1000
            order = list(range(n))
            if method == "sorted":
                ts = time.perf_counter()
                order.sort(key=self.wl.tokens.__getitem__)
                self.sort_wall = time.perf_counter() - ts
                prep += p.sort_s_per_1k * n / 1000
                lanes = [order[k * n // R : (k + 1) * n // R] for k in range(R)]
            else:
                lanes = [[] for _ in range(R)]
                for i in range(0, n, WORK_BATCH):
                    lanes[(i // WORK_BATCH) % R].extend(order[i : i + WORK_BATCH])
            for w, lane, t in zip(workers, lanes, ready):
                for i in range(0, len(lane), WORK_BATCH):
                    w.queue.append((lane[i : i + WORK_BATCH], ()))
                self.at(t + prep, lambda now, w=w: self._kick(w, now))
        else:
            prep = 0.0
            self.router = RouterSim(self, method)
            nodes = self.opts.nodes or max(1, math.ceil(R / p.gpus_per_node))
            self.node_names = tuple(f"node{k}" for k in range(nodes))
            self.bucketers = [BucketerSim(self, name) for name in self.node_names]
            self.by_node = dict(zip(self.node_names, self.bucketers))
            self.sharder = sharding.Sharder(epsilon=self.opts.shard_epsilon)
            self.cursor = 0
            for w, t in zip(workers, ready):
                self.at(t, w.publish_status)
                self.at(t + self.opts.worker.status_interval, w.tick)
            self.at(min(ready) + p.hop_s * 2, self.ingest)
        self.starts = [t + prep for t in ready]
        """When each replica could first take work (the busy fraction's span)."""
        self.t0 = min(self.starts)

    def _kick(self, w: Worker, now: float) -> None:
        w.pull(now)

    def ingest(self, now: float) -> None:
        """The ingestors: the next message's worth of prompts, sharded to bucketers."""
        p = self.profile
        chunk = INGEST_MESSAGE * max(1, len(self.bucketers) // 4)
        begin = self.cursor
        end = min(begin + chunk, self.n)
        per_node: dict[str, list[int]] = {}
        tokens = self.wl.tokens
        nodes = self.node_names
        hb = self.opts.bucketer.hash_block_size
        pick = self.sharder.pick
        for i in range(self.cursor, end):
            node = pick(first_block_key(tokens[i], hb), nodes)
            per_node.setdefault(node, []).append(i)
        self.cursor = end
        for node, idx in per_node.items():
            for k in range(0, len(idx), INGEST_MESSAGE):
                self.at(now + p.hop_s, self.by_node[node].deliver, idx[k : k + INGEST_MESSAGE])
        if self.cursor < self.n:
            self.at(now + (end - begin) / p.ingest_rate, self.ingest)
        else:
            self.at(now + p.hop_s, self._ingest_finished)

    def _ingest_finished(self, now: float) -> None:
        self.ingest_done = True
        for b in self.bucketers:
            b.wake(now)

    # run ----------------------------------------------------------------------------------

    def run(self) -> Result:
        wall0 = time.perf_counter()
        ctx = memoized_sharding() if self.method in PIPELINE_METHODS else contextlib.nullcontext()
        with ctx:
            self.start()
            q = self.q
            pop = heapq.heappop
            limit = self.opts.time_limit
            while q and self.done < self.n:
                t, _, fn, args = pop(q)
                if t > limit:
                    break
                self.now = t
                fn(t, *args)
        if self.done < self.n:
            raise RuntimeError(f"{self.method}: {self.n - self.done} prompts never finished (sim time {self.now:.1f} s)")
        return self.result(time.perf_counter() - wall0)

    def result(self, sim_seconds: float) -> Result:
        wall = float(np.nanmax(self.finish_time)) + self.profile.tail_s if self.n else 0.0
        stats = [w.engine.stats for w in self.workers]
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_tokens for s in stats)
        lq = sum(s.lookup_queries for s in stats)
        lh = sum(s.lookup_hits for s in stats)
        pq = sum(s.preempted_queries for s in stats)
        ph = sum(s.preempted_hits for s in stats)
        busy = sum(s.busy_seconds for s in stats)
        split = 0
        if self.wl.group is not None:
            pairs = np.unique(np.stack([self.wl.group, self.replica_of]), axis=1)
            split = int(np.sum(np.bincount(pairs[0]) > 1))
        span = max(sum(wall - t for t in self.starts), 1e-9) / len(self.workers)
        extra = {
            "max_running": max(s.max_running for s in stats),
            "start_seconds": round(self.t0, 2),
            "first_start_seconds": round(self.first_submit, 4),
        }
        if self.router is not None:
            extra["route_decisions"] = self.router.decisions
            extra["split_decisions"] = self.router.splits
        return Result(
            method=self.method, replicas=len(self.workers), prompts=self.n, wall_seconds=wall,
            hit_rate=cached / prompt if prompt else 0.0,
            logged_hit_rate=(lh + ph) / (lq + pq) if lq + pq else 0.0,
            logged_hit_rate_no_preempted=lh / lq if lq else 0.0,
            preemptions=sum(s.preemptions for s in stats),
            busy_fraction=busy / (span * len(self.workers)),
            groups_split=split, finish_times=self.finish_time, replica_of=self.replica_of, start_times=self.start_time,
            sim_seconds=sim_seconds, extra=extra,
        )


def simulate(wl: Workload, profile: Profile, replicas: int, method: str, opts: Options | None = None) -> Result:
    return Sim(wl, profile, replicas, method, opts).run()
