"""prefixflow.services.engine_worker.admission: a prompt goes into the engine only while the KV
cache holds what the prompts in it reserved and its own blocks (issue #26)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.admission import EXACT_PEAK, MIN_RATIO, KvAdmission, Ticket
from prefixflow.services.engine_worker.feeder import Feeder, Held
from prefixflow.services.engine_worker.window import Window
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def admission(blocks=101, block_size=16) -> KvAdmission:
    a = KvAdmission()
    a.resize(blocks, block_size)  # one of them is vLLM's null block
    return a


def prompt(prefix: int, n: int, shared: int = 0, tag: int = 0) -> bytes:
    """`n` packed tokens: the first `shared` of them from prefix family `prefix`, the rest
    this prompt's own (`tag`)."""
    return tk.pack([prefix * 10_000 + i for i in range(shared)] + [tag * 100_000 + 50_000 + i for i in range(n - shared)])


def test_a_ticket_names_its_full_prompt_blocks_and_counts_the_rest_and_its_output():
    a = admission()
    t = a.ticket(prompt(1, 100), 60)  # 100 tokens: 6 full blocks + 4 tokens, + 60 of output
    assert len(t.blocks) == 6 and t.own == 4, "ceil((4 + 60) / 16)"
    u = a.ticket(prompt(1, 100, shared=64, tag=2), 60)
    v = a.ticket(prompt(1, 100, shared=64, tag=3), 60)
    assert u.blocks[:4] == v.blocks[:4] and set(u.blocks[4:]).isdisjoint(v.blocks[4:]), "equal prefixes, equal names"
    w = a.ticket(prompt(2, 100, shared=64), 60)
    assert set(w.blocks).isdisjoint(u.blocks)


def test_blocks_shared_by_prompts_in_the_engine_are_reserved_once_whatever_batch_they_came_in():
    a = admission()
    u, v = (a.ticket(prompt(1, 100, shared=64, tag=k), 60) for k in (2, 3))
    a.admit(u)
    assert a.reserved == 6 + 4
    assert a.need(v) == 2 + 4, "its 4 shared blocks are held already"
    a.admit(v)
    assert a.reserved == 6 + 4 + 2 + 4 and a.admitted == 2
    a.release(u)
    assert a.reserved == 6 + 4, "the shared blocks stay while v holds them"
    a.release(v)
    assert a.reserved == 0 and not a.held


def test_prompts_wait_for_blocks_and_the_first_always_goes_in():
    a = admission(blocks=21)  # 20 usable
    big = a.ticket(prompt(1, 1000), 100)  # 69 blocks: more than the cache
    assert a.admits(big), "alone in the engine it goes in (vLLM says what it can do)"
    a.admit(big)
    small = [a.ticket(prompt(2, 16, tag=k), 16) for k in range(12)]  # 1 block + 1 of output each
    assert not a.admits(small[0])
    a.release(big, output_tokens=100)
    for t in small[:10]:
        assert a.admits(t)
        a.admit(t)
    assert a.reserved == 20 and not a.admits(small[10]), "the cache is full: the 11th waits"


def test_expected_output_learns_from_finished_prompts():
    a = admission()
    t = a.ticket(prompt(1, 16), 160)
    assert t.own == 10, "the whole budget until outputs show otherwise"
    a.admit(t)
    for _ in range(200):
        a.admit(t)
        a.release(t, output_tokens=16)  # outputs stop at a tenth of max_tokens
    assert a.output_ratio == pytest.approx(0.1, abs=0.01)
    assert a.ticket(prompt(1, 16), 160).own in (1, 2), "~16 output tokens: 1 block (2 if the average is a hair over)"
    for _ in range(500):
        a.admit(t)
        a.release(t, output_tokens=0)
    assert a.output_ratio < MIN_RATIO and a.ticket(prompt(1, 16), 160).own == 1, f"never below {MIN_RATIO} of max_tokens"
    a.output_reserve = 0.5
    assert a.ticket(prompt(1, 8), 320).own == 1, "half of its 16 expected tokens, with the 8 of its partial block"
    assert a.ticket(prompt(1, 8), 640).own == 2, "half of 32, with 8: 24 tokens"


def test_no_capacity_known_or_disabled_admits_everything():
    a = KvAdmission()
    t = Ticket((), 10**6, 1)
    a.admit(Ticket((), 1, 1))
    assert a.admits(t)
    a = admission(blocks=2)
    a.enabled = False
    a.admit(t)
    assert a.admits(t)


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 200), st.integers(0, 3), st.integers(0, 160), st.booleans()),
                max_size=80),
       st.integers(2, 200))
def test_reservation_property(ops, blocks):
    """Whatever arrives and leaves: the reservation is the admitted prompts' own blocks
    plus the distinct full prompt blocks they hold, within the cache unless one prompt is
    alone, and 0 when all left."""
    a = admission(blocks=blocks)
    inside: list[Ticket] = []
    for n, out, family, shared, leave in ops:
        if leave and inside:
            a.release(inside.pop(0), output_tokens=out)
        else:
            t = a.ticket(prompt(family, n, shared=min(shared, n), tag=len(inside) + n), out)
            before = a.reserved
            if a.admits(t):
                a.admit(t)
                if len(inside):
                    assert a.reserved <= max(a.blocks, before) or a.peak() <= a.blocks, "admitted within the cache"
                inside.append(t)
        assert a.reserved == sum(t.own for t in inside) + len({b for t in inside for b in t.blocks})
        assert a.admitted == len(inside)
    while inside:
        a.release(inside.pop())
    assert a.reserved == 0 and a.admitted == 0 and not a.held


@given(st.lists(st.tuples(st.integers(1, 200), st.integers(1, 120), st.integers(0, 3), st.integers(0, 96)),
                min_size=1, max_size=60),
       st.integers(8, 120), st.integers(0, 3), st.sampled_from([EXACT_PEAK, 0]))
def test_prompts_admitted_by_their_peak_never_overflow_an_engine_that_runs_as_expected(prompts, blocks, every, exact):
    """A model engine: each step every prompt in it gains one output token, and a prompt
    that has its expected output ends and frees its blocks; the worker offers the next
    waiting prompt every `every` + 1 steps (and whenever one ends). Its blocks in use (the
    distinct full prompt blocks of the prompts in it, plus for each its partial block
    and output so far) never exceed the cache while more than one prompt is in it: the
    peak admits nothing vLLM would have to preempt. And every prompt gets in. (Counted
    exactly, and with the bound used past `EXACT_PEAK` prompts.)"""
    import prefixflow.services.engine_worker.admission as admission_module

    admission_module.EXACT_PEAK, saved = exact, admission_module.EXACT_PEAK
    try:
        run_model_engine(prompts, blocks, every)
    finally:
        admission_module.EXACT_PEAK = saved


def run_model_engine(prompts, blocks, every):
    a = admission(blocks=blocks + 1)
    waiting = [a.ticket(prompt(family, n, shared=min(shared, n), tag=i + 1), out)
               for i, (n, out, family, shared) in enumerate(prompts)]
    inside: list[list] = []  # [ticket, output so far]
    step = done = 0
    while waiting or inside:
        if waiting and (step % (every + 1) == 0 or not inside):
            while waiting and a.admits(waiting[0]):
                t = waiting.pop(0)
                a.admit(t)
                inside.append([t, 0])
        step += 1
        a.clock = step
        for entry in inside:
            entry[1] += 1
        in_use = len({b for t, _ in inside for b in t.blocks}) + sum(
            -(-(t.rest + min(g, t.output)) // a.block_size) for t, g in inside)
        assert len(inside) <= 1 or in_use <= a.blocks, (step, in_use)
        for entry in [e for e in inside if e[1] >= e[0].output]:
            inside.remove(entry)
            a.release(entry[0], output_tokens=entry[0].output)
            done += 1
        assert step < 10**5
    assert done == len(prompts) and a.admitted == 0 and not a.running


def test_prompts_admitted_apart_share_the_cache_their_whole_reservations_could_not():
    """Four prompts of 1 block each with 64 output tokens (4 blocks) reserve 5 blocks
    each, 20 in all, but admitted 16 steps apart they never hold more than 14 at once."""
    a = admission(blocks=15)  # 14 usable
    tickets = [a.ticket(prompt(2, 16, tag=k), 64) for k in range(4)]
    assert all(t.own == 4 for t in tickets)
    admitted = 0
    for step in (0, 16, 32, 48):
        a.clock = step
        if a.admits(tickets[admitted]):
            a.admit(tickets[admitted])
            admitted += 1
    assert admitted == 4 and a.reserved == 20 > a.blocks
    assert a.peak() <= a.blocks
    b = admission(blocks=15)  # the same four at once: only what their reservations allow
    for t in tickets:
        if b.admits(t):
            b.admit(t)
    assert b.admitted == 2


def test_a_prompt_about_to_end_frees_its_prompt_blocks_in_the_peak():
    """A (4 prompt blocks of its own, 8 output tokens) runs; B (4 prompt blocks of its
    own, 112 output tokens: 7 blocks) would reserve 11 blocks, 16 with A's 5, over the 14
    usable. B only grows past one output block after A has ended and freed its prompt
    blocks too: at most 11 blocks are ever in use, so B goes in. Counting A's prompt blocks
    until B ends (the first peak) refused it (15 > 14)."""
    a = admission(blocks=15)  # 14 usable
    ta, tb = a.ticket(prompt(1, 64, tag=1), 8), a.ticket(prompt(2, 64, tag=2), 112)
    assert (len(ta.blocks), ta.own, len(tb.blocks), tb.own) == (4, 1, 4, 7)
    a.admit(ta)
    assert a.reserved + a.need(tb) == 16 > a.blocks
    assert a.peak(tb) == 11 and a.admits(tb)
    shared = a.ticket(prompt(1, 64, shared=64, tag=3), 112)  # A's prompt blocks, its output as B's
    assert a.peak(shared) == 4 + 7, "blocks it shares with A stay held until it ends"


def prompt_bytes(pid: int, n: int) -> bytes:
    return prompt(1, n, shared=64, tag=pid + 1)


class _Lease:
    pass


def held(prompt_tokens: int, max_tokens: int, key: list[int], pid: int) -> Held:
    """A prompt whose first 64 tokens are common to every prompt, the rest its own."""
    sampling = m.SamplingSpec(max_tokens=max_tokens)
    spec = m.JobSpec(job="j", out_dir="o", sampling=sampling)
    prompt = m.Prompt(job="j", id=pid, tokens=prompt_bytes(pid, prompt_tokens), max_tokens=max_tokens)
    work = m.WorkBatch("b", [prompt], key)
    return Held(_Lease(), prompt, m.JobLookup(spec=spec), "b", work, 0)


def test_feeder_submits_in_order_as_blocks_free():
    """The worker's feeder: a window of 64 prompts, but a cache of 20 blocks of 16 tokens;
    prompts of 96 tokens share their first 64 (4 blocks, held once) and reserve 2 blocks
    each beyond them (their own 2 full blocks; no partial block, no output past 16 tokens
    ... 1 more): 4 + n x 3 <= 20."""
    submitted: list[Held] = []
    feeder = Feeder(Window(64, adaptive=False), submitted.append, lambda: 0, admission=admission(blocks=21))
    prompts = [held(96, 16, [1, 2], i) for i in range(12)]
    feeder.hold(prompts)
    assert len(submitted) == 5 and feeder.admission.reserved == 4 + 5 * 3, "4 + 5 x 3 = 19 blocks"
    for p in list(submitted[:3]):
        feeder.finished(p.prompt, output_tokens=16)
    feeder.feed()
    assert [h.prompt.id for h in submitted] == list(range(8)), "in order, as blocks free"
    assert feeder.inflight == 5 and len(feeder.pending) == 4


def test_feeder_reads_the_engines_steps_and_lets_in_what_fits_by_the_peak():
    """With the engine's step count (each decoding prompt a token further per step), a
    prompt whose whole reservation does not fit goes in once the prompts in the engine
    are far enough through their outputs; without it, it waits for one to finish."""
    steps = {"n": 0}
    submitted: list[Held] = []
    feeder = Feeder(Window(64, adaptive=False), submitted.append, lambda: 0, admission=admission(blocks=17),
                    steps=lambda: steps["n"])
    feeder.hold([held(64, 160, [1, 2], i) for i in range(4)])  # 4 shared blocks + 10 output blocks each
    assert len(submitted) == 1, "4 + 10 + 10 > 16: the second waits"
    steps["n"] = 100
    feeder.feed()
    assert len(submitted) == 1, "when the first ends (60 steps on) the second holds 4 blocks: 4 + 10 + 4 > 16"
    steps["n"] = 150  # the first is 150 of its 160 tokens through
    feeder.feed()
    assert len(submitted) == 2, "at most 4 + 10 + 1 blocks at once"
    assert feeder.admission.reserved > feeder.admission.blocks >= feeder.admission.peak()


def test_feeder_passes_over_prompts_of_an_adapter_without_a_slot():
    """An engine of one LoRA slot: the prompts of a second adapter wait (in order) while
    the first adapter's and the base model's go in; the slot frees when the first
    adapter's last prompt is done, and the waiting adapter takes it."""
    submitted: list[Held] = []
    feeder = Feeder(Window(64, adaptive=False), submitted.append, lambda: 0, lora_slots=1)
    prompts = [held(32, 8, [1], i) for i in range(6)]
    for h, lora in zip(prompts, ["a", "b", "a", "", "b", "a"], strict=True):
        h.prompt.lora = lora
    feeder.hold(prompts)
    assert [h.prompt.id for h in submitted] == [0, 2, 3, 5] and dict(feeder.engine_loras) == {"a": 3}
    assert [h.prompt.id for h in feeder.pending] == [1, 4]
    for h in [submitted[0], submitted[1], submitted[3]]:
        feeder.finished(h.prompt, output_tokens=8)
    feeder.feed()
    assert [h.prompt.id for h in submitted] == [0, 2, 3, 5, 1, 4] and dict(feeder.engine_loras) == {"b": 2}


def peak_by_definition(a: KvAdmission, t: Ticket | None = None) -> float:
    """`peak` as its docstring defines it, term by term (each alive prompt's partial
    blocks counted one by one at every moment): what the counting in `peak` must equal."""
    ends, last = [], {}
    for ticket, starts in a.running.values():
        for start in starts:
            done = min(max(a.clock - start, 0), ticket.output)
            ends.append((ticket.output - done, ticket.rest + done))
            for b in ticket.blocks:
                last[b] = max(last.get(b, -1), ticket.output - done)
    if t is not None:
        ends.append((t.output, t.rest))
        for b in t.blocks:
            last[b] = max(last.get(b, -1), t.output)
    ends.sort(reverse=True)
    top = 0
    for n, (s, _) in enumerate(ends, 1):
        fixed = sum(1 for e in last.values() if e >= s)
        alive = ends[:n]
        if len(ends) <= EXACT_PEAK:
            top = max(top, fixed + sum(-(-(x + s) // a.block_size) for _, x in alive))
        else:
            top = max(top, fixed + sum(x for _, x in alive) / a.block_size + n * s / a.block_size + n)
    return top


@given(
    block_size=st.sampled_from([1, 4, 16, 128]),
    prompts=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(0, 300), st.integers(1, 200),
                               st.integers(0, 40), st.booleans()), min_size=1, max_size=80),
    probe=st.tuples(st.integers(0, 3), st.integers(1, 300), st.integers(0, 300), st.integers(1, 200)),
)
def test_the_peak_counts_what_its_definition_counts(block_size, prompts, probe):
    """The peak's running count (sorted remainders, a running sum) equals its definition
    (every alive prompt's blocks summed at every moment), prompts admitted at many clocks,
    some twice, some released, below and above `EXACT_PEAK`."""
    a = admission(blocks=1_000_000, block_size=block_size)
    tickets = []
    for prefix, n, shared, max_tokens, steps, again in prompts:
        t = a.ticket(prompt(prefix, n, min(shared, n), tag=len(tickets)), max_tokens)
        a.admit(t)
        tickets.append(t)
        if again:
            a.admit(t)
        a.clock += steps
        if len(tickets) % 7 == 3:
            a.release(tickets.pop(0))
    prefix, n, shared, max_tokens = probe
    t = a.ticket(prompt(prefix, n, min(shared, n), tag=999), max_tokens)
    assert a.peak(t) == pytest.approx(peak_by_definition(a, t))
    assert a.peak() == pytest.approx(peak_by_definition(a))
