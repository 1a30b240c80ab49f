"""The bucketing buffer: hypothesis properties over any interleaving of inserts, pops and
clock advances, plus hand-checked cases of the reference rules."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.bucketer.buffer import Item, PrefixBuffer, linked, split_sorted
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit

BLOCK = 4
# A few shared "system prompts" and short random tails: the shape prefix bucketing is for,
# with lengths that vary enough to exercise the threshold rule's "shorter prompt" part.
PREFIXES = [[1] * 8, [1] * 4 + [2] * 4, [3] * 12, [3] * 2 + [4] * 3, []]

prompts = st.tuples(st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 5), min_size=0, max_size=10)).map(
    lambda t: PREFIXES[t[0]] + t[1]
).filter(bool)
LORAS = ["", "", "alpha", "beta"]
"""A prompt's LoRA adapter (empty: the base model): the same text under two adapters is
two prefixes."""

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.tuples(prompts, st.sampled_from(LORAS))),
        st.tuples(st.just("advance"), st.floats(0, 3)),
        st.tuples(st.just("pop"), st.sampled_from([0, 0, 5, 40])),
    ),
    max_size=120,
)


def static_sizes(buf: PrefixBuffer) -> list[int]:
    """Bucket sizes recomputed from scratch: sort, then cut by the reference rule (each
    adapter's prompts apart)."""
    sizes = []
    for lora in sorted(set(LORAS)):
        toks = sorted(key[1] for key in buf._items.keys() if key[0] == lora)
        sizes += split_sorted(toks, buf.threshold)
    return sizes


def check_bucket(bucket, buf: PrefixBuffer) -> None:
    toks = [it.tokens for it in bucket.items]
    assert bucket.items
    lora = bucket.items[0].lora
    if bucket.key or not bucket.pooled:
        assert all(it.lora == lora for it in bucket.items), "a bucket never mixes adapters"
    if bucket.key:
        assert toks == sorted(toks)
        assert len(bucket.items) >= buf.min_bucket
        for a, b in zip(toks, toks[1:]):
            assert linked(a, b, buf.threshold)
        common = tk.common_prefix(toks[0], toks[-1])
        assert bucket.prefix_len == common
        assert bucket.key == block_hashes(toks[0][: common * tk.WIDTH], BLOCK, lora=lora)


@THOROUGH
@given(ops=ops, max_prompts=st.integers(1, 12), min_bucket=st.integers(1, 5), threshold=st.sampled_from([0.0, 0.33, 0.5, 0.9]))
def test_no_loss_no_dup_bounds_wait_and_reference_buckets(ops, max_prompts, min_bucket, threshold):
    max_wait = 2.0
    buf = PrefixBuffer(max_prompts=max_prompts, min_bucket=min_bucket, threshold=threshold, max_wait=max_wait, block_size=BLOCK)
    now = 0.0
    inserted: dict[int, float] = {}
    released: list[int] = []

    def pop(flush: bool = False, budget: float = 0) -> None:
        before = len(buf)
        out = buf.pop(now, flush=flush, budget=budget)
        if budget and before and not flush:
            assert out, "free room and prompts waiting: something must be released"
        for bucket in out:
            check_bucket(bucket, buf)
            released.extend(it.payload for it in bucket.items)
        # Bounded after every pop, and nothing left that waited max_wait.
        assert len(buf) <= max_prompts
        assert all(now - it.arrived < max_wait for it in buf._items.values())

    for op, arg in ops:
        if op == "insert":
            uid = len(inserted)
            inserted[uid] = now
            buf.insert(Item(tk.pack(arg[0]), now, uid, lora=arg[1]))
        elif op == "advance":
            now += arg
        else:
            pop(budget=arg)
        # The incremental structure always equals the static reference computation.
        assert buf.bucket_sizes() == static_sizes(buf)
        assert sum(buf.bucket_sizes()) == len(buf)
    pop(flush=True)
    assert len(buf) == 0 and buf.nbytes == 0
    assert sorted(released) == sorted(inserted), "every prompt released exactly once"


def test_reference_threshold_and_largest_first():
    buf = PrefixBuffer(max_prompts=6, min_bucket=3, threshold=0.33, max_wait=100, block_size=BLOCK)
    a = [[7] * 8 + [i] for i in range(4)]  # 4 prompts sharing 8 of 9 tokens
    b = [[9] * 8 + [i] for i in range(2)]  # 2 prompts sharing 8 of 9 tokens
    c = [[5, i] for i in range(1)]  # unrelated
    for p in a + b + c:
        buf.insert(Item(tk.pack(p), 0.0, tuple(p)))
    assert buf.bucket_sizes() == [1, 4, 2]  # token order: c < a < b
    out = buf.pop(0.0)  # 7 > 6: pop the largest bucket only
    assert [len(b.items) for b in out] == [4] and out[0].key and out[0].prefix_len == 8
    assert buf.bucket_sizes() == [1, 2]
    out = buf.pop(0.0, flush=True)  # end of input: the rest, pooled (both under min_bucket)
    assert [len(b.items) for b in out] == [3] and out[0].key == []


def test_max_wait_releases_old_bucket_even_when_small():
    buf = PrefixBuffer(max_prompts=100, min_bucket=16, max_wait=2.0, block_size=BLOCK)
    buf.insert(Item(tk.pack([1, 2, 3]), 0.0, "old"))
    assert buf.pop(1.9) == []
    buf.insert(Item(tk.pack([8, 8, 8]), 1.9, "new"))
    out = buf.pop(2.0)
    assert [it.payload for b in out for it in b.items] == ["old"]
    assert len(buf) == 1


def test_insert_splits_and_merges_buckets():
    buf = PrefixBuffer(max_prompts=100, threshold=0.5, block_size=BLOCK)
    buf.insert(Item(tk.pack([1, 1, 1, 1]), 0, 0))
    buf.insert(Item(tk.pack([1, 1, 2, 2]), 0, 1))  # shares 2/4: linked at 0.5
    assert buf.bucket_sizes() == [2]
    buf.insert(Item(tk.pack([1, 1, 1, 9, 9, 9, 9, 9, 9, 9]), 0, 2))  # between them, links neither... check
    assert buf.bucket_sizes() == static_sizes(buf)
    # Removing a bucket can join its former neighbours.
    buf.pop(0, flush=True)
    assert len(buf) == 0
