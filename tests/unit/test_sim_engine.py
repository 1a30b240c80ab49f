"""prefixflow.sim.engine: the vLLM-like engine model's invariants, on random request streams."""

from __future__ import annotations

import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.sim.engine import Engine, EngineConfig, Req

pytestmark = pytest.mark.unit

BS = 4


def chain(prefix: int, own: int, blocks: int, shared: int) -> array.array:
    """Block hashes: the first `shared` blocks from prefix `prefix`, the rest unique."""
    out = array.array("q")
    h = prefix * 1000
    for j in range(blocks):
        h = hash((h, j if j < shared else (own, j))) & ((1 << 62) - 1)
        out.append(h)
    return out


requests = st.lists(
    st.tuples(
        st.integers(0, 3),  # prefix
        st.integers(1, 40),  # prompt tokens
        st.integers(1, 12),  # output tokens
        st.integers(0, 5),  # priority
        st.integers(0, 3),  # steps before the next arrival
    ),
    min_size=1,
    max_size=40,
)


def run(engine: Engine, reqs, check=True) -> list[Req]:
    """Feed requests at their arrival steps, step until all finish; check invariants
    after every step."""
    pending = []
    for k, (prefix, n, out, prio, gap) in enumerate(reqs):
        blocks = n // BS
        pending.append((gap, Req(k, chain(prefix, k, blocks, min(blocks, 2)), n, out, prio, float(k))))
    done: list[Req] = []
    steps = 0
    while pending or not engine.idle():
        while pending and pending[0][0] <= 0:
            engine.add(pending.pop(0)[1])
        if pending:
            pending[0] = (pending[0][0] - 1, pending[0][1])
        if engine.idle():
            continue
        evicted_before = engine.stats.evictions
        free_before = set(engine.free)
        cached_before = {b for b in free_before if engine.bhash[b] is not None}
        dur = engine.schedule()
        assert dur > 0
        # Eviction takes only free blocks: a block of a running request keeps its hash.
        if engine.stats.evictions > evicted_before:
            lost = {b for b in cached_before if engine.bhash[b] is None or b not in engine.free}
            assert lost <= free_before
        finished = engine.complete(dur)
        done.extend(finished)
        if check:
            engine.check()
        steps += 1
        assert steps < 100_000
    return done


@given(reqs=requests, blocks=st.integers(14, 40), budget=st.integers(4, 64), seqs=st.integers(1, 8),
       policy=st.sampled_from(["fcfs", "priority"]))
def test_every_request_finishes_exactly_once_within_capacity(reqs, blocks, budget, seqs, policy):
    cfg = EngineConfig(num_blocks=blocks, block_size=BS, max_num_seqs=seqs, max_batched_tokens=budget, policy=policy)
    engine = Engine(cfg, lambda pf, dec, ctx: 0.01 + 0.001 * pf + 0.001 * dec)
    done = run(engine, reqs)
    ids = [r.rid for r in done]
    assert sorted(ids) == list(range(len(reqs)))  # each exactly once
    for r in done:
        assert r.output == r.out_len
        assert 0 <= r.cached <= r.prompt_len - 1 or r.cached == 0
        assert r.blocks == []
    assert len(engine.free) == blocks - 1  # every block back in the free queue (but vLLM's null block)
    st_ = engine.stats
    assert st_.finished == len(reqs)
    assert st_.cached_tokens <= st_.prompt_tokens
    assert st_.first_hits <= st_.lookup_hits and st_.first_queries <= st_.lookup_queries


def test_shared_prefix_is_hit_and_lru_keeps_it_while_free():
    cfg = EngineConfig(num_blocks=64, block_size=BS, max_num_seqs=4, max_batched_tokens=64)
    engine = Engine(cfg, lambda *a: 0.01)
    # Two prompts of 16 tokens sharing 2 of their 4 blocks, one after the other.
    a = Req(0, chain(1, 0, 4, 2), 16, 2)
    b = Req(1, chain(1, 1, 4, 2), 16, 2)
    run(engine, [])
    engine.add(a)
    while not engine.idle():
        engine.complete(engine.schedule())
    engine.add(b)
    while not engine.idle():
        engine.complete(engine.schedule())
    assert a.cached == 0 and b.cached == 2 * BS


def test_preemption_recomputes_and_counts_lookups_apart():
    # 10 blocks of 4 tokens; 3 requests of 12 prompt + 12 output tokens need 6 blocks each.
    cfg = EngineConfig(num_blocks=10, block_size=BS, max_num_seqs=8, max_batched_tokens=64)
    engine = Engine(cfg, lambda *a: 0.01)
    reqs = [Req(k, chain(9, k, 3, 0), 12, 12) for k in range(3)]
    for r in reqs:
        engine.add(r)
    done = []
    while not engine.idle():
        done += engine.complete(engine.schedule())
        engine.check()
    assert sorted(r.rid for r in done) == [0, 1, 2]
    assert engine.stats.preemptions > 0
    assert engine.stats.preempted_queries > 0
    assert any(r.preemptions for r in reqs)


@given(reqs=st.lists(st.tuples(st.sampled_from(["", "a", "b", "c"]), st.integers(1, 30), st.integers(1, 8)),
                     min_size=1, max_size=30),
       slots=st.integers(1, 2), policy=st.sampled_from(["fcfs", "priority"]))
def test_lora_slots_bound_the_adapters_running_and_every_request_finishes(reqs, slots, policy):
    """With `max_loras`, the running requests never hold more adapters than the slots (the
    base model takes none); a request of another adapter waits, the ones behind it run."""
    cfg = EngineConfig(num_blocks=60, block_size=BS, max_num_seqs=8, max_batched_tokens=64, policy=policy, max_loras=slots)
    engine = Engine(cfg, lambda pf, dec, ctx: 0.01 + 0.001 * pf + 0.001 * dec)
    for k, (lora, n, out) in enumerate(reqs):
        engine.add(Req(k, chain(0, k, n // BS, min(n // BS, 2)), n, out, 0, float(k), lora=lora))
    done, steps = [], 0
    while not engine.idle():
        done += engine.complete(engine.schedule())
        running = {r.lora for r in engine.running.values() if r.lora}
        assert len(running) <= slots and running == set(engine.loras)
        steps += 1
        assert steps < 10_000
    assert sorted(r.rid for r in done) == list(range(len(reqs)))


def test_an_adapters_prefix_is_its_own():
    """The same tokens under two adapters share no cached block (the workload's chains)."""
    from prefixflow.sim.workload import Workload

    tokens = [bytes(range(64))] * 4
    wl = Workload("w", tokens, [4] * 4, lora=["", "", "a", "b"])
    h = wl.engine_hashes(4)
    assert list(h[0]) == list(h[1]) and not set(h[0]) & set(h[2]) and not set(h[2]) & set(h[3])
