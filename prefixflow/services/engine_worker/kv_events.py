"""vLLM's KV-cache events, translated into events about OUR prefix block keys. Pure logic:
no vLLM, ZMQ or NATS import (the subscriber, `kv_subscriber.py`, does the I/O).

With `kv_events_config` enabled, vLLM's scheduler publishes, once per engine step, a
`KVEventBatch` of what its block pool did (vllm/v1/core/block_pool.py):
- `BlockStored`: engine blocks newly cached (a run of one request's full blocks, with the
  engine hash of the block before the run, the run's token ids and the block size);
- `BlockRemoved`: cached engine blocks evicted (one event per physical block, so a hash
  cached twice, by two requests prefilling the same prefix in one step, is removed twice);
- `AllBlocksCleared`: the prefix cache was reset.

The router keys prompts differently: `prefixflow.shared.prefix.block_keys.block_hashes`, a blake2b
chain over `HASH_BLOCK_SIZE`-token blocks. vLLM's hashes are its own (its
`prefix_caching_hash_algo`, sha256 by default, over pickled tokens and extra keys such as
a LoRA or `cache_salt`; truncated to 64 bits in events; a LoRA adapter's chain starts
from its name, `BlockStored.lora_name`, as our keys do) and its blocks may be smaller (16
tokens on GPUs) than ours, equal (128 on this CPU build, its default), or larger. The translator rebuilds our chain from the
events' token ids: per cached engine block it keeps where it ends, our chain digest at
the last hash boundary before that, and the tokens since (fewer than a hash block).

A hash block is held when all the engine blocks covering it are cached, and gone as
soon as any of them is removed, exactly what vLLM needs to hit it (its lookup walks the
engine chain and stops at the first miss). Counting per key, the translator emits
STORED when a key becomes held and REMOVED when it stops being held, so a consumer that
applies the events to a set holds exactly the translator's held keys.

Bounded: one node per cached engine block (a second physical copy of a hash only bumps
a count), so at most the engine's block count when no event is lost. `max_nodes` (the
engine's blocks plus a margin) backs that up: past it, the least recently stored node is
dropped as if removed.

Scope: one KV cache group (`group`, 0 for a plain decoder) and one medium (GPU; vLLM
reports its CPU engine's blocks as GPU too). vLLM's finer "partial block" entries (hybrid
Mamba models only) and stores whose parent block is unknown here (subscribed late, or
that parent was dropped) cannot be placed in a chain; they are counted in `skipped` and
ignored, which only makes the router's model hold less than the engine does.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import msgspec

from prefixflow.shared.prefix import tokens as tk
from prefixflow.services.engine_worker.lora import BASE_STANDIN
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE, lora_root
from prefixflow.shared.wire.messages import CacheOp

# --- vLLM's event messages (vllm/distributed/kv_events.py), mirrored ----------------------
# Decoded from the publisher's msgpack without importing vLLM; lenient (fields vLLM adds
# later are ignored; every field has a default). Tags are vLLM's class names.

EngineHash = int | bytes
"""vLLM's external block hash: an int (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default)
or the raw digest."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHash] = []
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[EngineHash] = []
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


VllmEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events; `ts` is the engine's wall clock when it published them."""

    ts: float
    events: list[VllmEvent]
    data_parallel_rank: int | None = None


BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
"""Decodes the third frame of a publisher message (topic, sequence number, payload)."""

# --- our events ---------------------------------------------------------------------------


KeyEvent = tuple[CacheOp, list[int]]
"""(STORED, keys that became held, shallowest first), (REMOVED, keys no longer held) or
(CLEARED, []): the ops of the wire's `CacheEvents`."""

MEDIUM_GPU = "GPU"


class _Node:
    """One cached engine block, as far as our chain is concerned."""

    __slots__ = ("chain", "copies", "end", "first_held", "keys", "lead", "span", "tail")

    def __init__(self, end: int, chain: bytes, tail: bytes, keys: list[int]) -> None:
        self.end = end
        """Tokens from the start of the prompt through this block."""
        self.chain = chain
        """Our chain digest at the last hash boundary at or before `end` (b"" at 0)."""
        self.tail = tail
        """Packed tokens from that boundary to `end` (fewer than one hash block)."""
        self.copies = 1
        """Physical engine blocks cached under this hash (each is removed on its own)."""
        self.keys = keys
        """Our keys whose hash block ends inside this engine block, shallowest first. All
        but the first lie inside this block; the first may start in earlier ones."""
        self.lead: tuple[EngineHash, ...] = ()
        """The earlier engine blocks `keys[0]`'s hash block covers too."""
        self.span: tuple[EngineHash, ...] = ()
        """The engine blocks covering `tail` (earlier ones, then this one): a child's lead."""
        self.first_held = False
        """Whether `keys[0]` counts as held (it and every block of `lead` are cached)."""


class KeyTranslator:
    """vLLM KV events in, events about our prefix block keys out (see the module doc).

    Engine blocks are named by their engine hash, which names their content: a block
    evicted and cached again is the same block, so whatever depended on it (a later
    block's first key) is whole again without being told."""

    def __init__(
        self, max_nodes: int, *, hash_block_size: int = HASH_BLOCK_SIZE, group: int = 0, medium: str = MEDIUM_GPU
    ) -> None:
        if max_nodes <= 0:
            raise ValueError("max_nodes must be positive")
        self.max_nodes = max_nodes
        self.hash_block_size = hash_block_size
        self.group = group
        self.medium = medium
        self._nodes: OrderedDict[EngineHash, _Node] = OrderedDict()
        """Cached engine blocks by engine hash, least recently stored first."""
        self._dependents: dict[EngineHash, set[EngineHash]] = {}
        """Engine hash -> cached blocks whose lead names it (cached or not: it may come
        back). At most one entry per block of each cached block's lead."""
        self._held: dict[int, int] = {}
        """Our held keys -> how many cached blocks hold them (STORED at 1, REMOVED at 0)."""
        self.skipped = 0
        """Stored engine blocks that could not be placed (unknown parent, other group)."""
        self.dropped = 0
        """Blocks dropped to stay within `max_nodes`."""

    def __len__(self) -> int:
        """Engine blocks tracked."""
        return len(self._nodes)

    def held(self) -> set[int]:
        """Our keys currently held."""
        return set(self._held)

    def apply(self, events: Iterable[VllmEvent]) -> list[KeyEvent]:
        """Translate one batch of vLLM events (in order); consecutive events of one kind
        are merged."""
        out: list[KeyEvent] = []
        for event in events:
            match event:
                case BlockStored():
                    self._stored(event, out)
                case BlockRemoved():
                    if self._ours(event.medium, event.group_idx):
                        for h in event.block_hashes:
                            node = self._nodes.get(h)
                            if node is not None:
                                node.copies -= 1
                                if node.copies <= 0:
                                    self._kill(h, out)
                case AllBlocksCleared():
                    self.reset()
                    out.append((CacheOp.CLEARED, []))
        return out

    def reset(self) -> None:
        """Forget everything (the cache was reset, or a new engine publishes)."""
        self._nodes.clear()
        self._dependents.clear()
        self._held.clear()

    def _ours(self, medium: str | None, group: int | None) -> bool:
        return medium in (None, self.medium) and group in (None, self.group)

    def _stored(self, event: BlockStored, out: list[KeyEvent]) -> None:
        n, size = len(event.block_hashes), event.block_size
        if not self._ours(event.medium, event.group_idx) or size <= 0 or len(event.token_ids) != n * size:
            self.skipped += n  # another group or medium, or blocks skipped in the run (sliding window)
            return
        parent = None
        if event.parent_block_hash is not None:
            parent = self._nodes.get(event.parent_block_hash)
            if parent is None:
                self.skipped += n
                return
        for i, h in enumerate(event.block_hashes):
            node = self._nodes.get(h)
            if node is None:
                node = self._new(h, parent, tk.pack(event.token_ids[i * size : (i + 1) * size]), out,
                                 "" if event.lora_name in (None, BASE_STANDIN) else event.lora_name)
            else:  # another physical copy of a cached block
                node.copies += 1
                self._nodes.move_to_end(h)
            parent = node
        while len(self._nodes) > self.max_nodes:
            self.dropped += 1
            self._kill(next(iter(self._nodes)), out)

    def _new(self, h: EngineHash, parent: _Node | None, tokens: bytes, out: list[KeyEvent], lora: str = "") -> _Node:
        # A LoRA adapter's chain starts at its own root (`block_keys.lora_root`), as its keys do.
        chain, tail = (parent.chain, parent.tail) if parent else (lora_root(lora), b"")
        buf = tail + tokens
        step = self.hash_block_size * tk.WIDTH
        keys = []
        pos = 0
        while len(buf) - pos >= step:
            # NOTE: the step of `block_keys.block_hashes`; the tests check they agree.
            chain = hashlib.blake2b(chain + buf[pos : pos + step], digest_size=8).digest()
            keys.append(int.from_bytes(chain, "little") >> 1)
            pos += step
        node = self._nodes[h] = _Node((parent.end if parent else 0) + tk.count(tokens), chain, buf[pos:], keys)
        before = parent.span if parent is not None else ()
        if keys:
            node.lead = before  # the blocks covering the parent's tail: where keys[0] starts
            node.span = (h,) if node.tail else ()
        else:
            node.span = before + (h,)
        for earlier in node.lead:
            self._dependents.setdefault(earlier, set()).add(h)
        self._check_first(node, out)
        for key in keys[1:]:
            self._hold(key, out)
        for later in self._dependents.get(h, ()):  # blocks cached on after it was evicted
            self._check_first(self._nodes[later], out)
        return node

    def _check_first(self, node: _Node, out: list[KeyEvent]) -> None:
        """Hold `node`'s first key if it is not held and all the blocks it covers are."""
        if node.keys and not node.first_held and all(earlier in self._nodes for earlier in node.lead):
            node.first_held = True
            self._hold(node.keys[0], out)

    def _kill(self, h: EngineHash, out: list[KeyEvent]) -> None:
        node = self._nodes.pop(h)
        if node.first_held:
            self._unhold(node.keys[0], out)
        for key in node.keys[1:]:
            self._unhold(key, out)
        for earlier in node.lead:
            dependents = self._dependents[earlier]
            dependents.discard(h)
            if not dependents:
                del self._dependents[earlier]
        for later in self._dependents.get(h, ()):
            other = self._nodes[later]
            if other.first_held:
                other.first_held = False
                self._unhold(other.keys[0], out)

    def _hold(self, key: int, out: list[KeyEvent]) -> None:
        n = self._held.get(key, 0)
        self._held[key] = n + 1
        if not n:
            _emit(out, CacheOp.STORED, key)

    def _unhold(self, key: int, out: list[KeyEvent]) -> None:
        n = self._held[key] - 1
        if n:
            self._held[key] = n
        else:
            del self._held[key]
            _emit(out, CacheOp.REMOVED, key)


def _emit(out: list[KeyEvent], op: CacheOp, key: int) -> None:
    if out and out[-1][0] is op:
        out[-1][1].append(key)
    else:
        out.append((op, [key]))
