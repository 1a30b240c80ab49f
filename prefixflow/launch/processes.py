"""The local process set, and how the machine's cores or GPUs are divided among the engine
replicas.

`processes()` is the single definition of the local process set (what `prefixflow run`
starts and supervises, `prefixflow/launch/local_cluster.py`); the Procfile spells the same set for a
2-core machine for honcho (a test keeps the two in step).
"""

from __future__ import annotations

import functools
import os
import re
import secrets
import shutil
import subprocess
from pathlib import Path
from dataclasses import dataclass, field


@dataclass
class Process:
    name: str
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def is_engine(self) -> bool:
        return self.args[:2] == ["serve", "engine-worker"]


@dataclass(frozen=True)
class Devices:
    """What the machine offers the engine replicas."""

    cores: tuple[int, ...]
    """CPU ids this process may run on (its affinity mask)."""
    gpus: tuple[str, ...] = ()
    """GPU indices as `nvidia-smi -L` lists them (none on a CPU machine)."""


def list_gpus() -> tuple[str, ...]:
    """GPU indices from `nvidia-smi -L` ("GPU 0: ..."); none without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return ()
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(g.group(1) for line in out.splitlines() if (g := re.match(r"\s*GPU (\d+):", line)))


@functools.cache
def machine_devices() -> Devices:
    """This machine's cores (the affinity mask, so a container's limit counts) and GPUs."""
    if hasattr(os, "sched_getaffinity"):
        cores = tuple(sorted(os.sched_getaffinity(0)))
    else:  # pragma: no cover - not Linux
        cores = tuple(range(os.cpu_count() or 1))
    return Devices(cores, list_gpus())


def id_list(ids: list[int] | tuple[int, ...]) -> str:
    """CPU ids as a list string with ranges: [0, 1, 2, 5] -> "0-2,5"."""
    parts: list[str] = []
    ids = sorted(ids)
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def assign_devices(replicas: int, devices: Devices, tensor_parallel_size: int = 1) -> list[dict[str, str]]:
    """Divide the machine among `replicas` engines: per replica, the environment that
    places it.

    - GPUs: each replica gets `tensor_parallel_size` devices of its own
      (`CUDA_VISIBLE_DEVICES`); too few GPUs is an error.
    - CPU: each replica gets its share of the cores as one contiguous run
      (`VLLM_CPU_OMP_THREADS_BIND`: 0-1 for one replica on 2 cores, 0 and 1 for two, 0-2 and
      3-5 for two on 6); with more replicas than cores they share cores round-robin.
    """
    if replicas < 1 or tensor_parallel_size < 1:
        raise ValueError("replicas and tensor_parallel_size must be at least 1")
    if devices.gpus:
        need = replicas * tensor_parallel_size
        if need > len(devices.gpus):
            raise ValueError(
                f"{replicas} replicas x tensor-parallel size {tensor_parallel_size} need {need} GPUs; "
                f"{len(devices.gpus)} found"
            )
        tp = tensor_parallel_size
        return [{"CUDA_VISIBLE_DEVICES": ",".join(devices.gpus[i * tp : (i + 1) * tp])} for i in range(replicas)]
    cores = devices.cores or (0,)
    n = len(cores)
    if replicas >= n:
        shares = [[cores[i % n]] for i in range(replicas)]
    else:
        shares = [list(cores[i * n // replicas : (i + 1) * n // replicas]) for i in range(replicas)]
    return [{"VLLM_CPU_OMP_THREADS_BIND": id_list(share)} for share in shares]


def describe_placement(env: dict[str, str]) -> str:
    """"cores 0-1", "GPUs 2,3" (for the start-up lines)."""
    if "CUDA_VISIBLE_DEVICES" in env:
        ids = env["CUDA_VISIBLE_DEVICES"]
        return f"GPU{'s' if ',' in ids else ''} {ids}"
    ids = env.get("VLLM_CPU_OMP_THREADS_BIND", "")
    return f"core{'s' if (',' in ids or '-' in ids) else ''} {ids}" if ids else "no placement"


CPU_ENGINE_NICE = 10
"""Niceness of CPU engines under `run`: their cores are shared with every other process."""


def processes(
    replicas: int = 2,
    *,
    engine: str = "vllm",
    kv_cache_space_gib: int | None = None,
    extra_engine_args: list[str] | None = None,
    tensor_parallel_size: int = 1,
    devices: Devices | None = None,
    stagger: float = 0.0,
) -> list[Process]:
    """nats-server, ingestor, one bucketer, router, `replicas` engine-workers, sink.
    The machine is divided among the engines (`assign_devices`): on CPU each gets its
    share of the cores and its own KV-cache budget (`kv_cache_space_gib`; default the
    environment's `VLLM_CPU_KVCACHE_SPACE`, vLLM's own setting, else 2 GiB), on GPUs its
    own devices. The bucketer, the router and the sink get a result key made for the set
    (`provenance.py`: each prompt's grant; the environment's `PFX_RESULT_KEY` if set); the
    engines are not given it."""
    devices = devices or machine_devices()
    placements = assign_devices(replicas, devices, tensor_parallel_size)
    keyed = {"PFX_RESULT_KEY": os.environ.get("PFX_RESULT_KEY") or secrets.token_hex(32)}
    procs = [
        Process("nats", ["serve", "nats"]),
        Process("ingestor", ["serve", "ingestor"]),
        Process("bucketer", ["serve", "bucketer", "--node", "node0"], dict(keyed)),
        Process("router", ["serve", "router"], dict(keyed)),
    ]
    for i, placement in enumerate(placements):
        env = dict(placement)
        if not devices.gpus:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_space_gib or os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 2)
            # The engines take every core: the services beside them (ingest, bucketing,
            # routing, the sink) would wait for CPU, and every job's latency with them.
            env["PFX_NICE"] = str(CPU_ENGINE_NICE)
        args = ["serve", "engine-worker", "--replica", f"r{i}", "--engine", engine, *(extra_engine_args or [])]
        if stagger and i:
            args += ["--start-delay", f"{i * stagger:g}"]
        procs.append(Process(f"engine{i}", args, env))
    procs.append(Process("sink", ["serve", "sink"], dict(keyed)))
    return procs


def another_bucketer(procs: list[Process], node: str, name: str = "") -> Process:
    """One more bucketer node for a process set from `processes()` (several nodes on one
    machine), with the set's result key: a bucketer without it sends unsigned prompts, and
    the sink refuses their results."""
    first = next(p for p in procs if p.args[:2] == ["serve", "bucketer"])
    return Process(name or f"bucketer-{node}", ["serve", "bucketer", "--node", node], dict(first.env))



RESULT_KEY_FILE = "result.key"


def keep_result_key(procs: list[Process], workdir: Path) -> None:
    """The set's result key lives in its working directory (mode 0600): a cluster started
    again on the same directory (`prefixflow run --workdir` of a job that was stopped)
    finds work and results in its JetStream store signed with it, so it takes the key it
    had instead of the new one `processes()` made (whose grants those would fail)."""
    keyed = [p for p in procs if "PFX_RESULT_KEY" in p.env]
    if not keyed:
        return
    path = workdir / RESULT_KEY_FILE
    if path.exists():
        key = path.read_text().strip()
    else:
        key = keyed[0].env["PFX_RESULT_KEY"]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
    for p in keyed:
        p.env["PFX_RESULT_KEY"] = key
