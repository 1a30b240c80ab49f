"""Paused jobs (prefixflow/services/sink/pause.py, the client's `JobPaused`): the reason names
the fault, the directory and its file system; the probe asks for more room than the write
that failed had; deliveries that were not a message's fault do not count toward poison;
the client gives up only on a pause that lasts; `status` shows `paused`."""

from __future__ import annotations

import asyncio
import errno
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.client.status import JobView
from prefixflow.client.submit import PAUSED_GRACE, JobPaused, PauseWatch
from prefixflow.services.sink import pause
from prefixflow.shared.bus.poison import POISON_AFTER, PRIOR_DELIVERIES
from prefixflow.shared.wire import messages as m
from tests.unit import fakes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_reason_says_what_where_and_how_much_room(tmp_path):
    out = tmp_path / "not" / "yet" / "there"
    why = pause.reason(OSError(errno.ENOSPC, "No space left on device"), out)
    assert why.startswith(f"no space left on the device at {out} (file system ")
    assert " free of " in why and why.endswith("[Errno 28] No space left on device")
    for code, what in ((errno.EDQUOT, "disk quota exceeded"), (errno.EROFS, "read-only file system"),
                       (errno.EACCES, "permission denied")):
        assert pause.reason(OSError(code, os.strerror(code)), tmp_path).startswith(f"{what} at {tmp_path}")


def test_the_probe_wants_the_room_asked_for_and_a_write(tmp_path, monkeypatch):
    pause.probe(tmp_path / "job" / "sub")  # the nearest existing ancestor takes a write
    assert list(tmp_path.iterdir()) == [], "the probe file is gone"
    with pytest.raises(OSError) as info:
        pause.probe(tmp_path, needed=1 << 62)
    assert info.value.errno == errno.ENOSPC and str(tmp_path) in str(info.value)
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(PermissionError):
            pause.probe(ro)


class Msg:
    def __init__(self, seq: int, delivered: int, prior: int = 0) -> None:
        self.metadata = fakes.meta(seq, delivered, "PFX_RESULTS")
        self.headers = {PRIOR_DELIVERIES: str(prior)} if prior else None


@given(own=st.integers(0, 10), excused=st.integers(0, 50), prior=st.integers(0, 10))
def test_only_a_messages_own_failures_count_toward_poison(own, excused, prior):
    excused_map = pause.Excused()
    msg = Msg(7, own + excused + 1, prior)  # this delivery, its own failures and excused ones
    for _ in range(excused):
        excused_map.add(msg)
    assert excused_map.own(msg) == own + prior + 1
    assert excused_map.is_poison(msg) == (own + prior + 1 > POISON_AFTER)
    assert not excused_map.is_poison(Msg(8, 1)), "another message's excuses are its own"


def test_the_client_gives_up_on_a_pause_that_lasts():
    watch = PauseWatch()
    paused = m.JobStatus("j", rows=3, total=9, paused="no space left on the device at /o", paused_path="/o")
    watch.observe("j", paused, 100.0)
    watch.observe("j", m.JobStatus("j", rows=4), 101.0)  # resumed: the clock starts again
    watch.observe("j", paused, 102.0)
    watch.observe("j", paused, 102.0 + PAUSED_GRACE - 0.1)
    with pytest.raises(JobPaused) as info:
        watch.observe("j", paused, 102.0 + PAUSED_GRACE)
    assert str(info.value) == "job j paused: no space left on the device at /o (3 rows written)"
    assert info.value.path == "/o"
    watch.observe("j", m.JobStatus("j", done=True, paused="stale"), 1e9)  # done wins


def test_status_shows_a_paused_job():
    view = JobView.of("j", m.JobStatus("j", rows=3, total=9, paused="read-only file system at /o", paused_path="/o"), None)
    assert (view.state, view.path, view.rows, view.error) == ("paused", "/o", 3, "paused: read-only file system at /o")
    assert JobView.of("j", m.JobStatus("j", rows=3, total=9), None).state == "running"


def test_a_status_from_an_older_sink_decodes_unpaused():
    old = b'{"job":"j","rows":2,"total":4}'
    status = m.job_status_decoder.decode(old)
    assert status.paused is None and status.paused_path is None
    assert b"paused" not in m.encode_json(status), "omitted while not paused: older clients read it as before"


def test_a_paused_job_resumes_once_its_probe_passes(tmp_path, monkeypatch):
    """`recheck` probes a paused job after `RECHECK` seconds: it stays paused while the
    probe fails and resumes (status cleared, parked results moved back) once it passes."""
    from tests.unit.test_writer import FakeJS, FakeKV

    async def where(job):
        return tmp_path

    moved = []
    pauses = pause.Pauses(where)
    pauses.connect(FakeJS(), FakeKV())

    async def unpark(job):
        moved.append(job)
        return 0

    async def no_parked():
        return []

    monkeypatch.setattr(pauses, "unpark", unpark)
    monkeypatch.setattr(pauses, "parked_jobs", no_parked)
    monkeypatch.setattr(pause, "RECHECK", 0.0)

    async def go() -> None:
        await pauses.pause("j", OSError(errno.ENOSPC, "No space left on device"), [])
        pauses.paused["j"].needed = 1 << 62
        await pauses.recheck()
        assert "j" in pauses and moved == []
        pauses.paused["j"].needed = 1
        await pauses.recheck()
        await asyncio.sleep(0)

    asyncio.run(go())
    assert "j" not in pauses and moved == ["j"]
    first, last = pauses.status_kv.puts[0], pauses.status_kv.puts[-1]
    assert first.paused.startswith(f"no space left on the device at {tmp_path}") and first.paused_path == str(tmp_path)
    assert last.paused is None and last.paused_path is None
