"""What `bench soak` and `bench s3` watch while a `prefixflow run` goes: each process's
memory (`Sampler`) and the job's rows (`Progress`)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from prefixflow.bench.pipeline import peak_rss_mib

MIB = 2**20


class Sampler:
    """RSS of `run` (itself only: its children are the cluster) and of each process in
    `pids.json` (with its children, e.g. vLLM's engine core)."""

    def __init__(self, run_pid: int, workdir: Path) -> None:
        self.run_pid, self.pids_file = run_pid, workdir / "pids.json"
        self.handles: dict[int, Any] = {}
        self.url: str | None = None
        self.restarts: dict[str, int] = {}
        self.procs: dict[str, dict[str, Any]] = {}

    def _proc(self, pid: int):
        import psutil

        if pid not in self.handles:
            self.handles[pid] = psutil.Process(pid)
        return self.handles[pid]

    def names(self) -> dict[str, tuple[int, bool]]:
        found = {"run": (self.run_pid, False)}
        try:
            doc = json.loads(self.pids_file.read_text())
        except (OSError, ValueError):
            return found
        self.url = doc.get("url", self.url)
        for name, p in doc.get("processes", {}).items():
            self.restarts[name] = p.get("restarts", 0)
            if p.get("pid"):
                found[name] = (p["pid"], True)
        return found

    def sample(self) -> dict[str, float]:
        import psutil

        reading: dict[str, float] = {}
        for name, (pid, children) in self.names().items():
            try:
                proc = self._proc(pid)
                with proc.oneshot():
                    if proc.status() == psutil.STATUS_ZOMBIE:
                        continue  # exited, not yet reaped: no reading
                    rss, cpu = proc.memory_info().rss, sum(proc.cpu_times()[:2])
                for child in proc.children(recursive=True) if children else ():
                    try:
                        rss += child.memory_info().rss
                    except psutil.Error:
                        pass
            except psutil.Error:
                continue
            mib = round(rss / MIB, 1)
            reading[name] = mib
            p = self.procs.setdefault(name, {"pid": pid, "peak_rss_mib": 0.0, "rss_mib_at": {}})
            p.update(pid=pid, last_rss_mib=mib, cpu_seconds=round(cpu, 1), peak_rss_mib=max(p["peak_rss_mib"], mib))
            hwm = peak_rss_mib(pid)  # the kernel's VmHWM of the process itself: catches peaks between samples
            if hwm is not None:
                p["own_vm_hwm_mib"] = hwm
        return reading


class Progress:
    """Rows written: the job's status from the `PFX_JOB_STATUS` KV bucket, else the row
    counts in the output's part footers."""

    def __init__(self, job: str, out: Path | None) -> None:
        """`out`: a local output whose footers count rows when the status cannot (None:
        the status only)."""
        self.job, self.out = job, out
        self.nc = self.kv = None
        self.footers: dict[str, int] = {}
        self.status: dict[str, Any] = {}

    async def rows(self, url: str | None) -> tuple[int, bool]:
        if url and self.kv is None:
            try:
                import nats

                async def quiet(*_a) -> None:  # the cluster stops under us: no tracebacks
                    return None

                self.nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=3, reconnect_time_wait=0.5,
                                             name="prefixflow-bench-soak", error_cb=quiet, disconnected_cb=quiet)
                self.kv = await self.nc.jetstream().key_value("PFX_JOB_STATUS")
            except Exception:  # noqa: BLE001 - not up yet, or an older cluster: count footers
                await self.close()
        if self.kv is not None:
            try:
                self.status = json.loads((await asyncio.wait_for(self.kv.get(self.job), 2)).value)
                return int(self.status.get("rows", 0)), bool(self.status.get("done"))
            except Exception:  # noqa: BLE001 - no status yet, or the cluster is stopping
                pass
        return self.count_footers(), False

    def count_footers(self) -> int:
        import pyarrow.parquet as pq

        if self.out is None:
            return 0
        for p in self.out.glob("part-*.parquet"):
            if p.name not in self.footers:
                try:
                    self.footers[p.name] = pq.read_metadata(p).num_rows
                except (OSError, ValueError):
                    pass
        return sum(self.footers.values())

    async def close(self) -> None:
        nc, self.nc, self.kv = self.nc, None, None
        if nc is not None:
            try:
                await asyncio.wait_for(nc.close(), 3)
            except Exception:  # noqa: BLE001
                pass
