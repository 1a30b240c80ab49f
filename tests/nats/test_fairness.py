"""Jobs sharing one cluster (issue #24), each through `prefixflow submit` as a user runs it,
on a slow echo engine (one replica, ~400 prompts/s), with the harness of `prefixflow bench
fairness`:

- a small job submitted while a large one runs finishes long before it (with one FIFO
  queue it waited for the large job's last row: 4.5x its time alone, none of the large
  job left), every row of both once;
- two jobs submitted together with priorities 1 and 3: while both run, the second writes
  about three times as many rows per second.
"""

from __future__ import annotations

import asyncio

import pyarrow.parquet as pq
import pytest

from bench import fairness
from tests.conftest import echo_cluster_at

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

SMALL, LARGE, PAIR = 200, 4000, 1500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    with echo_cluster_at(tmp_path_factory.mktemp("fair") / "cluster", tiny_model,
                         engine_args=("--echo-delay", "0.02", "--window", "8")) as c:
        yield c


def data(tmp_path, model, name: str, n: int, seed: int):
    return fairness.dataset(tmp_path / f"{name}.parquet", str(model), n, seed, prefix_len=64, suffix_len=32)


def test_a_small_job_is_not_queued_behind_a_large_one(cluster, tiny_model, tmp_path):
    small, large = data(tmp_path, tiny_model, "small", SMALL, 1), data(tmp_path, tiny_model, "large", LARGE, 2)
    r = asyncio.run(fairness.small_beside_large(cluster.url, small, large, tmp_path / "out", "t", 4, 0.1, LARGE))
    print(r)
    # Structure, not timing (the times and their ratio are `bench fairness`'s): with one FIFO
    # queue the small job waited for the large one's last row, leaving none of it.
    assert r["large_left_at_small_done"] >= 0.3, r
    for job, n in (("alone-t", SMALL), ("beside-t", SMALL), ("large-t", LARGE)):
        ids = pq.read_table(tmp_path / "out" / job).column("id").to_pylist()
        assert sorted(ids) == list(range(n)), job


MIN_TOGETHER = 3.0
"""Seconds both jobs must run at full speed for their rates to be compared: when one
submit starts late (its process slow to start on a busy machine), the other runs mostly
alone and the shared interval is too short to measure (seen once: 1.5 s, 390 and 202 rows);
the pair is then submitted again, at most twice more."""


def test_priorities_share_the_replicas_by_weight(cluster, tiny_model, tmp_path):
    a, b = data(tmp_path, tiny_model, "a", PAIR, 3), data(tmp_path, tiny_model, "b", PAIR, 4)
    tries = []
    for k in range(3):
        r = asyncio.run(fairness.weighted(cluster.url, a, b, tmp_path / "out", f"t{k}", 4, 3, PAIR))
        print(r)
        tries.append(r)
        for job in (f"w1-t{k}", f"w3-t{k}"):
            assert sorted(pq.read_table(tmp_path / "out" / job).column("id").to_pylist()) == list(range(PAIR))
        if r["seconds_together"] >= MIN_TOGETHER:
            break
    assert r["seconds_together"] >= MIN_TOGETHER, tries
    assert 2.0 <= r["rate_ratio"] <= 4.5, tries  # the weight, 3 (the benchmark measures it closely)
