"""Placement and timing of the vLLM engines that Daft's `vllm-prefix-caching` provider builds.

Daft (daft/execution/vllm.py) builds one `LocalVLLMExecutor` per engine: in the query's own
process on the native runner, in `concurrency` identical Ray actors on Ray. Its options place
those actors by GPU count only, so on a CPU machine every engine would bind its OpenMP threads
to the same cores. `setup` wraps `LocalVLLMExecutor.__init__`, in every process that may build
one (called directly on the native runner, as Ray's `worker_process_setup_hook` on Ray), to:

1. claim one core set from `PFX_PEER_CORES` ("0|1": one set per engine) with an exclusive file
   lock held for the life of the process, and pin the engine to it (`VLLM_CPU_OMP_THREADS_BIND`,
   the way `prefixflow run` places its replicas);
2. record when the engine started and when it was ready (one JSON line per engine in
   `$PFX_PEER_RUN_DIR/engines.jsonl`): the runner's "time without start-up" counts from the
   moment the last engine was ready.

Nothing else of Daft's is changed: its bucketing, routing and request submission run as shipped.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import time
from pathlib import Path
from typing import Any

RUN_DIR = "PFX_PEER_RUN_DIR"
CORES = "PFX_PEER_CORES"
RECORDS = "engines.jsonl"

_held: list[int] = []
"""File descriptors of the claimed core locks: kept open (locked) until the process exits."""


def claim(run_dir: Path, core_sets: list[str]) -> str:
    """The first core set no other live process holds; raises when all are taken."""
    for k, cores in enumerate(core_sets):
        fd = os.open(run_dir / f"cores-{k}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        _held.append(fd)
        return cores
    raise RuntimeError(f"more vLLM engines than core sets {core_sets}")


def setup() -> None:
    """Wrap Daft's `LocalVLLMExecutor.__init__` (once per process); a no-op outside a peer run."""
    run_dir = os.environ.get(RUN_DIR)
    if not run_dir:
        return
    from daft.execution import vllm as daft_vllm

    original = daft_vllm.LocalVLLMExecutor.__init__
    if getattr(original, "__pfx_wrapped__", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        cores = claim(Path(run_dir), os.environ[CORES].split("|"))
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores  # read by vLLM when its engine core starts
        started = time.time()
        original(self, *args, **kwargs)
        record = {"pid": os.getpid(), "cores": cores, "started": started, "ready": time.time()}
        with open(Path(run_dir) / RECORDS, "a") as f:  # one short append per engine: atomic
            f.write(json.dumps(record) + "\n")

    __init__.__pfx_wrapped__ = True  # type: ignore[attr-defined]
    daft_vllm.LocalVLLMExecutor.__init__ = __init__


def records(run_dir: str | Path) -> list[dict[str, Any]]:
    """The engines built during the run, in the order they became ready."""
    path = Path(run_dir) / RECORDS
    if not path.exists():
        return []
    return sorted((json.loads(line) for line in path.read_text().splitlines() if line), key=lambda r: r["ready"])
