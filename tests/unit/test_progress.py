"""The progress line's view of the replicas (`prefixflow/client/progress.py`)."""

from __future__ import annotations

import pytest

from prefixflow.client.progress import RATE_SPAN, FleetProgress, progress_note
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


def status(replica: str, generated: int, jobs: dict[str, int]) -> m.EngineStatus:
    return m.EngineStatus(replica, 0.0, ready=True, generated_tokens=generated, jobs=jobs)


def test_prompts_under_way_and_the_generation_rate():
    f = FleetProgress()
    f.update(status("r0", 0, {"a": 3}), now=0.0)
    f.update(status("r1", 0, {"a": 2, "b": 7}), now=0.0)
    assert f.held("a") == 5 and f.held("b") == 7 and f.held("c") == 0
    assert f.tokens_per_second() == 0.0
    f.update(status("r0", 300, {"a": 3}), now=1.0)
    f.update(status("r1", 100, {"a": 1}), now=2.0)
    assert f.held("a") == 4 and f.held("b") == 0  # the latest status of each replica counts
    assert f.tokens_per_second() == pytest.approx(400 / 2.0)


def test_the_rate_covers_the_last_span_only_and_never_goes_negative():
    f = FleetProgress()
    for t in range(0, 100):
        f.update(status("r0", 1000 * t if t < 50 else 0, {}), now=float(t))  # restarted at t=50
        assert f.tokens_per_second() >= 0
        assert f.samples[-1][0] - f.samples[0][0] <= RATE_SPAN + 1
    f.update(status("r0", 500, {}), now=100.0)
    assert f.tokens_per_second() == pytest.approx(500 / (100.0 - f.samples[0][0]))


def test_the_note_shows_work_before_rows_and_the_sink_numbers_after():
    f = FleetProgress()
    assert progress_note(None, f, "a") == ""
    f.update(status("r0", 0, {"a": 2}), now=0.0)
    assert progress_note(None, f, "a").startswith("2 generating, 0 tok/s")
    st = m.JobStatus("a", rows=10, total=20, rate=2.0, prompt_tokens=100, cached_tokens=50)
    note = progress_note(st, f, "a")
    assert "2 generating" in note and "2.0 rows/s" in note and "hit rate 50.0%" in note and "ETA 0:05" in note
