"""Takeover decisions: which bucketer node is gone for good, and where its prompts go.

Pure (no NATS): the ingestor's mover (`prefixflow/services/ingestor/mover.py`) feeds it the
heartbeats it heard and the backlog of each node's bucket subject, and does what it says.

- **Gone**: a node whose bucketer has sent no heartbeat for `gone_after` seconds
  (`--bucketer-gone-after`) while its bucket subject still holds prompts. Silence counts
  only from `since`: the ingestor's start or its last NATS reconnect (nobody can be heard
  while we are away, so an outage of our own is not everyone's death). A node with
  prompts left that was never heard since we started (its bucketer died before this
  ingestor started) counts as heard at the moment it was first seen in the stream.
- **Back**: a node heard again within `gone_after` is no longer gone; its takeover stops
  at once and its bucketer (re-)binds its durable consumer.
- **Targets**: the nodes heard within `live_for` (the ingestor's own sharding window),
  minus the gone. No target: nothing moves (the prompts stay queued where they are).
- **Placement**: each prompt goes to the node plain rendezvous hashing of its first KV
  block picks among the targets: the first choice of the ingestor's own sharder
  (`prefixflow/shared/prefix/sharding.py`), so a moved prompt meets the new prompts of its prefix,
  and the same prompt against the same targets always lands on the same node.
- **Message ids**: every part of a moved message carries `Nats-Msg-Id`
  `moved:<stream>:<stream sequence>:<node>`. A move that crashed after publishing some
  parts and before acking the original is redone when the original comes back; the same
  targets give the same parts with the same ids, and JetStream drops the copies (its
  duplicate window). Beyond the window, or with other targets, a prompt may reach two
  bucketers and run twice; the sink keeps one row per (job, id).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from prefixflow.shared.prefix.block_keys import first_block_key
from prefixflow.shared.prefix.sharding import pick_node
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects

MOVE_ID_PREFIX = "moved"


@dataclass(frozen=True)
class Decision:
    """What the mover does this tick."""

    move: tuple[str, ...] = ()
    """Gone nodes whose prompts are moved now (each already taken over, or newly)."""
    stop: tuple[str, ...] = ()
    """Nodes whose takeover ends (heard again, drained, or no target left)."""
    targets: tuple[str, ...] = ()
    """Live nodes that receive moved prompts."""


@dataclass
class Takeover:
    """Which nodes are taken over; the state is a few floats per node (bounded by the
    nodes of the cluster)."""

    gone_after: float
    live_for: float
    since: float
    """Monotonic time from which silence counts (start, or our last reconnect)."""
    first_seen: dict[str, float] = field(default_factory=dict)
    """Nodes with a backlog that were never heard: when the backlog was first seen."""
    taking: set[str] = field(default_factory=set)
    """Nodes being taken over now."""

    def on_reconnect(self, now: float) -> None:
        self.since = max(self.since, now)

    def silent_for(self, node: str, heard: Mapping[str, float], now: float) -> float:
        seen = heard.get(node, self.first_seen.get(node, now))
        return now - max(seen, self.since)

    def gone(self, heard: Mapping[str, float], backlog: Mapping[str, int], now: float) -> set[str]:
        """Nodes with prompts left and no heartbeat for `gone_after`."""
        return {n for n, left in backlog.items() if left > 0 and self.silent_for(n, heard, now) >= self.gone_after}

    def targets(self, heard: Mapping[str, float], now: float, gone: Collection[str]) -> tuple[str, ...]:
        return tuple(sorted(n for n, t in heard.items() if now - t < self.live_for and n not in gone))

    def decide(self, heard: Mapping[str, float], backlog: Mapping[str, int], now: float) -> Decision:
        """`heard`: node -> monotonic time of its last heartbeat; `backlog`: node ->
        messages on its bucket subject (queued or leased), as last asked of the stream."""
        # 1. Remember when a never-heard node's backlog showed up (forget it once drained).
        for node, left in backlog.items():
            if left > 0 and node not in heard:
                self.first_seen.setdefault(node, now)
        for node in [n for n in self.first_seen if n in heard or backlog.get(n, 0) <= 0]:
            del self.first_seen[node]
        # 2. Who is gone, who gets their prompts.
        gone = self.gone(heard, backlog, now)
        targets = self.targets(heard, now, gone)
        move = sorted(gone) if targets else []
        stop = sorted(self.taking - set(move))
        self.taking = set(move)
        return Decision(tuple(move), tuple(stop), targets)


def place(prompts: Sequence[m.Prompt], targets: Sequence[str], block_size: int) -> dict[str, list[m.Prompt]]:
    """Moved prompts by target node (rendezvous on each prompt's first block; order kept)."""
    if not targets:
        raise ValueError("no target node to move prompts to")
    parts: dict[str, list[m.Prompt]] = {}
    for p in prompts:
        parts.setdefault(pick_node(first_block_key(p.tokens, block_size), targets), []).append(p)
    return parts


def move_id(stream: str, seq: int, node: str) -> str:
    """`Nats-Msg-Id` of the part of stream message `seq` moved to `node`."""
    return f"{MOVE_ID_PREFIX}:{stream}:{seq}:{node}"


def node_of(subject: str) -> str | None:
    """The node of a bucket subject (`pfx.bucket.<node>.<job>`), None for anything else."""
    parts = subjects.bucket_parts(subject)
    return parts[0] if parts is not None and subjects.is_valid_name(parts[0]) else None
