"""Every replica's history of routed prefix keys, indexed by prefix (the router's
history-based cache model; `fleet.Fleet` keeps it in step with the histories). Pure logic."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

Replica = Hashable
"""A replica as the index keys it: any identity (`fleet.Replica` objects, by identity)."""

Key = tuple[int, ...]
Match = tuple[int, int]
NO_MATCH: Match = (0, 0)


class _Prefix:
    """A node of `PrefixIndex`: one block-aligned prefix and the replicas holding it."""

    __slots__ = ("holders",)

    def __init__(self) -> None:
        self.holders: dict[Replica, list[int]] = {}
        """Replica -> [its history entries through this prefix, the latest one's clock]."""


class PrefixIndex:
    """Every replica's history indexed by prefix, so a match costs one dict lookup per
    block of the key (like vLLM's `find_longest_cache_hit`: stop at the first miss)
    instead of a comparison with every history entry of every replica.

    A prefix is identified by (its parent prefix, its last block hash). Keys built by
    `block_hashes` are hash chains, where the last hash alone would identify the prefix;
    interning the parent keeps the index exact for any keys (the tests use tiny
    alphabets) at the same cost of one lookup per block.

    Holding is prefix-closed (an entry through a prefix passes through all its
    ancestors), so a replica's match length for a key is the depth of the deepest prefix
    on the key's path that it holds, and the walk ends at the first prefix nobody holds.
    Each holder keeps the clock of its latest entry through the prefix: eviction is FIFO
    per replica, so that entry is the last of them to leave and the clock stays exact.
    """

    def __init__(self) -> None:
        self._prefixes: dict[tuple[_Prefix | None, int], _Prefix] = {}

    def __len__(self) -> int:
        """Prefixes held by at least one replica."""
        return len(self._prefixes)

    def add(self, r: Replica, key: Key, stamp: int) -> None:
        parent = None
        for block in key:
            node = self._prefixes.get((parent, block))
            if node is None:
                node = self._prefixes[parent, block] = _Prefix()
            held = node.holders.get(r)
            if held is None:
                node.holders[r] = [1, stamp]
            else:
                held[0] += 1
                held[1] = stamp
            parent = node

    def remove(self, r: Replica, key: Key) -> None:
        """Drop one of r's entries for `key` (its oldest: history leaves in FIFO order)."""
        parent = None
        for block in key:
            node = self._prefixes[parent, block]
            held = node.holders[r]
            held[0] -= 1
            if not held[0]:
                del node.holders[r]
                if not node.holders:  # nobody holds it, hence none of its descendants
                    del self._prefixes[parent, block]
            parent = node

    def path(self, key: Sequence[int]) -> list[_Prefix]:
        """The key's prefixes that some replica holds, shortest first."""
        out: list[_Prefix] = []
        node = None
        for block in key:
            node = self._prefixes.get((node, block))
            if node is None:
                break
            out.append(node)
        return out

    def matches(self, key: Sequence[int]) -> dict[Replica, Match]:
        """The best history match of every replica that matches `key` by at least one
        block: its length and the clock of the latest entry matching that far. Costs
        one lookup per matched block plus the holders of those prefixes."""
        found: dict[Replica, Match] = {}
        for depth, node in enumerate(self.path(key), 1):
            for r, held in node.holders.items():
                found[r] = (depth, held[1])  # deeper prefixes overwrite shallower ones
        return found

    def best_match(self, r: Replica, key: Sequence[int]) -> Match:
        """r's best history match for `key`; NO_MATCH if none."""
        best = NO_MATCH
        for depth, node in enumerate(self.path(key), 1):
            held = node.holders.get(r)
            if held is None:
                break
            best = (depth, held[1])
        return best
