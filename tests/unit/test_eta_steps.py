"""The ETA's engine model: the step fit with a fixed cost (`cost_fit.StepFit`), the steady
rate of continuous batching it gives (`eta.rows_per_second`), and how it travels from an
engine to a job's status (result batches, the sink's mean, `JobStatus`)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.cost_fit import StepFit
from prefixflow.shared.eta import EtaModel, Progress, drain_seconds, rows_per_second, steady_step
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def steps(s0: float, a: float, b: float, n: int, rng: random.Random, noise: float = 0.0):
    """Steps of a continuous-batching engine: 1-256 requests decoding, a prefill chunk
    beside them in some; seconds = s0 + a x computed + b x generated (+ noise)."""
    for _ in range(n):
        generated = rng.randint(1, 256)
        computed = rng.choice([0, 0, rng.randint(16, 2048)])
        yield (s0 + a * computed + b * generated) * (1 + rng.uniform(-noise, noise)), computed, generated


@given(s0=st.floats(1e-3, 0.05), a=st.floats(1e-6, 1e-4), b=st.floats(1e-6, 1e-3), seed=st.integers(0, 10**6))
def test_the_step_fit_finds_the_fixed_cost_and_each_tokens(s0, a, b, seed):
    fit = StepFit()
    for sample in steps(s0, a, b, 400, random.Random(seed), noise=0.02):
        fit.add(*sample)
    got = fit.model()
    assert got is not None
    # Judged by what the fit predicts (what the ETA uses), over the steps an engine runs:
    # within 10 %, or 2 % of a typical step where a step is far below the noise of others.
    typical = s0 + a * 682 + b * 128
    for computed, generated in ((0, 1), (0, 256), (2048, 1), (2048, 256), (512, 64)):
        want = s0 + a * computed + b * generated
        assert abs(got[0] + got[1] * computed + got[2] * generated - want) < 0.1 * want + 0.02 * typical


@given(st.lists(st.tuples(st.one_of(st.floats(-1, 1e4), st.just(float("nan"))), st.integers(-5, 5000), st.integers(-5, 500)),
                max_size=80))
def test_the_step_fit_never_reports_a_negative_or_empty_model(samples):
    fit = StepFit(min_steps=1)
    for sample in samples:
        fit.add(*sample)
        got = fit.model()
        assert got is None or (all(x >= 0 and math.isfinite(x) for x in got) and got[1] + got[2] > 0)


def step(s0=0.01, prompt_s=2e-5, output_s=1e-4, batch_tokens=2048, slots=256, kv_tokens=0) -> m.StepModel:
    return m.StepModel(s0, prompt_s, output_s, batch_tokens, slots, kv_tokens)


@given(uncached=st.floats(0, 4000), prompt=st.floats(0, 8000), out=st.floats(1, 2000), more=st.floats(1.01, 8),
       s0=st.floats(0, 0.1), batch=st.integers(0, 8192), slots=st.integers(1, 1024), kv=st.integers(0, 10**6))
def test_longer_outputs_or_prompts_never_make_rows_go_faster(uncached, prompt, out, more, s0, batch, slots, kv):
    model = step(s0=s0, batch_tokens=batch, slots=slots, kv_tokens=kv)
    rate = rows_per_second(model, uncached, out, prompt)
    assert rate > 0 and math.isfinite(rate)
    assert rows_per_second(model, uncached, out * more, prompt) <= rate * (1 + 1e-9)
    assert rows_per_second(model, uncached * more, out, prompt * more) <= rate * (1 + 1e-9)


def test_the_rate_is_what_the_step_limits_give():
    # The prompt budget limits: 2048 / 256 = 8 rows a step, running 8 x 16 = 128 of 256 slots.
    model = step(s0=0.01, prompt_s=1e-5, output_s=1e-4, batch_tokens=2048, slots=256)
    assert rows_per_second(model, 256, 16, 256) == pytest.approx(8 / (0.01 + 1e-5 * 2048 + 1e-4 * 128))
    # The slots limit: 256 / 64 = 4 rows a step (the budget would admit 8).
    assert rows_per_second(model, 256, 64, 256) == pytest.approx(4 / (0.01 + 1e-5 * 1024 + 1e-4 * 256))
    # The KV cache limits: 20,480 tokens hold 20480 / (256 + 64) = 64 rows, 1 a step.
    assert rows_per_second(step(kv_tokens=20480), 256, 64, 256) == pytest.approx(1 / (0.01 + 2e-5 * 256 + 1e-4 * 64))


def progress(rows, out_done, planned, total=2000, rate=50.0) -> Progress:
    return Progress(rows, total, prompt_tokens=256 * rows, cached_tokens=64 * rows, output_tokens=out_done,
                    planned_output_tokens=planned, rows_rate=rate, uncached_rate=192 * rate,
                    output_rate=rate * out_done / max(rows, 1))


def test_a_second_half_that_fills_the_slots_is_predicted_slower_by_the_step_model():
    """The first half (16 tokens a row) is limited by the prompt budget, the second (64)
    by the slots: the engine model says how much slower the rows left go."""
    model = EtaModel(10.0, step(s0=0.01, prompt_s=1e-5, output_s=1e-4), replicas=2)
    p = progress(500, 500 * 16, 1000 * 16 + 1000 * 64)
    left_out = (1000 * 16 + 1000 * 64 - 500 * 16) / 1500
    assert model.engine_eta(p) == pytest.approx(drain_seconds(model.step, 2, 1500, 192, left_out, 256))
    # Slower than the first half's rate says, faster than steady state to the last row
    # (the drain's steps have no prefill and fewer requests running).
    assert 1500 / (2 * rows_per_second(model.step, 192, 16, 256)) < model.engine_eta(p)
    assert model.engine_eta(p) < 1500 / (2 * rows_per_second(model.step, 192, left_out, 256))
    assert EtaModel(10.0).engine_eta(p) is None  # no step model


def test_the_sink_averages_its_replicas_last_step_models_and_refuses_nonsense():
    from prefixflow.services.sink.progress import Progress as SinkProgress

    p = SinkProgress()
    p.note_step("j", "r0", step(s0=0.01, slots=100))
    p.note_step("j", "r1", step(s0=0.03, slots=200))
    p.note_step("j", "r1", step(s0=0.02, slots=300))  # its last counts
    for bad in (step(s0=float("nan")), step(s0=-1.0), step(slots=0), step(prompt_s=0.0, output_s=0.0),
                step(output_s=float("inf"))):
        p.note_step("j", "r9", bad)
    mean, n = p.step("j")
    assert n == 2 and mean.s0 == pytest.approx(0.015) and mean.slots == 200
    p.forget("j")
    assert p.step("j") == (None, 0)


def test_a_result_batch_carries_the_step_model_and_decodes_without_it():
    import msgspec

    class OldResultBatch(msgspec.Struct, array_like=True):
        job: str
        results: list[m.Result]
        decode_cost: float = 0.0

    new = m.encode(m.ResultBatch("j", [m.Result(1, output="x")], 2.0, step(slots=64)))
    assert msgspec.msgpack.decode(new, type=OldResultBatch).decode_cost == 2.0
    assert m.result_batch_decoder.decode(new).step.slots == 64
    assert m.result_batch_decoder.decode(msgspec.msgpack.encode(OldResultBatch("j", []))).step is None
    status = m.JobStatus("j", step=step(), replicas=2)
    assert m.job_status_decoder.decode(m.encode_json(status)).step == step()


def test_the_status_eta_is_the_engine_models_where_the_engines_report_one():
    base = dict(rows=500, total=2000, prompt_tokens=256 * 500, cached_tokens=64 * 500, output_tokens=500 * 16,
                planned_output_tokens=1000 * 16 + 1000 * 64, rate=50.0, uncached_rate=192 * 50.0, output_rate=800.0,
                decode_cost=10.0)
    with_step = m.JobStatus("j", step=step(), replicas=2, **base)
    without = m.JobStatus("j", **base)
    p = with_step.eta_progress()
    assert with_step.eta_seconds() == pytest.approx(EtaModel(10.0, step(), 2).engine_eta(p))
    assert without.eta_seconds() == pytest.approx(EtaModel(10.0).work_eta(p))  # echo: the token-work model
    assert m.JobStatus("j", step=step(), replicas=4, **base).eta_seconds() < with_step.eta_seconds()
    done = m.JobStatus("j", step=step(), replicas=2, **{**base, "rows": 2000})
    assert done.eta_seconds() == 0.0


@given(rows=st.floats(0, 10**6), more=st.floats(1, 100), uncached=st.floats(0, 4000), out=st.floats(1, 2000),
       s0=st.floats(0, 0.1), slots=st.integers(1, 1024), replicas=st.integers(1, 64))
def test_the_drain_grows_with_the_rows_and_ends_at_the_steady_rate(rows, more, uncached, out, s0, slots, replicas):
    model = step(s0=s0, slots=slots)
    t = drain_seconds(model, replicas, rows, uncached, out, uncached)
    assert t is not None and t > 0 and math.isfinite(t)
    assert drain_seconds(model, replicas, rows * more + 1, uncached, out, uncached) >= t * (1 - 1e-9)
    # Past what the engines hold, each further row costs what the steady rate says.
    r, _ = steady_step(model, uncached, out, uncached)
    big = replicas * r * max(out, 1.0) + rows + 1
    extra = drain_seconds(model, replicas, big + 1000, uncached, out, uncached) - drain_seconds(
        model, replicas, big, uncached, out, uncached)
    assert extra == pytest.approx(1000 / (replicas * rows_per_second(model, uncached, out, uncached)), rel=1e-6)
