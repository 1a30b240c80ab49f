"""Admission by KV memory: pure logic, no I/O (the simulator drives it too).

vLLM schedules a waiting request as soon as KV blocks for its prompt are free and
allocates its output blocks one by one as it decodes. With a small cache and long
outputs it lets in more than fits, then preempts running requests (their blocks freed,
their work recomputed later). The worker therefore lets a prompt into its engine only
while the blocks reserved by the prompts already in it, plus this one's, fit the cache
(BatchLLM's memory-centric batching):

- a prompt reserves its prompt blocks and its expected output: `max_tokens` times the
  fraction of `max_tokens` that finished outputs have taken (measured, a moving average
  starting at 1: the whole budget until outputs show they stop earlier);
- prompts of one prefix group (one bucket key: the bucket's common prefix) share that
  prefix's full blocks in vLLM's cache, so the group reserves them once while any of its
  prompts is in;
- with nothing in the engine, the next prompt always goes in (one larger than the cache
  runs alone; vLLM then says what it can do).

An engine that reports no KV capacity (the echo engine) admits everything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

Group = tuple[int, ...]
"""A prefix group: the bucket key (block-hash chain of the bucket's common prefix)."""
RATIO_WEIGHT = 0.05
"""Weight of one finished output in the moving average of output / max_tokens."""
MIN_RATIO = 0.05
"""The expected output never falls below this share of max_tokens."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one admitted prompt reserved (handed back by `release`)."""

    group: Group
    shared: int
    """Full blocks of its group's prefix (reserved once per group)."""
    own: int
    """Its blocks beyond the shared prefix: the rest of its prompt and its expected output."""
    max_tokens: int


@dataclass
class KvAdmission:
    blocks: int = 0
    """The engine's KV capacity in blocks (0: unknown, admit everything)."""
    block_size: int = 0
    """Tokens per engine block."""
    enabled: bool = True
    reserved: int = 0
    """Blocks reserved by the prompts in the engine."""
    output_ratio: float = 1.0
    """Output tokens over max_tokens of finished prompts (moving average)."""
    groups: dict[Group, list[int]] = field(default_factory=dict)
    """Group -> [prompts in the engine, shared blocks reserved for it]."""
    admitted: int = 0
    """Prompts in the engine (with a ticket)."""

    def resize(self, blocks: int, block_size: int) -> None:
        """The engine's capacity, as it reports it (after a start or a rebuild); one of
        vLLM's blocks is its null block, never allocated."""
        self.blocks, self.block_size = max(blocks - 1, 0), block_size

    @property
    def active(self) -> bool:
        return self.enabled and self.blocks > 0 and self.block_size > 0

    def ticket(self, prompt_tokens: int, max_tokens: int, group: Group, shared_tokens: int) -> Ticket:
        """What a prompt of `prompt_tokens` tokens would reserve: `shared_tokens` of it are its
        group's common prefix (0 for a mixed batch)."""
        bs = self.block_size or 1
        shared = min(shared_tokens, prompt_tokens) // bs if group else 0
        expected = math.ceil(max_tokens * max(self.output_ratio, MIN_RATIO))
        total = math.ceil((prompt_tokens + expected) / bs)
        return Ticket(group, shared, max(total - shared, 0), max_tokens)

    def need(self, t: Ticket) -> int:
        """Blocks admitting `t` adds to the reservation (its group's prefix only as far as
        the group has not reserved it yet)."""
        live = self.groups.get(t.group) if t.group else None
        return t.own + max(t.shared - live[1], 0) if live else t.own + t.shared

    def admits(self, t: Ticket) -> bool:
        return not self.active or self.admitted == 0 or self.reserved + self.need(t) <= self.blocks

    def admit(self, t: Ticket) -> None:
        self.reserved += self.need(t)
        self.admitted += 1
        if t.group:
            live = self.groups.setdefault(t.group, [0, t.shared])
            live[0] += 1
            live[1] = max(live[1], t.shared)

    def release(self, t: Ticket, output_tokens: int | None = None) -> None:
        """A prompt left the engine; `output_tokens` it generated (None: it did not finish
        normally, nothing learnt)."""
        self.admitted -= 1
        self.reserved -= t.own
        if t.group:
            live = self.groups[t.group]
            live[0] -= 1
            if live[0] == 0:
                self.reserved -= live[1]
                del self.groups[t.group]
        if output_tokens is not None and t.max_tokens > 0:
            ratio = min(output_tokens / t.max_tokens, 1.0)
            self.output_ratio += RATIO_WEIGHT * (ratio - self.output_ratio)
