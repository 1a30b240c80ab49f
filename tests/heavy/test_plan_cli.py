"""`prefixflow plan` on a small generated dataset (`prefixflow dataset seed`), as a user
runs it: the JSON's structure and its sanity invariants, the table, and a bad fleet's
usage error (docs/plan.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.heavy

FLEETS = ("16xL4", "4xH100")


def plan(*args: str, env: dict[str, str], cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixflow.cli.main", "plan", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, tiny_model):
    d = tmp_path_factory.mktemp("plan")
    env = {**os.environ, "PFX_MODEL": str(tiny_model)}
    path = d / "seed.parquet"
    subprocess.run([sys.executable, "-m", "prefixflow.cli.main", "dataset", "seed", "--num-prompts", "400",
                    "--num-prefixes", "16", "--output-len", "32", "--model", str(tiny_model), "--out", str(path)],
                   check=True, capture_output=True, env=env, cwd=d, timeout=300)
    return path, env


def test_plan_predicts_every_fleet_and_method_within_the_limit(dataset):
    path, env = dataset
    fleet_args = [a for f in FLEETS for a in ("--fleet", f)]
    r = plan(str(path), *fleet_args, "--price", "0.80/h", "--sample-rows", "250", "--json", env=env, cwd=path.parent)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["rows"] == 400 and report["sampled_rows"] == 250 and report["error_rows_in_sample"] == 0
    assert report["output_tokens_per_row"] == 32
    assert [f["fleet"] for f in report["fleets"]] == list(FLEETS)
    for f, gpus in zip(report["fleets"], (16, 4)):
        by = {m["method"]: m for m in f["methods"]}
        assert set(by) == {"prefix-aware", "sorted", "naive"}
        assert f["sample_rows"] <= 250 and 1 <= f["sample_replicas"] < gpus  # sampled, the fleet cut with it
        assert "uniform sample" in f["sample"]
        # prefix-aware no slower than naive (1 %: on one sampled replica both keep every prefix cached)
        assert by["prefix-aware"]["wall_seconds"] <= by["naive"]["wall_seconds"] * 1.01
        limit = f["limit"]
        for m in by.values():
            assert m["wall_seconds"] > 0
            assert m["gpu_hours"] == pytest.approx(m["wall_seconds"] * gpus / 3600, rel=1e-3, abs=1e-4)
            assert m["cost"] == pytest.approx(m["gpu_hours"] * 0.80, rel=1e-3, abs=1e-4)
            # <= up to the rows' rounding (2 decimals): on one sampled replica a method can meet the limit
            assert limit["wall_seconds"] <= m["wall_seconds"] + 0.01
            assert 0 <= m["hit_rate"] <= limit["ideal_hit_rate"] + 1e-9
        assert limit["cost"] == pytest.approx(limit["gpu_hours"] * 0.80, rel=1e-3, abs=1e-4)
        # 16 prefixes of 256 tokens over 400 rows of 512: the ideal is near half the prompt
        assert 0.35 < limit["ideal_hit_rate"] < 0.5


def test_plan_prints_a_table_and_refuses_an_unknown_gpu(dataset):
    path, env = dataset
    r = plan(str(path), "--fleet", "2xCPU", env=env, cwd=path.parent)
    assert r.returncode == 0, r.stderr
    for word in ("2xCPU", "prefix-aware", "sorted", "naive", "limit", "GPU-hours", "every row (400)"):
        assert word in r.stdout, (word, r.stdout)
    bad = plan(str(path), "--fleet", "8xA100", env=env, cwd=path.parent)
    assert bad.returncode == 2
    assert "A100" in bad.stderr and "L4" in bad.stderr and "H100" in bad.stderr
    scenario = plan(str(path), "--fleet", "16xL4", "--kv-cache-dtype", "fp8", "--gpu-memory-utilization", "0.95",
                    "--sample-rows", "250", "--json", env=env, cwd=path.parent)
    assert scenario.returncode == 0, scenario.stderr
    assert json.loads(scenario.stdout)["fleets"][0]["profile"] == "l4-8b-fp8kv-util0.95", "every method under it"
    cpu = plan(str(path), "--fleet", "2xCPU", "--kv-cache-dtype", "fp8", env=env, cwd=path.parent)
    assert cpu.returncode == 2 and "no GPU memory figures" in cpu.stderr, cpu.stderr
