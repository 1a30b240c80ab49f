"""Admission by KV memory: pure logic, no I/O (the simulator drives it too).

vLLM schedules a waiting request as soon as KV blocks for its prompt are free and
allocates its output blocks one by one as it decodes. With a small cache and long
outputs it lets in more than fits, then preempts running requests (their blocks freed,
their work recomputed later). The worker therefore lets a prompt into its engine only
while the blocks reserved by the prompts already in it, plus this one's, fit the cache
(BatchLLM's memory-centric batching):

- a prompt reserves its prompt blocks and its expected output: `max_tokens` times the
  fraction of `max_tokens` that finished outputs have taken (measured, a moving average
  starting at 1: the whole budget until outputs show they stop earlier), times
  `output_reserve`;
- a full prompt block is reserved once however many prompts in the engine hold it: vLLM's
  prefix cache shares a block between prompts whose tokens up to and including it are
  the same, and so does this count (a block is named by the hash chain of its tokens and
  all before it, as vLLM names it), whatever batch or bucket the prompts came in;
- with nothing in the engine, the next prompt always goes in (one larger than the cache
  runs alone; vLLM then says what it can do).

That reservation holds each prompt's whole output from its start, while a prompt holds
its output blocks only as it decodes and frees them all when it ends: prompts admitted
apart never hold their whole outputs at once. So when the reservations do not fit, the
prompt still goes in if the blocks the engine will hold **at its fullest** fit (`peak`):
each prompt in it is as far through its expected output as the engine has run steps
since it went in (`clock`, one token per step), it holds one more output token per step
until it ends, and then frees its blocks: its full prompt blocks as well, unless a prompt
still running shares them. The fullest moment is when one of them ends. Without a step
clock (`clock` never advanced) no prompt has progressed, and the peak differs from the
reservation only by what the prompts that end sooner free.

An engine that reports no KV capacity (the echo engine) admits everything.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right, insort
from dataclasses import dataclass, field

RATIO_WEIGHT = 0.05
"""Weight of one finished output in the moving average of output / max_tokens."""
MIN_RATIO = 0.05
"""The expected output never falls below this share of max_tokens."""
EXACT_PEAK = 64
"""Up to this many prompts in the engine, `peak` counts each one's blocks exactly (a pass
over them per moment); beyond, it bounds each one's partial block by a whole one."""


@dataclass(frozen=True, slots=True)
class Ticket:
    """What one admitted prompt reserved (handed back by `release`)."""

    blocks: tuple[int, ...]
    """Its full prompt blocks, each named by the hash chain of its tokens (shared)."""
    own: int
    """Its blocks beyond them: its last, partial prompt block and its expected output."""
    max_tokens: int
    rest: int = 0
    """Tokens of its last, partial prompt block."""
    output: int = 0
    """Its expected output tokens."""


def block_chain(tokens: bytes, block_size: int, lora: str = "") -> tuple[int, ...]:
    """Names of the full blocks of packed tokens (4 bytes each): block i's name hashes
    the name of block i - 1 and its own tokens, so equal names mean equal prefixes (under
    one LoRA adapter: each adapter's blocks are its own, as in vLLM's cache)."""
    width = 4 * block_size
    out = []
    h = hash(lora) if lora else 0
    for i in range(len(tokens) // width):
        h = hash((h, tokens[i * width : (i + 1) * width]))
        out.append(h)
    return tuple(out)


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
    output_reserve: float = 1.0
    """Share of its expected output a prompt reserves (`--kv-output-reserve`): the prompts
    in an engine are at every stage of their outputs, on average half way."""
    held: dict[int, int] = field(default_factory=dict)
    """Full prompt block -> prompts in the engine that hold it."""
    admitted: int = 0
    """Prompts in the engine (with a ticket)."""
    clock: int = 0
    """The engine's steps so far (the caller advances it: `peak` reads each prompt's
    progress from it)."""
    running: dict[int, tuple[Ticket, list[int]]] = field(default_factory=dict)
    """id(ticket) -> (ticket, the clock when each of its admissions went in)."""

    def resize(self, blocks: int, block_size: int) -> None:
        """The engine's capacity, as it reports it (after a start or a rebuild); one of
        vLLM's blocks is its null block, never allocated."""
        self.blocks, self.block_size = max(blocks - 1, 0), block_size

    @property
    def active(self) -> bool:
        return self.enabled and self.blocks > 0 and self.block_size > 0

    def ticket(self, tokens: bytes, max_tokens: int, lora: str = "") -> Ticket:
        """What a prompt of packed `tokens` (under LoRA adapter `lora`) would reserve."""
        bs = self.block_size or 1
        chain = block_chain(tokens, bs, lora) if self.active else ()
        rest = len(tokens) // 4 - len(chain) * bs
        expected = math.ceil(max_tokens * max(self.output_ratio, MIN_RATIO) * self.output_reserve)
        return Ticket(chain, math.ceil((rest + expected) / bs), max_tokens, rest, expected)

    def need(self, t: Ticket) -> int:
        """Blocks admitting `t` adds to the reservation (its prompt blocks only as far as
        no prompt in the engine holds them already)."""
        held = self.held
        return t.own + sum(1 for b in t.blocks if b not in held)

    def admits(self, t: Ticket) -> bool:
        if not self.active or self.admitted == 0 or self.reserved + self.need(t) <= self.blocks:
            return True
        return self.peak(t) <= self.blocks

    def peak(self, t: Ticket | None = None) -> float:
        """The most blocks the prompts in the engine, and `t` if it went in now, will
        hold from now on (beyond `EXACT_PEAK` prompts an upper bound: one partial block
        each). A full prompt block counts while a prompt holding it runs: until the last
        of its holders ends."""
        now = self.clock
        ends = []  # (steps left, tokens beyond its full prompt blocks now)
        holders = []  # (steps left of a ticket's latest admission, its full prompt blocks)
        for ticket, starts in self.running.values():
            most = -1
            for start in starts:
                done = min(max(now - start, 0), ticket.output)
                ends.append((ticket.output - done, ticket.rest + done))
                most = max(most, ticket.output - done)
            if ticket.blocks:
                holders.append((most, ticket.blocks))
        if t is not None:
            ends.append((t.output, t.rest))
            if t.blocks:
                holders.append((t.output, t.blocks))
        ends.sort(reverse=True)
        # A full prompt block is held until the last of its holders ends. Blocks are hash
        # chains: a ticket holding block j holds every block before it. So, holders taken
        # latest-ending first, a ticket's blocks are walked from its last back to the first
        # one a later-ending ticket already holds (each block is visited about once), and
        # the blocks it adds are freed when it ends.
        holders.sort(key=lambda h: h[0], reverse=True)
        seen: set[int] = set()
        freed = []  # (steps left, full prompt blocks freed then), latest first
        for most, blocks in holders:
            k = 0
            for b in reversed(blocks):
                if b in seen:
                    break
                seen.add(b)
                k += 1
            if k:
                freed.append((most, k))
        top = tokens = n = fixed = held = 0
        bs = self.block_size
        exact = len(ends) <= EXACT_PEAK
        # Exact: the n latest alive hold sum(ceil((x_i + s) / bs)) blocks beyond the full
        # prompt blocks. With x_i = q_i * bs + r_i and s = a * bs + b (0 <= r_i, b < bs),
        # each term is q_i + a + [r_i + b >= 1] + [r_i + b > bs]: a running sum of the q_i
        # and the remainders kept sorted count it in O(log n) a moment, not O(n).
        rems: list[int] = []
        quotients = 0
        for left, now_tokens in ends:  # when the n-th latest ends: the n latest alive
            tokens += now_tokens
            n += 1
            s = left  # its last output token counted: as its reservation counts it
            while held < len(freed) and freed[held][0] >= s:
                fixed += freed[held][1]  # prompt blocks a prompt alive then still holds
                held += 1
            if exact:
                q, r = divmod(now_tokens, bs)
                quotients += q
                insort(rems, r)
                a, b = divmod(s, bs)
                if b:
                    partial = n + n - bisect_right(rems, bs - b)
                else:
                    partial = n - bisect_left(rems, 1)
                top = max(top, fixed + quotients + n * a + partial)
            else:
                top = max(top, fixed + (tokens + n * s) / bs + n)
        return top

    def admit(self, t: Ticket) -> None:
        self.reserved += self.need(t)
        self.admitted += 1
        self.running.setdefault(id(t), (t, []))[1].append(self.clock)
        held = self.held
        for b in t.blocks:
            held[b] = held.get(b, 0) + 1

    def release(self, t: Ticket, output_tokens: int | None = None) -> None:
        """A prompt left the engine; `output_tokens` it generated (None: it did not finish
        normally, nothing learnt)."""
        self.admitted -= 1
        self.reserved -= t.own
        entry = self.running.get(id(t))
        if entry is not None:
            entry[1].pop(0)
            if not entry[1]:
                del self.running[id(t)]
        held = self.held
        for b in t.blocks:
            n = held[b] - 1
            if n:
                held[b] = n
            else:
                del held[b]
                self.reserved -= 1
        if output_tokens is not None and t.max_tokens > 0:
            ratio = min(output_tokens / t.max_tokens, 1.0)
            self.output_ratio += RATIO_WEIGHT * (ratio - self.output_ratio)
