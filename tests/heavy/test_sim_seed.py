"""The reference table, reproduced on a reduced but proportionate configuration.

The full reproduction (`prefixflow simulate --shape seed --replicas 128`: 200k prompts on
128 simulated L4s, the reference's 8 bucketing streams) takes minutes; this test scales
it down 8x and keeps what decides each row:
- per replica: 1562 prompts drawn from 512 prefixes, so a replica meets a prefix about
  3 times in random order (what naive and continuous get from the cache); 256 + 256
  prompt tokens, 128 output tokens, the L4's KV cache;
- per bucketer: 16 replicas and 25k prompts per bucketer, the bucketer's 5000-prompt
  buffer (20 % of its stream); prefix groups are 8x smaller (49 prompts, not 390), so the
  bucket size thresholds are too (min_bucket 16 -> 2, pool 64 -> 8);
- the global sort's overhead as at full scale (it sorts the reference's 200k rows);
- scaling: 4 / 8 / 16 replicas stand for 32 / 64 / 128 GPUs (the same work per GPU).
It checks the issue's tolerances: hit rates within 5 points, the method ordering,
bucketing's speed-up over naive within 15 % of 2.03x, scaling efficiency within 0.05.
"""

from __future__ import annotations

import msgspec
import pytest

from prefixflow.shared.process.config import BucketerConfig
from prefixflow.sim import seed
from prefixflow.sim.cluster import Options
from prefixflow.sim.cost import load_profile
from prefixflow.sim.runner import run_many
from prefixflow.sim.workload import SEED, prefix_repetition

pytestmark = pytest.mark.heavy

REPLICAS = 16
SCALE_REPLICAS = {32: 4, 64: 8, 128: 16}


@pytest.fixture(scope="module")
def table():
    wl = prefix_repetition(num_prompts=1562 * REPLICAS, prefix_len=256, suffix_len=256, num_prefixes=512, output_len=128, seed=0)
    wl.name = "seed-reduced"
    profile = load_profile("l4-8b")
    profile.sort_s_per_1k *= SEED["num_prompts"] / len(wl)  # the full-scale sort's overhead
    opts = Options(nodes=1, bucketer=msgspec.structs.replace(BucketerConfig(), min_bucket=2, pool_size=8))
    jobs = [(wl, m, REPLICAS, profile, opts) for m in seed.ORDER]
    jobs += [(wl, "daft", n, profile, opts) for n in (SCALE_REPLICAS[32], SCALE_REPLICAS[64])]
    rows = run_many(jobs, 2)
    by_method = {r["method"]: r for r in rows[: len(seed.ORDER)]}
    walls = {32: rows[-2]["wall_seconds"], 64: rows[-1]["wall_seconds"], 128: by_method["daft"]["wall_seconds"]}
    return by_method, seed.efficiency(walls)


def checks(table) -> dict[str, tuple[bool, str]]:
    rows, eff = table
    return {c: (ok, d) for c, ok, d in seed.check(rows, eff)}


def test_hit_rates_within_5_points(table):
    got = {c: v for c, v in checks(table).items() if c.startswith("hit rate")}
    assert len(got) == 4
    assert all(ok for ok, _ in got.values()), got


@pytest.mark.parametrize("what", ["method ordering", "bucketing speed-up over naive",
                                  "scaling efficiency at 64", "scaling efficiency at 128"])
def test_ordering_speedup_and_scaling(table, what):
    ok, detail = checks(table)[what]
    assert ok, detail


def test_true_hit_rate_cannot_reach_the_published_sorted_figure(table):
    """Cached / prompt tokens is at most (N - groups) x 256 / (N x 512) < 50 %: the
    published 54.5 % must be vLLM's counters (retries and recomputation included)."""
    rows, _ = table
    assert rows["sorted"]["hit_rate"] < 0.5 < seed.PUBLISHED["sorted"][1]
    assert rows["sorted"]["logged_hit_rate"] > 0.5
