"""Which bucketer node gets a prompt: rendezvous hashing on the prompt's first KV block.

Prompts that share their first block land on the same node, so they meet in one buffer
and can be bucketed together; adding or removing a node moves only that node's share.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def _score(node: str, key: int) -> int:
    h = hashlib.blake2b(node.encode(), digest_size=8)
    h.update(key.to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little")


def pick_node(key: int, nodes: Sequence[str]) -> str:
    """The node with the highest rendezvous score for `key` (nodes must be non-empty)."""
    return max(nodes, key=lambda n: _score(n, key))
