"""Simulated engine-workers in front of simulated engines (`prefixflow.sim.engine`), and
their status messages to the router. Driven by the cluster's clock (`prefixflow.sim.cluster`).

- `FedWorker`: the product's engine-worker. Its prompts go into the engine through the
  product's own `Feeder` (`prefixflow.services.engine_worker.feeder`: the window with its
  probe, admission by KV memory, LoRA slots, isolation) on the simulation's clock: no copy
  of its loop here, only the glue that turns a work batch into held prompts and a
  submitted prompt into an engine request.
- `Worker`: the reference methods' engines (naive, continuous, sorted, the reference's
  bucketing): whole work batches while the engine window (`next_window`) has room.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from prefixflow.services.engine_worker.admission import KvAdmission
from prefixflow.services.engine_worker.cost_fit import CostFit
from prefixflow.services.engine_worker.feeder import Feeder, Held
from prefixflow.services.engine_worker.grouping import EngineOrder
from prefixflow.services.engine_worker.status import STATUS_MIN_GAP
from prefixflow.services.engine_worker.window import Window, initial_window, next_window
from prefixflow.shared.wire.messages import EngineStatus, Prompt
from prefixflow.sim.engine import Engine, Req

# `Sim` in annotations: `prefixflow.sim.cluster.Sim`, the clock that drives this (not imported: it imports this module).

SIM_JOB = "sim"
"""The job of every simulated prompt (the feeder counts prompts held per job)."""


class Worker:
    """One engine and the worker in front of it (the reference methods' feeding)."""

    def __init__(self, sim: Sim, name: str, engine: Engine, prefix_groups: bool = False) -> None:
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
        self.order = EngineOrder(block_size=cfg.hash_block_size, max_age=4 * cfg.window) if prefix_groups else None
        self.tickets: dict[int, int] = {}
        """Request -> its `EngineOrder` ticket, while in the engine."""
        self.busy = False
        self.cost_fit = CostFit()
        """What its engine's prompt and output tokens cost, measured from its steps."""
        self.last_status = -1.0
        self.status_pending = False
        self.on_batch_done: Callable[[Worker], None] | None = None
        self.batch_left = 0
        self.loras: Counter[str] = Counter()
        """Prompts held per LoRA adapter (its status reports them: `Feeder.loras`)."""
        self.engine_loras: Counter[str] = Counter()
        """Prompts in the engine per adapter (`Feeder.engine_loras`)."""

    # feeding --------------------------------------------------------------------------

    def accept(self, now: float, batch: list[int], key: tuple[int, ...] = ()) -> None:
        """A work batch arrives."""
        if self.sim.wl.lora:
            self.loras.update(a for a in map(self.sim.wl.lora_of, batch) if a)
        self.queue.append((batch, key))
        self.pull(now)

    def pull(self, now: float) -> None:
        while self.queue and self.inflight < self.window:
            batch = self.queue.popleft()[0]
            if self.sim.wl.lora:
                self.engine_loras.update(a for a in map(self.sim.wl.lora_of, batch) if a)
            self.submit(batch, now)

    def submit(self, batch: list[int], now: float) -> None:
        sim = self.sim
        wl = sim.wl
        hashes = sim.hashes
        if sim.first_submit < 0:
            sim.first_submit = now
        for i in batch:
            sim.start_time[i] = now
            tokens = wl.tokens[i]
            prio = 0
            if self.order is not None:  # one job: the simulator's workloads are one job each
                prio, self.tickets[i] = self.order.admit(tokens)
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

    def finish(self, req: Req, now: float) -> None:
        """One request finished in the engine: the worker's books."""
        if self.order is not None:
            self.order.done(self.tickets.pop(req.rid))
        self.inflight -= 1
        self.inflight_tokens -= int(self.sim.cost[req.rid]) or req.prompt_len + int(self.sim.wl.output_len[req.rid])
        if req.lora:
            for held in (self.loras, self.engine_loras):
                held[req.lora] -= 1
                if not held[req.lora]:
                    del held[req.lora]

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
                self.done_tokens += int(sim.cost[i]) or req.prompt_len + int(wl.output_len[i])  # `Prompt.load`
                self.completed += 1
                self.finish(req, now)
                sim.finish_time[i] = now
                sim.replica_of[i] = self.index
                sim.cached[i] = req.cached
                sim.done += 1
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

    def look(self, now: float) -> None:
        """A look at the engine before a status: size the window."""
        eng = self.engine
        self.window, self.max_running = next_window(
            self.window, self.window_cfg, eng.cfg.num_blocks, len(eng.running), self.max_running
        )

    def status(self, now: float) -> EngineStatus:
        eng = self.engine
        return EngineStatus(
            replica=self.name, ts=now, ready=True, outstanding_tokens=self.inflight_tokens, done_tokens=self.done_tokens,
            kv_blocks=eng.cfg.num_blocks, block_size=eng.cfg.block_size, window=self.window,
            decode_cost=self.cost_fit.ratio, adapters=self.sim.adapters,
            lora_slots=self.sim.opts.max_loras if self.sim.adapters else 0, loras=dict(self.loras))

    def publish_status(self, now: float) -> None:
        self.status_pending = False
        self.last_status = now
        self.look(now)
        self.sim.at(now + self.sim.profile.hop_s, self.sim.router.status_arrives, self.status(now))
        self.pull(now)

    def tick(self, now: float) -> None:
        """The status loop's periodic report (every status_interval when nothing is due)."""
        if self.sim.done >= self.sim.n:
            return
        if now - self.last_status >= self.sim.opts.worker.status_interval - 1e-9:
            self.publish_status(now)
        self.sim.at(now + self.sim.opts.worker.status_interval, self.tick)


class FedWorker(Worker):
    """The product's engine-worker: held prompts go into the engine through its `Feeder`
    (the window, with its probe when `Options.window_probe`; admission by KV memory when
    `admission`; LoRA slots), on the simulation's clock."""

    def __init__(self, sim: Sim, name: str, engine: Engine, admission: bool = False) -> None:
        super().__init__(sim, name, engine, prefix_groups=True)
        cfg = sim.opts.worker
        self.now = 0.0
        kv = None
        if admission:
            kv = KvAdmission(output_reserve=cfg.kv_output_reserve)
            kv.resize(engine.cfg.num_blocks, engine.cfg.block_size)
        window = Window(cfg.window, True, cfg.first_result_seconds, probing=sim.opts.window_probe)
        self.starting: list[int] = []
        """Prompts the feeder submitted in this pass (they enter the engine together)."""
        self.held: dict[int, Held] = {}
        """Prompt index -> its held prompt, from its arrival to its end."""
        self.feeder = Feeder(
            window, lambda held: self.starting.append(held.index), lambda: self.engine.stats.decode_tokens,
            admission=kv, steps=lambda: self.engine.stats.steps,
            lora_slots=sim.opts.max_loras if sim.adapters else 0,
            clock=lambda: self.now, budget=lambda held: held.prompt.max_tokens,
        )
        self.window = window.limit

    def held_prompt(self, i: int) -> Held:
        sim, wl = self.sim, self.sim.wl
        prompt = Prompt(SIM_JOB, i, wl.tokens[i], max_tokens=int(wl.output_len[i]), cost=int(sim.cost[i]),
                        lora=wl.lora_of(i) or "")
        return Held(None, prompt, None, "", None, i)  # type: ignore[arg-type] - no lease, no job lookup here

    def accept(self, now: float, batch: list[int], key: tuple[int, ...] = ()) -> None:
        self.now = now
        fresh = [self.held_prompt(i) for i in batch]
        self.held.update((h.index, h) for h in fresh)
        self.feeder.hold(fresh)
        self.start(now)

    def pull(self, now: float) -> None:
        self.now = now
        self.feeder.feed()
        self.start(now)

    def start(self, now: float) -> None:
        if self.starting:
            batch, self.starting = self.starting, []
            self.submit(batch, now)

    def finish(self, req: Req, now: float) -> None:
        self.now = now
        self.order.done(self.tickets.pop(req.rid))
        self.inflight -= 1
        self.feeder.finished(self.held.pop(req.rid).prompt, True, int(self.sim.wl.output_len[req.rid]))

    def look(self, now: float) -> None:
        eng = self.engine
        self.feeder.window.observe(now, eng.cfg.num_blocks, len(eng.running), eng.stats.decode_tokens, self.feeder.inflight)
        self.window = self.feeder.window.limit

    def status(self, now: float) -> EngineStatus:
        st = super().status(now)
        st.outstanding_tokens, st.loras, st.inflight = self.feeder.held_tokens, dict(self.feeder.loras), self.feeder.inflight
        return st
