"""prefixflow.services.bucketer.buffer (PrefixBuffer, split_sorted) and prefixflow.shared.prefix.block_keys / prefixflow.shared.prefix.tokens."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.services.bucketer.buffer import (
    MIN_GROUP,
    Bucket,
    Item,
    PrefixBuffer,
    linked,
    split_sorted,
)
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes, matched_blocks
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit


def naive_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def common_prefix_all(items: list[Item]) -> int:
    lists = [tk.unpack(i.tokens) for i in items]
    n = min(len(t) for t in lists)
    k = 0
    while k < n and all(t[k] == lists[0][k] for t in lists):
        k += 1
    return k


def P(*ids: int) -> bytes:
    return tk.pack(list(ids))


# --- prefixflow.shared.prefix.tokens -----------------------------------------------------------

token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@settings(COSTLY)
@given(token_ids, token_ids)
def test_tokens_pack_order_and_common_prefix(a, b):
    pa_, pb = tk.pack(a), tk.pack(b)
    assert tk.unpack(pa_) == a and tk.count(pa_) == len(a) and len(pa_) == 4 * len(a)
    assert (pa_ < pb) == (a < b)  # byte order is token order
    assert tk.common_prefix(pa_, pb) == naive_common_prefix(a, b)
    assert tk.common_prefix(pa_ + pb, pa_) == len(a)


# --- block_hashes / matched_blocks -----------------------------------------------------


def reference_hashes(ids: list[int], block_size: int) -> list[int]:
    """Independent implementation of the documented scheme: blake2b-64 chain over the
    packed (big-endian uint32) blocks, little-endian int >> 1 (63 bits)."""
    out, parent = [], b""
    for i in range(len(ids) // block_size):
        block = b"".join(t.to_bytes(4, "big") for t in ids[i * block_size : (i + 1) * block_size])
        parent = hashlib.blake2b(parent + block, digest_size=8).digest()
        out.append(int.from_bytes(parent, "little") >> 1)
    return out


@given(st.lists(st.integers(0, 2**32 - 1), max_size=64), st.integers(1, 9))
def test_block_hashes_matches_reference_and_is_deterministic(ids, bs):
    h = block_hashes(tk.pack(ids), bs)
    assert h == block_hashes(tk.pack(list(ids)), bs)
    assert len(h) == len(ids) // bs
    assert all(0 <= x < 2**63 for x in h)  # fits a msgpack int64
    assert h == reference_hashes(ids, bs)


@given(st.lists(st.integers(0, 1000), max_size=64), st.integers(0, 64), st.integers(1, 9))
def test_block_hashes_chain_property(ids, cut, bs):
    full = block_hashes(tk.pack(ids), bs)
    prefix = block_hashes(tk.pack(ids[:cut]), bs)
    assert full[: len(prefix)] == prefix
    assert len(prefix) == min(cut, len(ids)) // bs


@given(st.lists(st.integers(0, 1000), max_size=40), st.lists(st.integers(0, 1000), min_size=1, max_size=8), st.integers(1, 8))
def test_block_hashes_ignores_trailing_partial_block(ids, tail, bs):
    ids = ids[: len(ids) // bs * bs]
    tail = tail[: bs - 1]
    assert block_hashes(tk.pack(ids + tail), bs) == block_hashes(tk.pack(ids), bs)


@given(st.data(), st.integers(1, 8))
def test_different_blocks_give_different_hashes(data, bs):
    a = data.draw(st.lists(st.integers(0, 50), min_size=bs, max_size=bs))
    b = data.draw(st.lists(st.integers(0, 50), min_size=bs, max_size=bs).filter(lambda x: x != a))
    rest = data.draw(st.lists(st.integers(0, 50), min_size=bs, max_size=3 * bs))
    ha, hb = block_hashes(tk.pack(a + rest), bs), block_hashes(tk.pack(b + rest), bs)
    assert ha[0] != hb[0]
    assert all(x != y for x, y in zip(ha, hb))  # the chain carries the difference


def test_block_hashes_edges():
    assert block_hashes(b"", 4) == []
    assert block_hashes(P(1, 2, 3), 4) == []
    ids = P(*range(20))
    assert len(block_hashes(ids, 4)) == 5
    assert block_hashes(ids, 4, max_blocks=2) == block_hashes(ids, 4)[:2]
    assert block_hashes(ids, 4, max_blocks=0) == []
    h = block_hashes(P(7, 7, 7, 7, 7, 7, 7, 7), 4)
    assert h[0] != h[1]  # the same block at another position: the parent is chained in


def test_matched_blocks():
    a = block_hashes(P(*range(40)), 4)
    b = block_hashes(P(*range(20), *[999] * 20), 4)
    assert matched_blocks(a, a) == 10
    assert matched_blocks(a, b) == matched_blocks(b, a) == 5
    assert matched_blocks(a, []) == matched_blocks([], []) == 0
    assert matched_blocks(a[:3], a) == 3
    assert matched_blocks((1, 2, 3), [2, 2, 3]) == 0


# --- split_sorted / linked --------------------------------------------------------------


def test_split_sorted_cuts_on_threshold():
    toks = [P(1, 2, 3, 4), P(1, 2, 3, 5), P(1, 2, 9, 9), P(7, 7, 7, 7), P(7, 7, 7, 8, 9)]
    assert split_sorted(toks, 0.5) == [3, 2]
    assert split_sorted(toks, 0.75) == [2, 1, 2]
    assert split_sorted([P(1, 2), P(1, 2, 3), P(1, 2, 4)], 1.0) == [2, 1]
    assert split_sorted([], 0.5) == []
    assert split_sorted([b"", b""], 0.0) == [1, 1]  # empty prompts never link
    assert linked(P(1), P(2), 0.0) and not linked(P(1), b"", 0.0)


# --- PrefixBuffer: examples ------------------------------------------------------------


def items_of(buckets: list[Bucket]) -> list[object]:
    return [i.payload for b in buckets for i in b.items]


def test_bucket_waits_until_due_then_goes_keyed():
    buf = PrefixBuffer(min_bucket=3, threshold=0.5, max_wait=2.0, block_size=4)
    shared = list(range(100, 112))
    for i in range(3):
        buf.insert(Item(tk.pack(shared + [i, i]), 0.0, payload=i))
    buf.insert(Item(P(1, 2, 3), 1.5, payload="lone"))
    assert len(buf) == 4 and buf.nbytes == 4 * (14 * 3 + 3)
    assert buf.bucket_sizes() == [1, 3]
    assert buf.pop(1.0) == []  # nothing due, nothing over the bounds
    out = buf.pop(2.0)  # the three have waited max_wait
    assert len(out) == 1
    b = out[0]
    assert [i.payload for i in b.items] == [0, 1, 2]
    assert b.prefix_len == 12 and b.tokens == 42
    assert b.key == block_hashes(tk.pack(shared), 4) and len(b.key) == 3
    assert len(buf) == 1 and buf.nbytes == 12 and buf.oldest() == 1.5


def test_overdue_item_takes_its_whole_bucket():
    buf = PrefixBuffer(min_bucket=2, threshold=0.5, max_wait=1.0, block_size=2)
    buf.insert(Item(P(5, 5, 5, 1), 0.0, payload="old"))
    buf.insert(Item(P(5, 5, 5, 2), 0.9, payload="young"))
    buf.insert(Item(P(9, 9, 9, 9), 0.9, payload="other"))
    out = buf.pop(1.0)
    assert [sorted(i.payload for i in b.items) for b in out] == [["old", "young"]]
    assert out[0].key == block_hashes(P(5, 5, 5), 2)
    assert len(buf) == 1


def test_small_due_buckets_are_pooled():
    buf = PrefixBuffer(min_bucket=4, threshold=0.5, max_wait=2.0, block_size=4)
    buf.insert(Item(P(1, 1, 1, 1), 0.0, payload="a"))
    buf.insert(Item(P(9, 9, 9, 9), 1.0, payload="b"))
    assert buf.pop(1.5) == []
    out = buf.pop(2.0)  # "a" has waited exactly max_wait: due
    assert [[i.payload for i in b.items] for b in out] == [["a"]]
    assert out[0].key == [] and out[0].prefix_len == 0
    assert len(buf) == 1 and buf.oldest() == 1.0
    out = buf.pop(3.0)
    assert items_of(out) == ["b"]
    assert len(buf) == 0 and buf.nbytes == 0 and buf.oldest() is None
    assert buf.pop(100.0) == []


def test_flush_pools_small_buckets_and_keeps_large_keyed():
    buf = PrefixBuffer(min_bucket=3, threshold=0.75, max_wait=100, block_size=2)
    for i in range(7):
        buf.insert(Item(P(i, i, i), 0.0, payload=i))
    for j in range(4):
        buf.insert(Item(P(50, 50, 50, 50, j), 0.0, payload=f"k{j}"))
    assert buf.pop(1.0) == []
    out = buf.pop(1.0, flush=True)
    assert len(buf) == 0 and buf.nbytes == 0
    keyed = [b for b in out if not b.pooled]
    pooled = [b for b in out if b.pooled]
    assert [sorted(i.payload for i in b.items) for b in keyed] == [["k0", "k1", "k2", "k3"]]
    assert out[0] is keyed[0]  # largest first
    assert [len(b.items) for b in pooled] == [3, 3, 1]
    assert sorted(i.payload for b in pooled for i in b.items) == list(range(7))
    # each singleton keeps its own prefix key inside the mixed batch
    assert [p for b in pooled for p in b.parts] == [(1, block_hashes(i.tokens, 2)) for b in pooled for i in b.items]


def test_over_max_prompts_releases_largest_down_to_bound():
    buf = PrefixBuffer(max_prompts=4, min_bucket=10, threshold=0.5, max_wait=100, block_size=2)
    for i in range(3):
        buf.insert(Item(P(1, 1, 1, i), 0.0, payload=("big", i)))
    for i in range(3):
        buf.insert(Item(P(i + 5, i + 5), 0.0, payload=("solo", i)))
    assert buf.full() and buf.over()
    out = buf.pop(0.0)
    assert {p[0] for p in items_of(out)} == {"big"}  # the largest bucket went first
    assert len(buf) == 3 and not buf.over()


def test_over_max_bytes_releases_down_to_bound():
    buf = PrefixBuffer(max_prompts=1000, max_bytes=100, min_bucket=10, threshold=0.9, max_wait=100, block_size=2)
    for i in range(10):
        buf.insert(Item(P(*[i] * 5), 0.0, payload=i))  # 20 bytes each, 200 in all
    assert buf.full() and buf.over()
    out = buf.pop(0.0)
    assert len(items_of(out)) == 5
    assert buf.nbytes == 100 and not buf.over()


def test_full_is_at_the_bound_over_is_past_it():
    buf = PrefixBuffer(max_prompts=2, min_bucket=1, max_wait=100)
    buf.insert(Item(P(1), 0.0))
    assert not buf.full()
    buf.insert(Item(P(2), 0.0))
    assert buf.full() and not buf.over()
    buf.insert(Item(P(3), 0.0))
    assert buf.over()


def test_insert_inside_a_bucket_can_split_it():
    buf = PrefixBuffer(min_bucket=1, threshold=0.6, max_wait=10, block_size=1)
    a, c = P(1, 1, 0, 0, 0, 0, 0, 0), P(1, 1, 5)
    buf.insert(Item(a, 0.0, payload="a"))
    buf.insert(Item(c, 0.0, payload="c"))
    assert buf.bucket_sizes() == [2]  # 2 shared >= 0.6 x 3
    x = P(1, 1, 3, 3, 3, 3, 3, 3)  # sorts between a and c; shares 2 < 0.6 x 8 with a
    buf.insert(Item(x, 0.0, payload="x"))
    assert buf.bucket_sizes() == [1, 2] == split_sorted(sorted([a, c, x]), 0.6)
    out = buf.pop(0.0, flush=True)
    assert [[i.payload for i in b.items] for b in out] == [["x", "c"], ["a"]]
    assert out[0].prefix_len == 2 and out[1].prefix_len == 8


def test_equal_prompts_are_all_kept():
    buf = PrefixBuffer(min_bucket=2, threshold=0.5, max_wait=1, block_size=2)
    for i in range(5):
        buf.insert(Item(P(4, 4, 4, 4), float(i), payload=i))
    assert len(buf) == 5 and buf.bucket_sizes() == [5]
    out = buf.pop(1.0)  # the oldest is due: the whole bucket goes, keyed by the full prompt
    assert sorted(items_of(out)) == list(range(5))
    assert out[0].prefix_len == 4 and out[0].key == block_hashes(P(4, 4, 4, 4), 2)


# --- PrefixBuffer: property over random operation sequences ---------------------------

PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 9, 9], [5] * 8, [5, 5, 6, 6], [8, 1]]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.sampled_from(range(len(PREFIXES))), st.lists(st.integers(0, 4), max_size=6)),
        st.tuples(st.just("pop"), st.floats(0.0, 1.5, allow_nan=False)),
    ),
    max_size=60,
)


def check_groups(b: Bucket, buf: PrefixBuffer) -> None:
    """A keyed bucket's groups: none, or parts covering its items in order, each keyed by
    its own common prefix (at least the bucket's key); at least two are groups of
    `MIN_GROUP` or more prompts sharing the block after the bucket's key, and no such
    group is cut in two."""
    if not b.parts:
        return
    assert sum(n for n, _ in b.parts) == len(b.items)
    depth = (len(b.key) + 1) * buf.block_size
    at, deep = 0, 0
    for n, key in b.parts:
        run = b.items[at : at + n]
        at += n
        plen = common_prefix_all(run)
        assert key == block_hashes(run[0].tokens[: 4 * plen], buf.block_size)
        assert key[: len(b.key)] == b.key
        deep += n >= MIN_GROUP and plen >= depth
    assert deep >= 2
    # no two neighbours across a part boundary share the block after the key
    at = 0
    for n, _ in b.parts[:-1]:
        at += n
        left, right = b.items[at - 1].tokens, b.items[at].tokens
        assert tk.common_prefix(left, right) < depth or min(tk.count(left), tk.count(right)) < depth


def test_a_bucket_under_a_shared_system_prompt_lists_its_groups():
    """Every prompt shares a 4-token system prompt (one bucket by the reference rule);
    under it, three groups share 4 more tokens each and two prompts share nothing more:
    the bucket is keyed by the system prompt and lists the groups as parts, each with its
    own key, the two loose prompts as one part keyed by the system prompt."""
    system = [7, 7, 7, 7]
    buf = PrefixBuffer(min_bucket=2, threshold=0.3, max_wait=100, block_size=4)
    rows = [system + [g] * 4 + [q] for g in (1, 2, 3) for q in range(3)] + [system + [9, 8, 7, 6, 5], system + [9, 9, 9, 9, 1]]
    for i, row in enumerate(rows):
        buf.insert(Item(P(*row), 0.0, payload=i))
    (b,) = buf.pop(1.0, flush=True)
    assert b.key == block_hashes(P(*system), 4) and not b.pooled
    assert b.parts == [(3, block_hashes(P(*system, g, g, g, g), 4)) for g in (1, 2, 3)] + [(2, b.key)]
    check_groups(b, buf)
    # one group only: the bucket is routed as one, by its key
    one = PrefixBuffer(min_bucket=2, threshold=0.3, max_wait=100, block_size=4)
    for i, row in enumerate(rows[:3] + rows[-2:]):
        one.insert(Item(P(*row), 0.0, payload=i))
    assert one.pop(1.0, flush=True)[0].parts == []


def test_a_large_bucket_goes_out_in_slices_in_token_order():
    buf = PrefixBuffer(min_bucket=4, threshold=0.5, max_wait=100, block_size=2, max_bucket=10)
    for i in range(23):
        buf.insert(Item(P(3, 3, 3, 3, i), 0.0, payload=i))
    out = buf.pop(1.0, flush=True)
    # 23 prompts: 10 + 13 (a last slice under min_bucket joins the one before)
    assert [len(b.items) for b in out] == [10, 13]
    assert [i.payload for b in out for i in b.items] == list(range(23))
    assert all(b.key == block_hashes(P(3, 3, 3, 3), 2) for b in out)
    whole = PrefixBuffer(min_bucket=4, threshold=0.5, max_wait=100, block_size=2)
    for i in range(23):
        whole.insert(Item(P(3, 3, 3, 3, i), 0.0, payload=i))
    assert [len(b.items) for b in whole.pop(1.0, flush=True)] == [23]


def check_buckets(buckets: list[Bucket], buf: PrefixBuffer) -> None:
    for b in buckets:
        assert b.items
        assert b.tokens == sum(tk.count(i.tokens) for i in b.items)
        if not b.pooled:
            # a keyed bucket: one whole run of the reference rule, keyed by its common prefix
            assert len(b.items) >= buf.min_bucket
            assert not buf.max_bucket or len(b.items) < buf.max_bucket + buf.min_bucket
            toks = [i.tokens for i in b.items]
            assert toks == sorted(toks), "a keyed bucket is one run, in token order"
            for prev, cur in zip(toks, toks[1:]):
                shorter = min(tk.count(prev), tk.count(cur))
                assert shorter > 0
                assert tk.common_prefix(prev, cur) >= buf.threshold * shorter
            plen = common_prefix_all(b.items)
            assert b.prefix_len == plen
            assert b.key == block_hashes(b.items[0].tokens[: 4 * plen], buf.block_size)
            check_groups(b, buf)
        else:
            # a pooled (mixed) batch: no key; lists its small buckets in item order, each
            # with its own key
            assert b.key == [] and b.prefix_len == 0
            assert len(b.items) <= max(2 * buf.min_bucket - 2, 1)
            assert sum(n for n, _ in b.parts) == len(b.items)
            at = 0
            for n, key in b.parts:
                run = b.items[at : at + n]
                at += n
                assert 1 <= n < buf.min_bucket
                toks = [i.tokens for i in run]
                assert toks == sorted(toks)
                assert all(linked(x, y, buf.threshold) for x, y in zip(toks, toks[1:]))
                plen = common_prefix_all(run)
                assert key == block_hashes(run[0].tokens[: 4 * plen], buf.block_size)
    pooled = [b for b in buckets if b.pooled]
    assert all(len(b.items) >= buf.min_bucket for b in pooled[:-1]), "only the last mixed batch is short"


@given(
    ops=ops,
    max_prompts=st.integers(1, 20),
    max_bytes=st.one_of(st.just(10**9), st.integers(4, 400)),
    min_bucket=st.integers(1, 6),
    threshold=st.sampled_from([0.0, 0.2, 0.33, 0.5, 0.9, 1.0]),
    max_wait=st.floats(0.3, 3.0),
    block_size=st.sampled_from([1, 2, 4]),
    max_bucket=st.sampled_from([0, 1, 3, 8]),
)
def test_buffer_invariants(ops, max_prompts, max_bytes, min_bucket, threshold, max_wait, block_size, max_bucket):
    buf = PrefixBuffer(
        max_prompts=max_prompts,
        max_bytes=max_bytes,
        min_bucket=min_bucket,
        threshold=threshold,
        max_wait=max_wait,
        block_size=block_size,
        max_bucket=max_bucket,
    )
    now = 0.0
    inserted: dict[int, Item] = {}
    emitted: list[int] = []
    held: dict[int, Item] = {}

    def check_structure() -> None:
        assert len(buf) == len(held)
        assert buf.nbytes == sum(len(i.tokens) for i in held.values())
        assert buf.oldest() == min((i.arrived for i in held.values()), default=None)
        # the incremental bucket boundaries equal the static reference computation
        assert buf.bucket_sizes() == split_sorted(sorted(i.tokens for i in held.values()), threshold)

    def do_pop(flush: bool = False) -> None:
        out = buf.pop(now, flush=flush)
        check_buckets(out, buf)
        for b in out:
            for it in b.items:
                emitted.append(it.payload)
                assert it.payload in held, "released an item that is not held (twice, or never inserted)"
                del held[it.payload]
        check_structure()
        assert not buf.over(), "still over max_prompts / max_bytes after pop"
        assert len(buf) <= buf.max_prompts and buf.nbytes <= buf.max_bytes
        assert all(now - i.arrived < buf.max_wait for i in held.values()), "an overdue item stayed"

    for op in ops:
        if op[0] == "insert":
            _, p, suffix = op
            ids = PREFIXES[p] + suffix or [0]
            n = len(inserted)
            item = Item(tk.pack(ids), now, payload=n, ref=("msg", n))
            inserted[n] = held[n] = item
            buf.insert(item)
            check_structure()
        else:
            now += op[1]
            do_pop()
    now += 0.01
    do_pop(flush=True)
    assert len(buf) == 0 and buf.nbytes == 0 and buf.bucket_sizes() == []
    assert sorted(emitted) == sorted(inserted), "every item exactly once"
