"""Prefix-group priorities for the engine's scheduler: pure logic, no I/O.

vLLM admits waiting requests in order (FCFS) as long as KV blocks are free, evicting
cached prefix blocks of groups that are not running. With many prefixes interleaved in
its queue, a small KV cache thrashes: each group's prefix is recomputed again and again.
Giving every prompt the priority of its prefix group (groups in the order first seen)
makes vLLM run a group's prompts together, so few prefixes are live at once and each is
computed about once. A group first seen more than `max_age` prompts ago is renumbered as
new, so a group that keeps receiving prompts cannot starve the others.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixflow.shared.prefix.block_keys import first_block_key


class GroupPriorities:
    def __init__(self, block_size: int, max_age: int = 4096, max_groups: int = 65536) -> None:
        self.block_size = block_size
        self.max_age = max_age
        self.max_groups = max_groups
        self._rank: OrderedDict[int, int] = OrderedDict()
        self._submitted = 0

    def group(self, tokens: bytes) -> int:
        """A prompt's group: the hash of its first KV block (whole prompt if shorter)."""
        return first_block_key(tokens, self.block_size)

    def priority(self, tokens: bytes) -> int:
        """Lower runs first. Stable for a group while it is young."""
        self._submitted += 1
        g = self.group(tokens)
        rank = self._rank.get(g)
        if rank is None or self._submitted - rank > self.max_age:
            rank = self._submitted
            self._rank.pop(g, None)
            self._rank[g] = rank
            if len(self._rank) > self.max_groups:
                self._rank.popitem(last=False)
        return rank
