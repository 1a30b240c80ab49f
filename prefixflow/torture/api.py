"""The OpenAI batch API the torture harness drives (`prefixflow serve api` as a
subprocess, against the harness's cluster), and its restart: the `api_restart` fault
stops it (SIGTERM, as systemd does, or SIGKILL, a crash) and starts it again after a
pause; at its start it resumes every batch not final (`prefixflow/batchapi/runner.py`)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

from prefixflow.launch.local_cluster import free_port, prefixflow_argv

TENANT, KEY = "torture", "torture-key"
SERVED_NAME = "torture-model"
"""The model name the batches' requests give (served beside the model's path)."""
READY_WAIT = 60.0
"""Seconds the API has to log its ready line."""
STOP_WAIT = 20.0


class ApiProcess:
    """`prefixflow serve api` on a free port, its log appended to `log_path`."""

    def __init__(self, url: str, log_path: Path, env: dict[str, str]) -> None:
        self.url, self.log_path = url, log_path
        self.port = free_port()
        self.env = {**os.environ, **env, "PFX_NATS_URL": url, "PFX_API_KEYS": f"{TENANT}:{KEY}",
                    "PFX_PORT": str(self.port), "PFX_LOG_FORMAT": "json", "PFX_SERVED_NAMES": SERVED_NAME}
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.alive() else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    async def start(self) -> None:
        """Start it and wait for its ready line (RuntimeError: it exited or never got ready)."""
        seen = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen([*prefixflow_argv(), "serve", "api"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        self.starts += 1
        deadline = time.monotonic() + READY_WAIT
        while b'"api ready"' not in self.log_path.read_bytes()[seen:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_path.read_bytes()[seen:][-1500:].decode(errors="replace")
                raise RuntimeError(f"the batch API did not start (exit {self.proc.poll()}): {tail}")
            await asyncio.sleep(0.1)

    async def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), STOP_WAIT)
            except asyncio.TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)

    async def restart(self, sig: int, down: float) -> str:
        """Stop it with `sig`, `down` seconds with no API, start it again: what was done."""
        pid = self.pid
        await self.stop(sig)
        await asyncio.sleep(down)
        await self.start()
        return f"pid {pid} -> {self.pid}"

    async def unanswered(self) -> str | None:
        """None if it runs and answers a list of batches, else why not."""
        if not self.alive():
            return f"the batch API exited ({self.proc.poll() if self.proc else None}): see {self.log_path}"
        client = self.client()
        try:
            await client.batches.list(limit=1)
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding, named
            return f"the batch API does not answer: {type(exc).__name__}: {exc}"
        finally:
            await client.close()
        return None

    def client(self):
        from openai import AsyncOpenAI

        return AsyncOpenAI(api_key=KEY, base_url=self.base_url, max_retries=0, timeout=30.0)
