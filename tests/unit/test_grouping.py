"""Prefix-group priorities for vLLM's scheduler."""

from __future__ import annotations

import pytest

from prefixflow.services.engine_worker.grouping import GroupPriorities
from prefixflow.shared.prefix import tokens as tk

pytestmark = pytest.mark.unit


def prompt(group: int, tail: int, block: int = 4) -> bytes:
    return tk.pack([group] * block + [tail])


def test_groups_keep_the_rank_they_were_first_seen_with():
    g = GroupPriorities(block_size=4)
    a1, b1, a2, c1, b2 = (g.priority(p) for p in (prompt(1, 0), prompt(2, 0), prompt(1, 1), prompt(3, 0), prompt(2, 1)))
    assert a1 == a2 < b1 == b2 < c1  # group 1 first, then 2, then 3, whatever the arrival order


def test_prompts_shorter_than_a_block_group_by_whole_prompt():
    g = GroupPriorities(block_size=4)
    assert g.priority(tk.pack([7, 7])) == g.priority(tk.pack([7, 7]))
    assert g.priority(tk.pack([7, 8])) != g.priority(tk.pack([7, 7]))


def test_old_groups_are_renumbered_so_nothing_starves():
    g = GroupPriorities(block_size=4, max_age=10)
    first = g.priority(prompt(1, 0))
    for i in range(20):
        g.priority(prompt(100 + i, 0))
    again = g.priority(prompt(1, 1))
    assert again > first  # stale group: treated as new, behind the ones seen meanwhile


def test_group_table_is_bounded():
    g = GroupPriorities(block_size=4, max_groups=50)
    for i in range(500):
        g.priority(prompt(i, 0))
    assert len(g._rank) <= 50
