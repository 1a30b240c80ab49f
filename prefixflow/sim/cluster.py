"""The simulated cluster: a discrete-event clock driving the product's own decision code.

What runs for real (imported, called as the services call it):
- sharding: `prefixflow.shared.prefix.sharding.Sharder.pick` on each prompt's first-block key
  (`first_block_key`), as the ingestor's plan does;
- bucketing: the bucketer's decision core `prefixflow.services.bucketer.release.Release`
  (its fair-share lanes of `PrefixBuffer`s, eager and size releases, the cuts put back,
  the route requests) built from `BucketerConfig`'s defaults, called as the bucketer's
  intake and dispatch loops call it;
- routing: the router's decision core `prefixflow.services.router.decision.Decider` (fleet,
  policies, caps, hot prefixes, adapters), fed with the engines' `EngineStatus` messages
  and asked `decide` / `room` as the router service asks it; load in engine cost: each worker fits what its simulated engine's
  tokens cost (`prefixflow.services.engine_worker.cost_fit.CostFit`, fed with its steps), each
  assignment's charge is shared out over its prompts (`messages.cost_shares`) and
  reported done in that unit;
- admission by KV memory (`prefixflow.services.engine_worker.admission.KvAdmission`);
- feeding: the engine-worker's `Feeder` itself (`prefixflow.services.engine_worker.feeder`: its
  window, `window.Window`, with the first-result probe under `Options.window_probe`, and
  admission by KV memory), and prefix-group priorities
  (`prefixflow.services.engine_worker.grouping.EngineOrder`).

What is simulated: the engines (`prefixflow.sim.engine`), time (`prefixflow.sim.cost`), and NATS as a fixed
hop latency. The engine-worker's glue around its `Feeder` is `prefixflow/sim/worker.py`, the glue around the router's
and the bucketers' cores `prefixflow/sim/services.py`; this module holds the clock, the methods
and the results. `tests/unit/test_sim_decisions.py` checks that the router service answers a
recorded stream as the simulator did; `tests/unit/test_sim_no_rules.py` that `prefixflow/sim/`
copies no rule or constant of the services.

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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from prefixflow.shared.prefix import sharding
from prefixflow.shared.prefix.block_keys import first_block_key
from prefixflow.shared.process.config import (
    BucketerConfig,
    EngineWorkerConfig,
    IngestorConfig,
    RouterConfig,
)
from prefixflow.sim.cost import Profile
from prefixflow.sim.engine import Engine, EngineConfig
from prefixflow.sim.services import BucketerSim, RouterSim  # noqa: F401 (tests patch them here)
from prefixflow.sim.worker import FedWorker, Worker
from prefixflow.sim.workload import Workload

DIRECT_METHODS = ("naive", "continuous", "sorted")
PIPELINE_METHODS = ("daft", "prefix-aware", "round-robin", "least-loaded")
METHODS = DIRECT_METHODS + PIPELINE_METHODS
DEFAULT_METHODS = ("naive", "continuous", "sorted", "daft", "prefix-aware")
WORK_BATCH = 16
"""Prompts per work message of the continuous and sorted methods (as the bench)."""
INGEST_MESSAGE = 256
"""Prompts per ingest -> bucketer message."""
STAGGER_SEED = 7
"""The order in which replicas come up under `Options.stagger` (fixed: methods compared
in one run see the same fleet)."""


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
    """The worker's `window.Window` starts a burst of work with the first-result probe (a
    fresh engine runs one prompt alone first), as a real worker does; off, it sizes the
    window by `next_window` alone. Off by default (GPU fleets); the calibration and the
    plan of this machine turn it on because their real runs have it."""
    include_startup: bool = True
    stagger: tuple[float, float] | None = None
    """Replicas ready at staggered times, evenly spread over [lo, hi] seconds in a
    seeded order (a real fleet's GPUs load the model tens of seconds apart), instead of
    all at the profile's `startup_s`."""
    max_loras: int = 0
    """LoRA adapters an engine runs at once (vLLM's `--max-loras`; a workload with adapters
    needs it > 0; 0: no limit)."""
    record: bool = False
    """Keep a trace of every status and routing decision (`RouterSim.trace`; the
    decision-equivalence test)."""
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


def work_bound(starts: list[float], busy: float) -> float:
    """The earliest time a fleet could finish `busy` replica-seconds of engine work with
    replica i up from `starts[i]` and every replica busy from then on (the work spread
    perfectly): T with sum(max(0, T - s)) == busy. A run's wall time less its tail is
    never below it; a target below a method's bound needs less engine work (a higher
    hit rate, more prompts at once), not better placement."""
    if not starts:
        return 0.0
    up = sorted(starts)
    total = 0.0
    for k, s in enumerate(up, 1):
        # With the first k replicas up: T = (busy + their starts) / k, the answer unless
        # the next replica is up before then.
        total += s
        t = (busy + total) / k
        if k == len(up) or t <= up[k]:
            return t
    raise AssertionError("unreachable")


def replica_ready_times(profile: Profile, opts: Options, replicas: int) -> list[float]:
    """When each replica's engine is up: evenly over `Options.stagger` in a seeded order,
    else all at the profile's start-up (`include_startup`)."""
    if opts.stagger is None:
        return [profile.startup_s if opts.include_startup else 0.0] * replicas
    lo, hi = opts.stagger
    order = np.random.default_rng(STAGGER_SEED).permutation(replicas)
    return [lo + (hi - lo) * (order[i] + 0.5) / replicas for i in range(replicas)]


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
            engine = Engine(ecfg, profile.step_seconds)
            w = FedWorker(self, f"r{k}", engine, admission) if prefix_groups else Worker(self, f"r{k}", engine)
            w.index = k
            w.receive = w.accept
            self.workers.append(w)
        self.workers_by_name = {w.name: w for w in self.workers}
        self.t0 = 0.0
        self.starts: list[float] = [0.0]

    def at(self, t: float, fn: Callable, *args) -> None:
        self._seq += 1
        heapq.heappush(self.q, (t, self._seq, fn, args))

    # methods ------------------------------------------------------------------------------

    def ready_times(self) -> list[float]:
        """When each replica's engine is up (`replica_ready_times`)."""
        return replica_ready_times(self.profile, self.opts, len(self.workers))

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
            # The same engine work spread perfectly over the replicas from when each was up.
            "bound_seconds": round(work_bound(self.starts, busy) + self.profile.tail_s, 2),
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
