"""The engine-worker's self-sizing window (`services/engine_worker/window.py`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine_worker.window import (
    MIN_WINDOW,
    PROBE_AFTER_IDLE,
    PROBE_JUDGE_EVERY,
    PROBE_SIZE,
    START_WINDOW,
    Window,
)

pytestmark = pytest.mark.unit


def test_a_quiet_engine_runs_one_prompt_alone_until_it_finishes():
    w = Window(256, first_result_seconds=10.0)
    assert w.limit == START_WINDOW
    w.work_arrives(0.0, inflight=0, max_tokens=2000, generated=0)
    assert w.limit == PROBE_SIZE
    # 200 steps/s alone: 2000 tokens at 10 s, no slack to let more in.
    w.observe(1.0, kv_blocks=1000, running=1, generated=200, inflight=1)
    assert w.limit == PROBE_SIZE
    w.completed(9.5)
    assert w.limit == START_WINDOW
    # Once the engine runs many, the window follows it.
    w.observe(10.0, kv_blocks=1000, running=50, generated=5000, inflight=64)
    assert w.limit == 100


def test_a_probe_lets_more_in_while_the_first_result_stays_on_time():
    """Steps that cost the same for 1 or 8 sequences (a GPU): the probe doubles every
    second; steps that slow down with every sequence (a CPU) stop the doubling."""
    w = Window(256, first_result_seconds=10.0)
    w.work_arrives(0.0, inflight=0, max_tokens=1000, generated=0)
    generated, limits = 0, []
    for t in range(1, 6):
        generated += 500 * w.limit  # 500 steps/s whatever the batch
        w.observe(float(t), kv_blocks=1000, running=w.limit, generated=generated, inflight=w.limit)
        limits.append(w.limit)
    # 1000 tokens = 2 s at 500 steps/s; after 1 s, 500 left: even at twice the step time on time.
    assert limits[:2] == [2, 4]
    cpu = Window(256, first_result_seconds=10.0)
    cpu.work_arrives(0.0, inflight=0, max_tokens=2000, generated=0)
    made = 0
    for t in range(1, 8):
        steps = 250 / cpu.limit  # a step costs 4 ms per sequence
        made += steps * cpu.limit
        cpu.observe(float(t), kv_blocks=1000, running=cpu.limit, generated=int(made), inflight=cpu.limit)
    assert cpu.probe_since is None or cpu.limit <= 2


def test_a_probe_that_cannot_finish_in_time_ends_early():
    w = Window(256, first_result_seconds=8.0)
    w.work_arrives(0.0, inflight=0, max_tokens=2000, generated=10_000)
    # Too early to judge.
    w.observe(PROBE_JUDGE_EVERY / 2, kv_blocks=1000, running=1, generated=10_010, inflight=1)
    assert w.limit == PROBE_SIZE
    # 100 tokens/s: 2000 tokens need 20 s > 8 s: stop waiting, open the window.
    w.observe(1.0, kv_blocks=1000, running=1, generated=10_100, inflight=1)
    assert w.limit == START_WINDOW
    # 250 tokens/s would have made it (2000 / 250 = 8 s).
    w = Window(256, first_result_seconds=8.0)
    w.work_arrives(0.0, inflight=0, max_tokens=2000, generated=0)
    w.observe(1.0, kv_blocks=1000, running=1, generated=250, inflight=1)
    assert w.limit == PROBE_SIZE and w.probe_since is not None
    # A prompt still in prefill is judged by its time alone.
    w = Window(256, first_result_seconds=8.0)
    w.work_arrives(0.0, inflight=0, max_tokens=2000, generated=0)
    w.observe(3.0, kv_blocks=1000, running=1, generated=0, inflight=1)
    assert w.probe_since is not None
    w.observe(9.0, kv_blocks=1000, running=1, generated=0, inflight=1)
    assert w.probe_since is None


def test_short_gaps_never_probe_again_but_a_quiet_spell_does():
    w = Window(256)
    w.work_arrives(0.0, inflight=0, max_tokens=16, generated=0)
    w.completed(0.5)
    w.work_arrives(1.0, inflight=0, max_tokens=16, generated=16)  # the next batch of the job
    assert w.limit == START_WINDOW
    w.observe(2.0, kv_blocks=1000, running=0, generated=40, inflight=0)
    w.completed(3.0)
    w.work_arrives(3.0 + PROBE_AFTER_IDLE, inflight=0, max_tokens=16, generated=40)  # a new job later
    assert w.limit == PROBE_SIZE
    assert w.probes == 2


def test_a_busy_engine_never_probes():
    w = Window(256)
    w.work_arrives(0.0, inflight=3, max_tokens=16, generated=0)
    assert w.limit == START_WINDOW and w.probes == 0


def test_static_window_is_the_configured_one_from_the_start():
    w = Window(200, adaptive=False)
    w.work_arrives(0.0, inflight=0, max_tokens=2000, generated=0)
    w.observe(1.0, kv_blocks=1000, running=3, generated=10, inflight=200)
    assert w.limit == 200 and w.probes == 0


def test_a_rebuilt_engine_starts_cold_with_a_probe():
    w = Window(256)
    w.work_arrives(0.0, inflight=0, max_tokens=16, generated=0)
    w.completed(0.1)
    w.observe(1.0, kv_blocks=1000, running=80, generated=100, inflight=80)
    assert w.limit == 160
    w.reset()
    assert w.limit == START_WINDOW
    w.work_arrives(2.0, inflight=0, max_tokens=16, generated=100)
    assert w.limit == PROBE_SIZE


events = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "complete", "observe", "reset"]),
        st.floats(0, 5),  # time step
        st.integers(0, 300),  # running / inflight
        st.integers(0, 3000),  # max_tokens
        st.integers(0, 400),  # tokens generated in the step
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 1024), st.booleans(), st.sampled_from([0, 64, 4096]), events)
def test_the_limit_stays_within_bounds(configured, adaptive, kv_blocks, evs):
    """Whatever happens, the limit is at least one prompt (work always flows) and never
    more than the configured window; outside a probe, an engine with a KV cache gets at
    least MIN_WINDOW (or the configured window if smaller)."""
    w = Window(configured, adaptive)
    now, generated = 0.0, 0
    for kind, dt, n, max_tokens, made in evs:
        now += dt
        generated += made
        if kind == "arrive":
            w.work_arrives(now, n % 3, max_tokens, generated)
        elif kind == "complete":
            w.completed(now)
        elif kind == "observe":
            w.observe(now, kv_blocks, n, generated, n)
        else:
            w.reset()
        assert 1 <= w.limit <= configured
        if w.probe_since is None and kv_blocks:
            assert w.limit >= min(configured, MIN_WINDOW) or w.limit == min(configured, START_WINDOW)
        if not adaptive:
            assert w.limit == configured


def test_the_feeder_keeps_the_window_per_prompt_and_counts_what_it_holds():
    """A 5-prompt work message on a quiet engine: one prompt goes in alone (the probe),
    the rest follow at its completion; everything held counts as load until finished."""
    from services.engine_worker.feeder import Feeder, Held
    from shared.wire import messages as m

    submitted: list[Held] = []
    window = Window(4)
    feeder = Feeder(window, submitted.append, lambda: 0)
    spec = m.JobSpec(job="j", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=7))
    prompts = [m.Prompt("j", i, bytes(4 * 10), max_tokens=7) for i in range(5)]
    feeder.hold([Held(None, p, m.JobLookup(spec), "") for p in prompts])
    assert [h.prompt.id for h in submitted] == [0] and window.probe_tokens == 7
    assert feeder.held_tokens == sum(p.work_tokens for p in prompts) and feeder.jobs == {"j": 5} and feeder.room() == -4
    feeder.finished(prompts[0])
    feeder.feed()
    assert [h.prompt.id for h in submitted] == [0, 1, 2, 3, 4] and feeder.inflight == 4
    feeder.open = False  # the engine died: nothing more goes in, pending goes back
    feeder.hold([Held(None, m.Prompt("k", 9, bytes(8)), m.JobLookup(spec), "")])
    assert len(submitted) == 5
    feeder.drop_pending()
    for p in prompts[1:]:
        feeder.finished(p)
    assert feeder.held_tokens == 0 and not feeder.jobs and feeder.inflight == 0
