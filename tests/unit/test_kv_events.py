"""prefixflow.services.engine_worker.kv_events: vLLM's KV events become events about our block keys.

The oracle is the rule itself, computed from scratch: a key (one of `block_hashes` over
a cached engine block's whole prefix) is held when every engine block covering its hash
block is cached. Event sequences are drawn the way vLLM's block pool produces them:
a request stores the blocks after its cache hit as one or two runs (chunked prefill),
sometimes re-storing cached ones (two requests prefilling one prefix in the same step
cache two physical copies); any cached block can be evicted, one copy at a time; the
cache can be reset."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.kv_events import (
    BATCH_DECODER,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KeyTranslator,
)
from prefixflow.services.router.block_index import BlockIndex
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE, block_hashes
from prefixflow.shared.wire.messages import CacheOp
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit


class ReferencePool:
    """What vLLM's block pool has cached, and the held keys computed from scratch."""

    def __init__(self, engine_block: int, hash_block: int) -> None:
        self.B, self.H = engine_block, hash_block
        self.ids: dict[tuple[int, ...], int] = {}
        """Engine hash of each prefix ending on an engine block (content names a block)."""
        self.cached: Counter[int] = Counter()
        """Engine hash -> physical copies cached."""

    def hashes(self, prompt: list[int]) -> list[int]:
        return [self.ids.setdefault(tuple(prompt[: (j + 1) * self.B]), len(self.ids) + 1) for j in range(len(prompt) // self.B)]

    def held_keys(self) -> set[int]:
        held = set()
        for prefix, h in self.ids.items():
            if not self.cached[h]:
                continue
            end, start = len(prefix), len(prefix) - self.B
            for k, key in enumerate(block_hashes(tk.pack(list(prefix)), self.H)):
                if start <= (k + 1) * self.H - 1 < end:  # its hash block ends in this engine block
                    covering = range((k * self.H) // self.B, end // self.B)
                    if all(self.cached[self.ids[prefix[: (j + 1) * self.B]]] for j in covering):
                        held.add(key)
        return held


def apply_to_set(held: set[int], events) -> None:
    for op, keys in events:
        match op:
            case CacheOp.STORED:
                assert not held & set(keys), "STORED for a key already held"
                held.update(keys)
            case CacheOp.REMOVED:
                assert set(keys) <= held, "REMOVED for a key not held"
                held.difference_update(keys)
            case CacheOp.CLEARED:
                held.clear()


prompts = st.lists(st.lists(st.integers(0, 2), max_size=40), min_size=1, max_size=6)


def drive(data, pool: ReferencePool, prompts: list[list[int]], steps: int):
    """Yield (events of one engine step) drawn like vLLM's block pool emits them."""
    for _ in range(steps):
        op = data.draw(st.sampled_from(["store", "store", "store", "remove", "remove", "clear"]))
        if op == "store":
            p = data.draw(st.sampled_from(prompts))
            hashes = pool.hashes(p)
            if not hashes:
                continue
            hit = 0
            while hit < len(hashes) and pool.cached[hashes[hit]]:
                hit += 1
            first = data.draw(st.integers(0, min(hit, len(hashes) - 1)))  # below the hit: a second copy
            last = data.draw(st.integers(first + 1, len(hashes)))
            cut = data.draw(st.integers(first, last))
            events = []
            for a, b in ((first, cut), (cut, last)):
                if a < b:
                    events.append(
                        BlockStored(
                            block_hashes=hashes[a:b], parent_block_hash=hashes[a - 1] if a else None,
                            token_ids=p[a * pool.B : b * pool.B], block_size=pool.B, medium="GPU", group_idx=0,
                        )
                    )
                    pool.cached.update(hashes[a:b])
            yield events
        elif op == "remove":
            cached = sorted(h for h, n in pool.cached.items() if n)
            if cached:
                victims = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=3, unique=True))
                pool.cached.subtract(victims)
                yield [BlockRemoved(block_hashes=victims, medium="GPU", group_idx=0)]
        else:
            pool.cached.clear()
            yield [AllBlocksCleared()]


@THOROUGH
@given(st.sampled_from([2, 3, 4, 8, 12, 16]), st.sampled_from([4, 8]), prompts, st.integers(1, 40), st.data())
def test_held_keys_are_those_whose_engine_blocks_are_all_cached(engine_block, hash_block, prompts, steps, data):
    pool = ReferencePool(engine_block, hash_block)
    translator = KeyTranslator(max_nodes=10_000, hash_block_size=hash_block)
    consumer: set[int] = set()
    for events in drive(data, pool, prompts, steps):
        apply_to_set(consumer, translator.apply(events))
        assert consumer == translator.held() == pool.held_keys()
        assert len(translator) == sum(1 for n in pool.cached.values() if n)  # one node per cached block
    assert translator.skipped == translator.dropped == 0


@THOROUGH
@given(st.sampled_from([2, 4, 8]), st.integers(1, 6), prompts, st.integers(1, 40), st.data())
def test_bounded_and_never_claims_a_block_the_engine_lacks(engine_block, bound, prompts, steps, data):
    pool = ReferencePool(engine_block, 4)
    translator = KeyTranslator(max_nodes=bound, hash_block_size=4)
    consumer: set[int] = set()
    for events in drive(data, pool, prompts, steps):
        apply_to_set(consumer, translator.apply(events))
        assert len(translator) <= bound
        assert consumer == translator.held()
        assert consumer <= pool.held_keys()


@pytest.mark.parametrize("engine_block", [16, 128, 256, 48])
def test_a_whole_prompt_gives_its_router_keys(engine_block):
    """A prompt's stored blocks give exactly `block_hashes(prompt, HASH_BLOCK_SIZE)` of what
    they cover (a partial last hash block is not held), in prompt order; evicting the
    engine block in the middle of a hash block removes that key."""
    prompt = [(7 * i) % 5000 for i in range(1000)]
    n = len(prompt) // engine_block
    pool = ReferencePool(engine_block, HASH_BLOCK_SIZE)
    hashes = pool.hashes(prompt)
    translator = KeyTranslator(max_nodes=100)
    [(op, keys)] = translator.apply(
        [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=prompt[: n * engine_block], block_size=engine_block)]
    )
    want = block_hashes(tk.pack(prompt[: n * engine_block]), HASH_BLOCK_SIZE)
    assert op is CacheOp.STORED and keys == want
    # Token 300 lies in hash block 2 ([256, 384)): only that key goes (the chain after it is
    # unreachable for the engine, and `longest_match` stops there).
    victim = hashes[300 // engine_block]
    lost = {k for k in range(len(want)) if k * 128 < (300 // engine_block + 1) * engine_block and (k + 1) * 128 > (300 // engine_block) * engine_block}
    assert translator.apply([BlockRemoved(block_hashes=[victim])]) == [(CacheOp.REMOVED, [want[k] for k in sorted(lost)])]
    index = BlockIndex(max_entries=100)
    index.stored("r0", want)
    index.removed("r0", [want[k] for k in lost])
    assert index.longest_match(want) == {"r0": min(lost)}


def test_unknown_parent_other_group_and_other_medium_are_skipped():
    translator = KeyTranslator(max_nodes=10, hash_block_size=4)
    tokens = list(range(8))
    assert translator.apply([BlockStored(block_hashes=[5, 6], parent_block_hash=99, token_ids=tokens, block_size=4)]) == []
    assert translator.apply([BlockStored(block_hashes=[5], token_ids=tokens[:4], block_size=4, group_idx=1)]) == []
    assert translator.apply([BlockStored(block_hashes=[5], token_ids=tokens[:4], block_size=4, medium="CPU")]) == []
    assert translator.skipped == 4 and len(translator) == 0
    # A run whose blocks vLLM skipped (sliding window: fewer hashes than token blocks).
    assert translator.apply([BlockStored(block_hashes=[5], token_ids=tokens, block_size=4)]) == []


def test_vllm_encoded_batches_decode():
    """The publisher's payload (vLLM's own structs, msgpack) decodes without vLLM."""
    from vllm.distributed import kv_events as v

    batch = v.KVEventBatch(
        ts=12.5,
        events=[
            v.BlockStored(block_hashes=[1 << 63, 2], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                          lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention"),
            v.BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0),
            v.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    got = BATCH_DECODER.decode(msgspec.msgpack.encode(batch))
    assert got.ts == 12.5
    assert got.events == [
        BlockStored(block_hashes=[1 << 63, 2], token_ids=list(range(8)), block_size=4, medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=[2], medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ]
