"""Typed engine errors: a per-request failure becomes that row's error row; only a dead
engine (vLLM's `EngineDeadError`, or an engine no longer alive) rebuilds it."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.services.engine_worker.engines.base import Completion, EngineDead, EngineStats, RequestFailed, is_engine_death
from prefixflow.services.engine_worker.feeder import Held
from prefixflow.services.engine_worker.service import EngineWorker
from prefixflow.shared.process.config import EngineWorkerConfig
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def test_only_engine_dead_or_a_dead_engine_means_death():
    assert is_engine_death(EngineDead("core gone"), alive=True)
    assert is_engine_death(RuntimeError("output handler died"), alive=False)
    for exc in (RequestFailed("bad"), ValueError("bad temperature"), RuntimeError("unnamed"), KeyError("x")):
        assert not is_engine_death(exc, alive=True), exc


class FakeEngine:
    """Raises `error` for every request (None: completes it)."""

    adapters: list[str] = []
    lora_slots = 0

    def __init__(self, error: BaseException | None, alive: bool = True) -> None:
        self.error, self._alive = error, alive

    async def generate(self, request_id, prompt_id, tokens, sampling, priority=0, lora="") -> Completion:
        if self.error is not None:
            raise self.error
        return Completion("ok", m.FinishReason.STOP, len(tokens), 0, 1)

    def alive(self) -> bool:
        return self._alive

    def snapshot(self) -> EngineStats:
        return EngineStats()


class FakeOutbox:
    def __init__(self) -> None:
        self.rows: list[m.Result] = []

    async def add(self, job: str, result: m.Result, lease) -> None:
        self.rows.append(result)


def run_one(engine: FakeEngine, sampling: bytes = b"") -> tuple[EngineWorker, FakeOutbox, Held]:
    worker = EngineWorker(EngineWorkerConfig(engine="echo"))
    worker.engine, worker.outbox = engine, FakeOutbox()
    spec = m.JobSpec(job="j", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=4))
    prompt = m.Prompt("j", 7, bytes(4 * 5), max_tokens=4, sampling=sampling)
    work = m.WorkBatch("b", [prompt])
    held = Held(object(), prompt, m.JobLookup(spec), "b", work, 0)
    worker.feeder.inflight = 1  # as if the feeder had submitted it
    worker.feeder.held_tokens, worker.feeder.jobs["j"] = prompt.work_tokens, 1
    asyncio.run(worker.run_prompt(held))
    return worker, worker.outbox, held


@pytest.mark.parametrize("error", [
    RequestFailed("bad sampling parameters: temperature must be non-negative"),
    ValueError("prompt too long"),  # an error the adapter did not name, the engine alive
    RuntimeError("EngineGenerateError"),
])
def test_a_per_request_failure_is_one_error_row_and_no_rebuild(error):
    worker, outbox, _ = run_one(FakeEngine(error))
    assert worker.death is None, "no rebuild"
    assert len(outbox.rows) == 1 and outbox.rows[0].id == 7 and outbox.rows[0].error
    assert not worker.in_engine, "finished: not re-published"


def test_an_undecodable_sampling_field_is_an_error_row():
    worker, outbox, _ = run_one(FakeEngine(None), sampling=b"\xc1not msgpack")
    assert worker.death is None
    assert len(outbox.rows) == 1 and "bad sampling parameters" in outbox.rows[0].error


@pytest.mark.parametrize("engine", [FakeEngine(EngineDead("core gone")), FakeEngine(RuntimeError("handler died"), alive=False)])
def test_only_a_dead_engine_rebuilds_and_its_prompt_is_kept_for_isolation(engine):
    worker, outbox, held = run_one(engine)
    assert worker.death is not None, "rebuild"
    assert outbox.rows == [], "no error row"
    assert list(worker.in_engine.values()) == [held], "died in flight: `rebuild` re-publishes it as a suspect"


def test_vllm_exceptions_are_classified_by_type():
    """vLLM's own exception types (`vllm/v1/engine/exceptions.py`, `vllm/exceptions.py`)."""
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

    from prefixflow.services.engine_worker.engines.vllm import VllmEngine

    class Llm:
        errored = False

    engine = VllmEngine.__new__(VllmEngine)  # no engine started: only the classification
    engine.llm = Llm()
    assert isinstance(engine.failure(EngineDeadError()), EngineDead)
    try:
        raise EngineGenerateError() from ValueError("detokenizer failed")
    except EngineGenerateError as exc:
        failed = engine.failure(exc)
    assert isinstance(failed, RequestFailed) and "detokenizer failed" in str(failed)
    assert isinstance(engine.failure(VLLMValidationError("max_tokens too large")), RequestFailed)
    assert isinstance(engine.failure(ValueError("bad")), RequestFailed)
    Llm.errored = True  # the output handler died: every later request would fail
    assert isinstance(engine.failure(EngineGenerateError()), EngineDead)
