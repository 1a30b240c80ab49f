"""Pure helpers of `prefixflow bench`."""

from __future__ import annotations

from prefixflow.bench.methods import group_stats
from prefixflow.shared.wire import messages as m


def test_group_stats_counts_split_groups_and_prefix_misses():
    group_of = {1: 0, 2: 0, 3: 1, 4: 1, 5: 2}
    results = [
        m.Result(1, replica="r0", cached_tokens=0),
        m.Result(2, replica="r0", cached_tokens=256),
        m.Result(3, replica="r0", cached_tokens=0),
        m.Result(4, replica="r1", cached_tokens=128),  # group 1 split; a partial hit is a miss
        m.Result(5, replica="r1", error="too long"),  # error rows count for neither
    ]
    assert group_stats(results, group_of, 256) == (1, 3)
