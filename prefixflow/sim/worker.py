"""One simulated engine-worker: the product's feeding code (window, admission by KV memory,
LoRA slots, prefix-group priorities) in front of a simulated engine (`prefixflow.sim.engine`), and
its status messages to the router. Driven by the cluster's clock (`prefixflow.sim.cluster`)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable

from prefixflow.services.engine_worker.admission import KvAdmission, Ticket
from prefixflow.services.engine_worker.cost_fit import CostFit
from prefixflow.services.engine_worker.feeder import LORA_SCAN
from prefixflow.services.engine_worker.grouping import GroupPriorities
from prefixflow.services.engine_worker.status import STATUS_MIN_GAP
from prefixflow.services.engine_worker.window import initial_window, next_window
from prefixflow.shared.wire.messages import EngineStatus
from prefixflow.sim.engine import Engine, Req

# `Sim` in annotations: `prefixflow.sim.cluster.Sim`, the clock that drives this (not imported: it imports this module).


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
            from prefixflow.services.engine_worker.window import Window

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
        status = EngineStatus(
            replica=self.name, ts=now, ready=True, outstanding_tokens=self.inflight_tokens, done_tokens=self.done_tokens,
            kv_blocks=eng.cfg.num_blocks, block_size=eng.cfg.block_size, window=self.window,
            decode_cost=self.cost_fit.ratio, adapters=self.sim.adapters,
            lora_slots=self.sim.opts.max_loras if self.sim.adapters else 0, loras=dict(self.loras))
        self.sim.at(now + self.sim.profile.hop_s, self.sim.router.status_arrives, status)
        self.pull(now)

    def tick(self, now: float) -> None:
        """The status loop's periodic report (every status_interval when nothing is due)."""
        if self.sim.done >= self.sim.n:
            return
        if now - self.last_status >= self.sim.opts.worker.status_interval - 1e-9:
            self.publish_status(now)
        self.sim.at(now + self.sim.opts.worker.status_interval, self.tick)
