"""The Procfile (honcho, `make up`) and `prefixflow.launch.processes.processes()` (`prefixflow run`,
the tests) describe the same local cluster: same processes, arguments and environment; and
how `processes()` divides the machine among the engine replicas."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from prefixflow.launch import processes as cluster

PROCFILE = Path(__file__).resolve().parents[2] / "Procfile"


def procfile_entries() -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (environment assignments, arguments after `prefixflow`), with
    `${VAR:-default}` expanded to its default."""
    entries = {}
    for line in PROCFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, command = line.split(":", 1)
        command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command)
        words = shlex.split(command)
        env = {}
        while "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[0] == "prefixflow", line
        entries[name.strip()] = (env, words[1:])
    return entries


TWO_CORES = cluster.Devices(cores=(0, 1))
"""The machine the Procfile is written for (and this workplace's)."""


def test_procfile_matches_processes(monkeypatch):
    monkeypatch.setattr(cluster, "machine_devices", lambda: TWO_CORES)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the suite sets it (tests/conftest.py)
    entries = procfile_entries()
    procs = cluster.processes(2)
    # The local cluster's processes, then the batch API (a client of them: `make up` only).
    assert list(entries) == [p.name for p in procs] + ["api"]
    assert entries["api"] == ({}, ["serve", "api"])
    for p in procs:
        env, args = entries[p.name]
        assert args == p.args, p.name
        # The result key is made per process set (`run`); under honcho it comes from .env.
        assert env == {k: v for k, v in p.env.items() if k != "PFX_RESULT_KEY"}, p.name
    keyed = {p.name for p in procs if "PFX_RESULT_KEY" in p.env}
    assert keyed == {"bucketer", "router", "sink"}, "the engines never get the key"
    assert len({p.env["PFX_RESULT_KEY"] for p in procs if p.name in keyed}) == 1


def bind(envs: list[dict[str, str]]) -> list[str]:
    return [e["VLLM_CPU_OMP_THREADS_BIND"] for e in envs]


@pytest.mark.parametrize(
    "replicas, cores, expected",
    [
        (1, (0, 1), ["0-1"]),  # one replica gets the whole 2-core machine
        (2, (0, 1), ["0", "1"]),
        (3, (0, 1), ["0", "1", "0"]),  # more replicas than cores: round-robin
        (2, tuple(range(8)), ["0-3", "4-7"]),
        (3, tuple(range(8)), ["0-1", "2-4", "5-7"]),  # contiguous, sizes differ by at most one
        (1, (2, 3, 6, 7), ["2-3,6-7"]),  # an affinity mask with holes
        (2, (2, 3, 6, 7), ["2-3", "6-7"]),
    ],
)
def test_cpu_replicas_share_the_cores(replicas, cores, expected):
    assert bind(cluster.assign_devices(replicas, cluster.Devices(cores))) == expected


def test_every_core_used_and_shares_balanced():
    for n in range(1, 17):
        for replicas in range(1, 20):
            shares = bind(cluster.assign_devices(replicas, cluster.Devices(tuple(range(n)))))
            used = [set(_ids(s)) for s in shares]
            assert set().union(*used) == set(range(n)), (n, replicas)
            sizes = [len(u) for u in used]
            assert max(sizes) - min(sizes) <= 1
            if replicas <= n:
                assert sum(sizes) == n, "no core shared while there are enough"


def _ids(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def test_gpu_replicas_get_tensor_parallel_devices():
    gpus = cluster.Devices(cores=(0, 1), gpus=("0", "1", "2", "3"))
    assert cluster.assign_devices(2, gpus, 2) == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert cluster.assign_devices(3, gpus) == [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(3)]
    with pytest.raises(ValueError, match="need 6 GPUs; 4 found"):
        cluster.assign_devices(3, gpus, 2)
    procs = cluster.processes(2, tensor_parallel_size=2, devices=gpus)
    engines = [p for p in procs if p.is_engine]
    assert [p.env for p in engines] == [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert cluster.describe_placement(engines[0].env) == "GPUs 0,1"


def test_one_replica_gets_both_cores_of_this_machine(monkeypatch):
    monkeypatch.setattr(cluster, "machine_devices", lambda: TWO_CORES)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    (engine,) = [p for p in cluster.processes(1) if p.is_engine]
    assert engine.env == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "2", "PFX_NICE": "10"}
    assert cluster.describe_placement(engine.env) == "cores 0-1"


def test_the_kv_cache_budget_follows_vllms_own_setting(monkeypatch):
    monkeypatch.setattr(cluster, "machine_devices", lambda: TWO_CORES)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert {p.env["VLLM_CPU_KVCACHE_SPACE"] for p in cluster.processes(2) if p.is_engine} == {"1"}
    assert {p.env["VLLM_CPU_KVCACHE_SPACE"] for p in cluster.processes(2, kv_cache_space_gib=3) if p.is_engine} == {"3"}


def test_gpus_listed_by_nvidia_smi(monkeypatch, tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA A100 (UUID: GPU-1)'\necho 'GPU 1: NVIDIA A100 (UUID: GPU-2)'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert cluster.list_gpus() == ("0", "1")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert cluster.list_gpus() == ()
