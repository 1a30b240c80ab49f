"""Which bucketer node gets a prompt: rendezvous hashing with bounded loads.

Prompts whose first KV block is the same rank the nodes identically, so they meet in one
node's buffer and can be bucketed together; adding or removing a node moves only that
node's share. Bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent hashing with
bounded loads"): a node already holding more than (1 + epsilon) x the average recent load
is skipped for the next in that prompt's ranking, so one dominant prefix cannot swamp a
node; only its overflow moves. The bound is max((1 + epsilon) x average, average +
`min_slack`): with few prompts seen, random placement alone would otherwise trip it and
split prefixes for nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _score(node: str, key: int) -> int:
    h = hashlib.blake2b(node.encode(), digest_size=8)
    h.update(key.to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little")


def ranking(key: int, nodes: Sequence[str]) -> list[str]:
    """Nodes in rendezvous order for `key` (best first)."""
    return sorted(nodes, key=lambda n: _score(n, key), reverse=True)


def pick_node(key: int, nodes: Sequence[str]) -> str:
    """Plain rendezvous choice (no load bound)."""
    return max(nodes, key=lambda n: _score(n, key))


class Sharder:
    def __init__(self, epsilon: float = 0.25, decay_every: int = 4096, min_slack: float = 64.0) -> None:
        self.epsilon = epsilon
        self.min_slack = min_slack
        self.decay_every = decay_every
        """Every this many assignments, recent loads are halved (loads track the recent
        stream, not all history)."""
        self.load: dict[str, float] = {}
        self._since_decay = 0

    def bound(self, nodes: Sequence[str], weight: float) -> float:
        average = (sum(self.load.get(n, 0.0) for n in nodes) + weight) / len(nodes)
        return max((1 + self.epsilon) * average, average + self.min_slack)

    def pick(self, key: int, nodes: Sequence[str], weight: float = 1.0) -> str:
        ranked = ranking(key, nodes)
        limit = self.bound(nodes, weight)
        fallback = min(ranked, key=lambda n: self.load.get(n, 0.0))  # nowhere has room: least loaded
        node = next((n for n in ranked if self.load.get(n, 0.0) + weight <= limit), fallback)
        self.load[node] = self.load.get(node, 0.0) + weight
        self._since_decay += 1
        if self._since_decay >= self.decay_every:
            self._since_decay = 0
            for n in list(self.load):
                self.load[n] /= 2
                if n not in nodes and self.load[n] < 1:
                    del self.load[n]
        return node
