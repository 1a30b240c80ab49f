"""The ETA's model of a job's remaining work (`prefixflow/shared/eta.py`) and its use in
`JobStatus.eta_seconds` (status, the progress bar) and the sink's token rates."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared.eta import EtaModel, Progress, output_budget
from prefixflow.shared.wire import messages as m


def test_a_job_whose_outputs_grow_is_predicted_by_its_remaining_tokens():
    # 1000 rows: the first 500 generate 16 tokens, the rest 64 (4x). At 250 rows written
    # at a steady 40 rows/s (prompt 100 tokens, half cached), the rows/s ETA says 18.75 s.
    done, total, prompt, cached, out_early, out_late = 250, 1000, 100, 50, 16, 64
    planned = 500 * out_early + 500 * out_late
    rows_rate = 40.0
    p = Progress(done, total, done * prompt, done * cached, done * out_early, planned, rows_rate,
                 uncached_rate=rows_rate * (prompt - cached), output_rate=rows_rate * out_early)
    model = EtaModel(decode_cost=2.0)
    # The truth at that engine speed: work per second = 40 rows x (50 + 2 x 16) = 3280;
    # left: 250 early rows (82 each) and 500 late ones (50 + 128).
    truth = (250 * (50 + 2 * 16) + 500 * (50 + 2 * 64)) / 3280
    assert model.eta_seconds(p) == pytest.approx(truth)
    assert (total - done) / rows_rate < 0.8 * truth  # what rows/s alone would say


def test_without_a_plan_or_token_rates_it_falls_back_to_rows_per_second():
    p = Progress(100, 400, 1000, 0, 500, 0, rows_rate=50.0)
    assert EtaModel().eta_seconds(p) == 6.0
    assert EtaModel().eta_seconds(Progress(100, None, rows_rate=5.0)) is None
    assert EtaModel().eta_seconds(Progress(0, 10)) is None  # nothing written yet
    assert EtaModel().eta_seconds(Progress(10, 10)) == 0.0


progress = st.builds(
    lambda rows, left, prompt, hit, out, extra, rate, dc: (
        Progress(rows, rows + left, rows * prompt, int(rows * prompt * hit), rows * out, rows * out + extra,
                 rate, rate * prompt * (1 - hit), rate * out), dc),
    st.integers(1, 10**6), st.integers(0, 10**6), st.integers(1, 4096), st.floats(0, 1), st.integers(0, 2048),
    st.integers(0, 10**8), st.floats(0.01, 1e4), st.floats(0.05, 200),
)


@given(progress)
def test_the_eta_is_finite_non_negative_and_zero_only_when_nothing_is_left(case):
    p, dc = case
    eta = EtaModel(dc).eta_seconds(p)
    assert eta is not None and eta >= 0
    work = EtaModel(dc).remaining_work(p)
    assert (eta == 0) == (p.rows >= p.total or work == 0)


@given(progress, st.floats(1.01, 10))
def test_more_planned_output_or_a_slower_rate_never_ends_sooner(case, factor):
    p, dc = case
    model = EtaModel(dc)
    eta = model.eta_seconds(p)
    more = Progress(**{**p.__dict__, "planned_output_tokens": int(p.planned_output_tokens * factor) + 1})
    slower = Progress(**{**p.__dict__, "uncached_rate": p.uncached_rate / factor, "output_rate": p.output_rate / factor})
    assert model.eta_seconds(more) >= eta - 1e-9
    assert model.eta_seconds(slower) >= eta - 1e-9


def test_rows_ask_their_own_output_budget_or_the_jobs():
    rows = [{"prompt": "a"}, {"sampling": {"max_tokens": 10}}, {"sampling": {"max_completion_tokens": 7}},
            {"sampling": {"max_tokens": None}}, {"sampling": "junk"}]
    assert output_budget(rows, 100) == 100 + 10 + 7 + 100 + 100


def test_job_status_uses_the_model_and_the_fleets_decode_cost():
    st_ = m.JobStatus("j", rows=250, total=1000, rate=40.0, prompt_tokens=25000, cached_tokens=12500,
                      output_tokens=4000, planned_output_tokens=40000, uncached_rate=2000.0, output_rate=640.0)
    cheap, dear = st_.eta_seconds(), st_.eta_seconds(decode_cost=10.0)
    assert cheap == pytest.approx((750 * 50 + 36000) / (2000 + 640))
    assert dear == pytest.approx((750 * 50 + 360000) / (2000 + 6400))
    assert m.JobStatus("j", rows=5, total=5, done=True).eta_seconds() == 0.0


def test_the_sink_reports_token_rates_over_its_window_and_the_jobs_plan(monkeypatch):
    from types import SimpleNamespace

    from prefixflow.services.sink import progress as sink_progress

    clock = [100.0]
    monkeypatch.setattr(sink_progress.time, "monotonic", lambda: clock[0])
    prog = sink_progress.Progress()
    spec = m.JobSpec("j", "/out", total=1000, planned_output_tokens=40000)
    out = SimpleNamespace(rows=0, errors=0, duplicates=0, tokens=(0, 0, 0))
    first = prog.status("j", out, spec, None)
    assert (first.rate, first.uncached_rate, first.output_rate) == (0.0, 0.0, 0.0)  # no second of history yet
    clock[0] += 10.0
    out.rows, out.tokens = 200, (20000, 8000, 3200)
    st_ = prog.status("j", out, spec, None)
    assert (st_.rate, st_.uncached_rate, st_.output_rate) == (20.0, 1200.0, 320.0)
    assert st_.planned_output_tokens == 40000
    assert st_.eta_seconds() == pytest.approx((800 * 60 + 36800) / (1200 + 320))


def test_the_progress_bar_and_top_take_the_engines_measured_decode_cost():
    from prefixflow.client.progress import FleetProgress, progress_note

    fleet = FleetProgress()
    assert fleet.decode_cost() is None
    fleet.update(m.EngineStatus("r0", 0.0, ready=True, decode_cost=4.0), 1.0)
    fleet.update(m.EngineStatus("r1", 0.0, ready=True, decode_cost=0.0), 1.0)  # not measured: left out
    fleet.update(m.EngineStatus("r2", 0.0, ready=True, decode_cost=8.0), 1.0)
    assert fleet.decode_cost() == 6.0
    st_ = m.JobStatus("j", rows=250, total=1000, rate=40.0, prompt_tokens=25000, cached_tokens=12500,
                      output_tokens=4000, planned_output_tokens=40000, uncached_rate=2000.0, output_rate=640.0)
    # (750 rows x 50 uncached + 6 x 36000 output tokens) / (2000 + 6 x 640) per second = 43.4 s
    assert "ETA 0:43" in progress_note(st_, fleet, "j")


def test_the_echo_engines_token_delay_makes_longer_outputs_slower():
    # What `prefixflow bench eta` runs on: work that grows with the output.
    import asyncio
    import time

    from prefixflow.services.engine_worker.engines.echo import EchoEngine

    engine = EchoEngine(0.0, token_delay=0.01)

    async def one(k: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        done = await engine.generate("r", 0, list(range(100)), m.SamplingSpec(max_tokens=k, min_tokens=k))
        return time.perf_counter() - t0, done.output_tokens

    (short, n_short), (long, n_long) = asyncio.run(one(2)), asyncio.run(one(12))
    assert (n_short, n_long) == (2, 12)
    assert short >= 0.02 and long >= 0.12 and long > short


def test_a_status_weighs_output_tokens_by_its_jobs_measured_cost():
    """The sink puts the cost its engines measured into the status, so `prefixflow status`
    (which asks the engines nothing) gives the ETA the progress bar gives with the fleet's."""
    base = dict(rows=250, total=1000, prompt_tokens=25_000, cached_tokens=0, output_tokens=4_000,
                planned_output_tokens=40_000, rate=40.0, uncached_rate=4_000.0, output_rate=640.0)
    measured = m.JobStatus("j", decode_cost=30.0, **base)
    assert measured.eta_seconds() == pytest.approx(m.JobStatus("j", **base).eta_seconds(decode_cost=30.0))
    assert measured.eta_seconds() > 2 * m.JobStatus("j", **base).eta_seconds()  # the default (1) says far sooner
    assert measured.eta_seconds(decode_cost=1.0) == pytest.approx(m.JobStatus("j", **base).eta_seconds())  # a caller's wins


def test_result_batches_decode_across_one_version_of_difference():
    """A batch with the engine's cost decodes where the field is unknown (a sink one version
    behind) and a batch without it decodes here as not measured."""
    import msgspec

    class OldResultBatch(msgspec.Struct, array_like=True):
        job: str
        results: list[m.Result]

    new = m.encode(m.ResultBatch("j", [m.Result(1, output="x")], 12.5))
    assert msgspec.msgpack.decode(new, type=OldResultBatch).results[0].output == "x"
    old = msgspec.msgpack.encode(OldResultBatch("j", [m.Result(2)]))
    assert m.result_batch_decoder.decode(old).decode_cost == 0.0
    assert m.result_batch_decoder.decode(new).decode_cost == 12.5


@given(st.lists(st.tuples(st.sampled_from(["r0", "r1", "r2"]), st.floats(0.05, 200)), min_size=1, max_size=40))
def test_the_sinks_job_cost_is_the_mean_of_each_replicas_last(batches):
    from prefixflow.services.sink.progress import Progress as SinkProgress

    p = SinkProgress()
    for replica, cost in batches:
        p.note_cost("j", replica, cost)
    last = dict(batches)
    assert p.decode_cost("j") == pytest.approx(sum(last.values()) / len(last), abs=1e-3)
    for bad in (float("nan"), float("inf"), -1.0, 1e9):  # a foreign or broken message changes nothing
        p.note_cost("j", "r9", bad)
    assert p.decode_cost("j") == pytest.approx(sum(last.values()) / len(last), abs=1e-3)
    p.forget("j")
    assert p.decode_cost("j") == 0.0


@given(st.floats(0.0001, 0.01), st.floats(0.00001, 0.01), st.lists(st.integers(1, 2000), min_size=1, max_size=20))
def test_an_echo_engine_reports_what_its_delays_make_an_output_token_cost(delay, token_delay, prompts):
    """Per prompt `delay` + `token_delay` per output token: an output token costs
    token_delay / (delay / mean prompt tokens) prompt tokens (within the fit's bounds)."""
    from prefixflow.services.engine_worker.cost_fit import MAX_RATIO, MIN_RATIO
    from prefixflow.services.engine_worker.engines.echo import EchoEngine

    e = EchoEngine(delay, token_delay=token_delay)
    for n in prompts:
        e.cost(n)
    want = token_delay / (delay / (sum(prompts) / len(prompts)))
    assert e.snapshot().decode_cost == pytest.approx(min(max(want, MIN_RATIO), MAX_RATIO))
    assert EchoEngine(delay).snapshot().decode_cost == 0.0  # no per-token delay: not measured


def test_a_rows_output_budget_counts_each_of_its_n_completions():
    rows = [{"sampling": {"n": 3}}, {"sampling": {"max_tokens": 10, "n": 2}}, {}, {"sampling": {"n": "x"}}]
    assert output_budget(rows, 100) == 300 + 20 + 100 + 100
    assert output_budget(rows, 100, default_n=4) == 300 + 20 + 400 + 400


@given(start=st.integers(1, 200), steady=st.integers(1, 200), seconds=st.integers(4, 200))
def test_a_young_jobs_rate_is_its_later_half_not_its_start_up(start, steady, seconds):
    """Statuses every second: `start` rows/s in the job's first quarter, `steady` after.
    While the job is younger than two windows, its rate is over the later half of its
    life (all steady when that is past the first quarter); older, over the last window."""
    from types import SimpleNamespace
    from unittest import mock

    from prefixflow.services.sink import progress as sink_progress

    clock = [0.0]
    prog = sink_progress.Progress()
    spec = m.JobSpec("j", "/out", total=10**9)
    out = SimpleNamespace(rows=0, errors=0, duplicates=0, tokens=(0, 0, 0))
    with mock.patch.object(sink_progress.time, "monotonic", lambda: clock[0]):
        for t in range(seconds + 1):
            clock[0] = float(t)
            out.rows = sum(start if s < seconds / 4 else steady for s in range(t))
            st_ = prog.status("j", out, spec, None)
    window = min(sink_progress.RATE_WINDOW, seconds / 2)
    first = seconds - window
    want = sum(start if s < seconds / 4 else steady for s in range(int(first), seconds)) / (seconds - int(first))
    assert st_.rate == pytest.approx(want, abs=0.01)
