"""An idle cluster costs little: its bucketer looks at the streams (two stream-info
requests a look) every `QUIET_SCAN_EVERY` while it has nothing here, upstream, held or
buffered, and every `SCAN_EVERY` again once a job's prompts arrive. Counted on the wire:
a core subscription on the JetStream API subjects sees every request the services send."""

from __future__ import annotations

import asyncio
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.services.bucketer.service import QUIET_SCAN_EVERY, SCAN_EVERY
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import subjects
from tests.conftest import SLOW_ECHO, VENV_BIN

pytestmark = pytest.mark.nats

LOOK = (subjects.BUCKET_STREAM.name, subjects.INGEST_STREAM.name)


class Looks:
    """Stream-info requests for the streams a bucketer looks at, with their times."""

    def __init__(self) -> None:
        self.at: list[float] = []

    async def start(self, url: str) -> None:
        self.nc = await connect(url, "looks-spy")

        async def on_request(msg) -> None:
            if msg.subject.rsplit(".", 1)[-1] in LOOK:
                self.at.append(time.monotonic())

        await self.nc.subscribe("$JS.API.STREAM.INFO.*", cb=on_request)
        await self.nc.flush()

    def rate(self, t0: float, t1: float) -> float:
        return sum(t0 <= t < t1 for t in self.at) / (t1 - t0)


def test_an_idle_bucketer_looks_less_often_and_a_job_wakes_it(clusters, tmp_path):
    cluster = clusters.get(engine_args=SLOW_ECHO)  # one replica at ~400 prompts/s: the job lasts seconds
    data = tmp_path / "rows.parquet"
    n = 2000
    pq.write_table(pa.table({"id": list(range(n)), "prompt": [f"shared preamble {i % 7} question {i}" for i in range(n)]}),
                   data)
    looks = Looks()

    async def watch() -> tuple[float, float, float]:
        await looks.start(cluster.url)
        t0 = time.monotonic()
        await asyncio.sleep(4.0)  # idle
        t1 = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(tmp_path / "out"), "--nats", cluster.url,
            "--max-tokens", "4", "--no-progress", "--timeout", "120")
        assert await proc.wait() == 0
        t2 = time.monotonic()
        await close(looks.nc)
        return t0, t1, t2

    t0, t1, t2 = asyncio.run(watch())
    idle, busy = looks.rate(t0, t1), looks.rate(t1 + 0.5, t2)
    print(f"\nstream looks a second: idle {idle:.1f}, during a {t2 - t1:.1f} s job {busy:.1f}")
    quiet_rate = len(LOOK) / QUIET_SCAN_EVERY  # 4 a second
    # 4.5-5 a second measured (the ingestor's mover also looks at the bucket stream),
    # 20.5 before the quiet interval: the bound keeps room for the other service.
    assert 0 < idle <= quiet_rate * 2, idle
    # Back to looking every SCAN_EVERY while the job runs (14/s measured against 20 at most;
    # a loaded machine only slows the loop, so the bound is the quiet rate, not the busy one).
    assert quiet_rate < busy <= len(LOOK) / SCAN_EVERY * 1.5, busy
    assert pq.read_table(tmp_path / "out", columns=["id"]).num_rows == n
