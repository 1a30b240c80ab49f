"""A vLLM-like engine, step by step: the part of the cluster the simulator does not run for real.

It follows vLLM v1's scheduler (`vllm/v1/core/sched/scheduler.py`, `kv_cache_manager.py`,
`block_pool.py`) where it decides time and hit rate:

- a paged KV cache of `num_blocks` blocks of `block_size` tokens (one of them vLLM's
  null block, never used for tokens); a block holding a full
  block of tokens is cached under the hash of its token prefix (a chain hash, as vLLM's
  `hash_block_tokens`); freed blocks go to the tail of a free queue and keep their hash
  until they are evicted from its head (LRU over free blocks only: a block in use is
  never evicted), so a freed prefix can still be hit;
- a step schedules the running requests first (one decode token each, or the next chunk
  of a prefill), then admits waiting requests in order (FCFS, or by `priority` as
  vLLM's priority policy) while the token budget (`max_batched_tokens`: chunked
  prefill), `max_num_seqs` and the free blocks allow; a request looks its prompt up in
  the prefix cache when it is admitted (longest run of cached blocks, at most
  `num_tokens - 1` tokens);
- when a running request needs a block and none is free, the last admitted running
  request (priority: the lowest priority, latest) is preempted: its blocks are freed
  and it waits again at the front, to be recomputed from its prompt and the tokens it
  had generated (vLLM's recompute preemption); no request is admitted in a step that
  preempted one.

Hit-rate accounting, three ways (see docs/simulator.md): `cached_tokens` per request is
vLLM's `num_cached_tokens` (the hit at its first admission: what prefixflow reports);
`lookup_*` count every prefix-cache lookup as vLLM's `PrefixCacheStats` did until
2026 (a waiting request that cannot get its blocks is looked up again on every step,
vllm#43736), split into first lookups and lookups of preempted requests (counted in
the hit rate until vLLM 0.11, vllm#25780/#25787).

Decoding requests advance in lockstep, one token per step, so their state is kept
implicitly (the step they started decoding at) and a step touches only the requests
that cross a block boundary or finish: a step costs O(changes), not O(running).

LoRA adapters: a request may name one (`Req.lora`; its prompt blocks hash under it, so
each adapter's cache is its own); with `max_loras`, at most that many adapters are among
the running requests, and a waiting request of another one is passed over (vLLM's
scheduler skips it and admits those behind it) until one of them has no request running.
Loading an adapter and the LoRA computation itself take no time here.

The time a step takes comes from a cost model (`prefixflow.sim.cost.Profile.step_seconds`).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

OUT_BASE = 1 << 62
"""Hashes of blocks that hold generated tokens (unique per request) start here; prompt
block hashes are kept below it."""
HASH_MASK = OUT_BASE - 1


class Req:
    """One request inside an engine."""

    __slots__ = (
        "arrival",
        "blocks",
        "cached",
        "computed",
        "dec_computed",
        "dec_output",
        "dec_step",
        "epoch",
        "fin_step",
        "hashes",
        "lora",
        "nfull",
        "order",
        "out_len",
        "output",
        "preemptions",
        "priority",
        "prompt_len",
        "rid",
        "state",
        "tag",
        "target",
    )

    def __init__(self, rid: int, hashes, prompt_len: int, out_len: int, priority: int = 0, arrival: float = 0.0, tag=None,
                 lora: str = "") -> None:
        self.rid = rid
        self.lora = lora
        """Its LoRA adapter ("": none): it runs only while the engine has a slot for it."""
        self.hashes = hashes
        """Chain hashes of the prompt's full blocks (engine block size)."""
        self.prompt_len = prompt_len
        self.out_len = max(1, out_len)
        self.priority = priority
        self.arrival = arrival
        self.order = 0
        self.computed = 0
        self.output = 0
        self.blocks: list[int] = []
        self.nfull = 0
        """Leading blocks of `blocks` that are full and cached."""
        self.cached = -1
        """Prompt tokens found in the prefix cache at the first admission (-1: not yet)."""
        self.epoch = 0
        self.preemptions = 0
        self.target = 0
        self.dec_step = self.dec_computed = self.dec_output = self.fin_step = 0
        self.state = 0  # 0 waiting, 1 prefill, 2 decode, 3 done
        self.tag = tag


@dataclass
class EngineStats:
    steps: int = 0
    busy_seconds: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    preemptions: int = 0
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    """Sum of `Req.cached` of finished requests (vLLM's num_cached_tokens)."""
    lookup_queries: int = 0
    lookup_hits: int = 0
    """Every lookup of a never-preempted request, retries included (vLLM's counters)."""
    preempted_queries: int = 0
    preempted_hits: int = 0
    """Lookups of preempted requests being recomputed."""
    first_queries: int = 0
    first_hits: int = 0
    """One lookup per admission of a never-preempted request (retries not counted)."""
    max_running: int = 0
    evictions: int = 0


@dataclass
class EngineConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    policy: str = "fcfs"
    max_loras: int = 0
    """LoRA adapters among the running requests at once (vLLM's `--max-loras`; 0: no limit):
    a waiting request of one more adapter is passed over until a slot frees."""
    """fcfs or priority (vLLM's scheduling_policy)."""


class Engine:
    def __init__(self, cfg: EngineConfig, step_seconds: Callable[[int, int, int], float]) -> None:
        self.cfg = cfg
        self.bs = cfg.block_size
        self.step_seconds = step_seconds
        n = cfg.num_blocks
        self.ref = [0] * n
        self.bhash: list[int | None] = [None] * n
        self.cache: dict[int, int] = {}
        # NOTE: block 0 is vLLM's null block (`BlockPool` takes it off the free queue at
        # start): `num_blocks` blocks hold num_blocks - 1 blocks of tokens.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, n))
        self.running: dict[int, Req] = {}
        self.loras: dict[str, int] = {}
        """Running requests per LoRA adapter (`EngineConfig.max_loras` bounds its size)."""
        """Admission order (FCFS preemption takes the last)."""
        self.prefilling: list[Req] = []
        self.waiting_fifo: deque[Req] = deque()
        self.waiting_heap: list[tuple[int, float, int, Req]] = []
        self.priority = cfg.policy == "priority"
        self._order = 0
        self.step_no = 0
        self.need_at: dict[int, list[tuple[Req, int]]] = {}
        self.finish_at: dict[int, list[tuple[Req, int]]] = {}
        self.n_dec = 0
        self.dec_ctx_base = 0
        self.stats = EngineStats()
        self._planned: list[tuple[Req, int]] | None = None
        self._planned_dec = 0
        self._finished_now: list[Req] = []

    # --- queue ----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.running) + self.n_waiting

    @property
    def n_waiting(self) -> int:
        return len(self.waiting_heap) if self.priority else len(self.waiting_fifo)

    def add(self, req: Req) -> None:
        self._order += 1
        req.order = self._order
        req.state = 0
        if self.priority:
            heapq.heappush(self.waiting_heap, (req.priority, req.arrival, req.order, req))
        else:
            self.waiting_fifo.append(req)

    def _requeue_front(self, req: Req) -> None:
        if self.priority:
            heapq.heappush(self.waiting_heap, (req.priority, req.arrival, req.order, req))
        else:
            self.waiting_fifo.appendleft(req)

    def _peek(self) -> Req:
        return self.waiting_heap[0][3] if self.priority else self.waiting_fifo[0]

    def _pop_waiting(self) -> None:
        if self.priority:
            heapq.heappop(self.waiting_heap)
        else:
            self.waiting_fifo.popleft()

    def idle(self) -> bool:
        return not self.running and not self.n_waiting

    # --- blocks ---------------------------------------------------------------------

    def _alloc(self, req: Req, n: int) -> None:
        free, bhash, cache, ref = self.free, self.bhash, self.cache, self.ref
        for _ in range(n):
            b, _ = free.popitem(last=False)
            h = bhash[b]
            if h is not None:
                if cache.get(h) == b:
                    del cache[h]
                bhash[b] = None
                self.stats.evictions += 1
            ref[b] = 1
            req.blocks.append(b)

    def _cache_upto(self, req: Req, nfull: int) -> None:
        """Mark `req`'s blocks [req.nfull, nfull) full and cached."""
        cache, bhash = self.cache, self.bhash
        hashes, blocks = req.hashes, req.blocks
        nh = len(hashes)
        for j in range(req.nfull, nfull):
            b = blocks[j]
            h = hashes[j] if j < nh else OUT_BASE + req.rid * 65536 + j
            bhash[b] = h
            if h not in cache:
                cache[h] = b
        req.nfull = max(req.nfull, nfull)

    def _release(self, req: Req) -> None:
        """Free a request's blocks (tail first into the free queue, as vLLM)."""
        ref, free = self.ref, self.free
        for b in reversed(req.blocks):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
        req.blocks = []
        req.nfull = 0

    # --- state of decoding requests -------------------------------------------------

    def _computed_now(self, req: Req) -> int:
        if req.state == 2:
            return req.dec_computed + self.step_no - req.dec_step
        return req.computed

    def _output_now(self, req: Req) -> int:
        if req.state == 2:
            return req.dec_output + self.step_no - req.dec_step
        return req.output

    def _start_decode(self, req: Req, next_step: int) -> None:
        req.state = 2
        req.dec_step = next_step
        req.dec_computed = req.computed
        req.dec_output = req.output
        req.fin_step = next_step + req.out_len - req.output - 1
        self.n_dec += 1
        self.dec_ctx_base += req.computed - next_step
        ep = req.epoch
        first_need = next_step + ((-req.computed) % self.bs)
        if first_need <= req.fin_step:
            self.need_at.setdefault(first_need, []).append((req, ep))
        self.finish_at.setdefault(req.fin_step, []).append((req, ep))

    def _leave_decode(self, req: Req) -> None:
        """Freeze a decoding request's implicit state (it is preempted or finishes)."""
        req.computed = self._computed_now(req)
        req.output = self._output_now(req)
        self.n_dec -= 1
        self.dec_ctx_base -= req.dec_computed - req.dec_step
        req.state = 1

    def _victim(self) -> Req:
        if self.priority:
            return max(self.running.values(), key=lambda r: (r.priority, r.arrival, r.order))
        return next(reversed(self.running.values()))

    def _running_lora(self, req: Req, delta: int) -> None:
        """Count an adapter's requests among the running (its slot frees at 0)."""
        if req.lora:
            n = self.loras.get(req.lora, 0) + delta
            if n:
                self.loras[req.lora] = n
            else:
                del self.loras[req.lora]

    def _preempt(self, req: Req) -> None:
        self._running_lora(req, -1)
        if req.state == 2:
            self._leave_decode(req)
        else:
            try:
                self.prefilling.remove(req)
            except ValueError:
                pass
        del self.running[req.rid]
        self._release(req)
        req.computed = 0
        req.epoch += 1
        req.preemptions += 1
        req.state = 0
        self.stats.preemptions += 1
        self._requeue_front(req)

    def _finish(self, req: Req) -> None:
        self._running_lora(req, -1)
        del self.running[req.rid]
        self._release(req)
        req.state = 3
        st = self.stats
        st.finished += 1
        st.prompt_tokens += req.prompt_len
        st.cached_tokens += max(req.cached, 0)
        self._finished_now.append(req)

    # --- one step -------------------------------------------------------------------

    def schedule(self) -> float:
        """Plan the next step (vLLM's `schedule`) and return its duration."""
        t = self.step_no
        bs = self.bs
        budget = self.cfg.max_batched_tokens
        preempted = False
        running = self.running
        free = self.free
        # 1. Decoding requests that cross into a new block now.
        due = self.need_at.pop(t, None)
        if due:
            for req, ep in due:
                if req.epoch != ep or req.state != 2:
                    continue
                c = req.dec_computed + t - req.dec_step
                if c // bs > req.nfull:
                    self._cache_upto(req, c // bs)
                got = True
                while not free:
                    victim = self._victim()
                    self._preempt(victim)
                    preempted = True
                    if victim is req:
                        got = False
                        break
                if got:
                    self._alloc(req, 1)
                    nxt = t + bs
                    if nxt <= req.fin_step:
                        self.need_at.setdefault(nxt, []).append((req, ep))
        n_dec = self.n_dec
        budget -= n_dec
        ctx = self.dec_ctx_base + n_dec * t + n_dec
        plan: list[tuple[Req, int]] = []
        # 2. Running requests still in prefill: their next chunk.
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req.state != 1 or req.rid not in running:
                continue
            chunk = min(req.target - req.computed, budget)
            need = -(-(req.computed + chunk) // bs) - len(req.blocks)
            ok = True
            while len(free) < need:
                victim = self._victim()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    ok = False
                    break
            if not ok:
                continue
            if need > 0:
                self._alloc(req, need)
            self._cache_upto(req, (req.computed + chunk) // bs)
            plan.append((req, chunk))
            budget -= chunk
            ctx += req.computed + chunk
        # 3. Admit waiting requests (not in a step that preempted).
        if not preempted:
            st = self.stats
            cache, ref, max_seqs = self.cache, self.ref, self.cfg.max_num_seqs
            max_loras, loras, passed = self.cfg.max_loras, self.loras, []
            while budget > 0 and len(running) < max_seqs and self.n_waiting:
                req = self._peek()
                if max_loras and req.lora and req.lora not in loras and len(loras) >= max_loras:
                    passed.append(req)  # no slot for its adapter: the ones behind it may go (vLLM)
                    self._pop_waiting()
                    continue
                target = req.prompt_len + req.output
                hit_blocks = []
                hashes = req.hashes
                nh = len(hashes)
                maxj = (target - 1) // bs
                for j in range(min(nh, maxj)):
                    b = cache.get(hashes[j])
                    if b is None:
                        break
                    hit_blocks.append(b)
                else:
                    base = OUT_BASE + req.rid * 65536
                    for j in range(nh, maxj):
                        b = cache.get(base + j)
                        if b is None:
                            break
                        hit_blocks.append(b)
                hits = len(hit_blocks) * bs
                if req.preemptions:
                    st.preempted_queries += target
                    st.preempted_hits += hits
                else:
                    st.lookup_queries += target
                    st.lookup_hits += hits
                chunk = min(target - hits, budget)
                need = -(-(hits + chunk) // bs) - len(hit_blocks)
                evictable = 0
                for b in hit_blocks:
                    if ref[b] == 0:
                        evictable += 1
                if need + evictable > len(free):
                    break
                self._pop_waiting()
                if not req.preemptions:
                    st.first_queries += target
                    st.first_hits += hits
                for b in hit_blocks:
                    if ref[b] == 0:
                        del free[b]
                    ref[b] += 1
                req.blocks = list(hit_blocks)
                req.nfull = len(hit_blocks)
                req.computed = hits
                req.target = target
                if req.cached < 0:
                    req.cached = min(hits, req.prompt_len)
                self._alloc(req, need)
                self._cache_upto(req, (hits + chunk) // bs)
                req.state = 1
                running[req.rid] = req
                self._running_lora(req, 1)
                self.prefilling.append(req)
                plan.append((req, chunk))
                budget -= chunk
                ctx += hits + chunk
            for req in reversed(passed):
                self._requeue_front(req)
            st.max_running = max(st.max_running, len(running))
        self._planned = plan
        self._planned_dec = n_dec
        pf = sum(c for _, c in plan)
        if not plan and not n_dec:
            if not running and self.n_waiting and not preempted:
                req = self._peek()
                raise ValueError(f"request {req.rid} ({req.prompt_len + req.output} tokens) cannot fit the KV cache")
            return 1e-4  # nothing runnable this step (all preempted): the next step admits
        return self.step_seconds(pf, n_dec, ctx)

    def complete(self, seconds: float) -> list[Req]:
        """Apply the planned step; returns the requests that finished."""
        t = self.step_no
        st = self.stats
        st.steps += 1
        st.busy_seconds += seconds
        self._finished_now = []
        pf = 0
        for req, chunk in self._planned or ():
            if req.state != 1 or req.rid not in self.running:
                continue
            pf += chunk
            req.computed += chunk
            if req.computed >= req.target:
                self.prefilling.remove(req)
                req.output += 1
                if req.output >= req.out_len:
                    req.state = 1
                    self._finish(req)
                else:
                    self._start_decode(req, t + 1)
        st.prefill_tokens += pf
        st.decode_tokens += self._planned_dec
        fin = self.finish_at.pop(t, None)
        if fin:
            for req, ep in fin:
                if req.epoch != ep or req.state != 2:
                    continue
                self.step_no = t + 1  # its last token is in
                self._leave_decode(req)
                self.step_no = t
                self._finish(req)
        self.step_no = t + 1
        self._planned = None
        return self._finished_now

    # --- invariants (tests) -----------------------------------------------------------

    def check(self) -> None:
        n = self.cfg.num_blocks
        used = sum(len(r.blocks) for r in self.running.values())
        held = sum(1 for b in range(n) if self.ref[b] > 0)
        assert held + len(self.free) == n - 1, (held, len(self.free), n)  # block 0: the null block
        assert all(self.ref[b] == 0 for b in self.free)
        assert held <= used  # shared prefix blocks count once
        for h, b in self.cache.items():
            assert self.bhash[b] == h
        for r in self.running.values():
            c = self._computed_now(r)
            assert len(r.blocks) * self.bs >= c, (len(r.blocks), c)
