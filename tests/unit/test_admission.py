"""services.engine_worker.admission: a prompt goes into the engine only while the KV
cache holds what the prompts in it reserved and its own blocks (issue #26)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.engine_worker.admission import MIN_RATIO, KvAdmission, Ticket
from services.engine_worker.feeder import Feeder, Held
from services.engine_worker.window import Window
from shared.prefix import tokens as tk
from shared.wire import messages as m

pytestmark = pytest.mark.unit


def admission(blocks=101, block_size=16) -> KvAdmission:
    a = KvAdmission()
    a.resize(blocks, block_size)  # one of them is vLLM's null block
    return a


def test_a_ticket_counts_prompt_and_expected_output_beyond_the_shared_prefix():
    a = admission()
    t = a.ticket(100, 60, (7, 8), 64)  # 160 tokens: 10 blocks; the group's 64-token prefix: 4 of them
    assert (t.shared, t.own) == (4, 6)
    assert a.ticket(100, 60, (), 64).shared == 0, "a mixed batch shares nothing"
    assert a.ticket(50, 10, (7,), 128).shared == 3, "never more than the prompt (its full blocks)"


def test_a_group_reserves_its_prefix_once():
    a = admission()
    t = a.ticket(100, 60, (7,), 64)
    a.admit(t)
    a.admit(t)
    assert a.reserved == 4 + 6 + 6 and a.admitted == 2
    a.release(t)
    assert a.reserved == 4 + 6
    a.release(t)
    assert a.reserved == 0 and not a.groups


def test_prompts_wait_for_blocks_and_the_first_always_goes_in():
    a = admission(blocks=21)  # 20 usable
    big = a.ticket(1000, 100, (), 0)  # 69 blocks: more than the cache
    assert a.admits(big), "alone in the engine it goes in (vLLM says what it can do)"
    a.admit(big)
    small = a.ticket(16, 16, (), 0)  # 2 blocks
    assert not a.admits(small)
    a.release(big, output_tokens=100)
    assert a.admits(small)
    for _ in range(10):
        assert a.admits(small)
        a.admit(small)
    assert a.reserved == 20 and not a.admits(small), "the cache is full: the 11th waits"


def test_expected_output_learns_from_finished_prompts():
    a = admission()
    t = a.ticket(16, 160, (), 0)
    assert t.own == 11, "the whole budget until outputs show otherwise"
    a.admit(t)
    for _ in range(200):
        a.admit(t)
        a.release(t, output_tokens=16)  # outputs stop at a tenth of max_tokens
    assert a.output_ratio == pytest.approx(0.1, abs=0.01)
    assert a.ticket(16, 160, (), 0).own == 3  # 16 + 16 tokens
    for _ in range(500):
        a.admit(t)
        a.release(t, output_tokens=0)
    assert a.output_ratio >= 0 and a.ticket(16, 160, (), 0).own == 2, f"never below {MIN_RATIO} of max_tokens"


def test_no_capacity_known_or_disabled_admits_everything():
    a = KvAdmission()
    t = Ticket((), 0, 10**6, 1)
    a.admit(Ticket((), 0, 1, 1))
    assert a.admits(t)
    a = admission(blocks=2)
    a.enabled = False
    a.admit(t)
    assert a.admits(t)


@given(st.lists(st.tuples(st.integers(1, 600), st.integers(0, 300), st.integers(0, 3), st.booleans()), max_size=80),
       st.integers(2, 200))
def test_reservation_property(ops, blocks):
    """Whatever arrives and leaves: the reservation is what the admitted prompts and their
    live groups hold, within the cache unless one prompt is alone, and 0 when all left."""
    a = admission(blocks=blocks)
    inside: list[Ticket] = []
    prefix: dict = {}  # group -> the longest shared prefix of its members since it went live
    for prompt, out, group, leave in ops:
        if leave and inside:
            gone = inside.pop(0)
            a.release(gone, output_tokens=out)
            if gone.group and not any(t.group == gone.group for t in inside):
                del prefix[gone.group]
        else:
            t = a.ticket(prompt, out, (group,) if group else (), 64)
            before = a.reserved
            if a.admits(t):
                a.admit(t)
                if inside:
                    assert a.reserved <= max(a.blocks, before), "admitted within the cache"
                inside.append(t)
                if t.group:
                    prefix[t.group] = max(prefix.get(t.group, 0), t.shared)
        assert a.reserved == sum(t.own for t in inside) + sum(prefix.values())
        assert a.admitted == len(inside)
    while inside:
        a.release(inside.pop())
    assert a.reserved == 0 and a.admitted == 0 and not a.groups


class _Lease:
    pass


def held(prompt_tokens: int, max_tokens: int, key: list[int], pid: int) -> Held:
    sampling = m.SamplingSpec(max_tokens=max_tokens)
    spec = m.JobSpec(job="j", out_dir="o", sampling=sampling)
    prompt = m.Prompt(job="j", id=pid, tokens=tk.pack(list(range(prompt_tokens))), max_tokens=max_tokens)
    work = m.WorkBatch("b", [prompt], key)
    return Held(_Lease(), prompt, m.JobLookup(spec=spec), "b", work, 0)


def test_feeder_submits_in_order_as_blocks_free():
    """The worker's feeder: a window of 64 prompts, but a cache of 20 blocks of 16 tokens;
    prompts of one 64-token group (4 shared blocks) reserve 2 blocks each beyond it."""
    submitted: list[Held] = []
    feeder = Feeder(Window(64, adaptive=False), submitted.append, lambda: 0, admission=admission(blocks=21),
                    hash_block_size=32)
    prompts = [held(80, 16, [1, 2], i) for i in range(12)]  # 96 tokens: 6 blocks, 4 of them shared
    feeder.hold(prompts)
    assert len(submitted) == 8 and feeder.admission.reserved == 4 + 8 * 2, "4 + 8 x 2 = 20 blocks"
    for p in list(submitted[:3]):
        feeder.finished(p.prompt, output_tokens=16)
    feeder.feed()
    assert [h.prompt.id for h in submitted] == list(range(11)), "in order, as blocks free"
    assert feeder.inflight == 8 and len(feeder.pending) == 1
