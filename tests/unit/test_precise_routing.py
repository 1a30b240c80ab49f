"""The router's precise cache model: replicas that send KV events (`CacheEvents`) are
scored by the blocks they hold, the others by their routing history; and the worker's
forwarder that sends those events."""

from __future__ import annotations

import asyncio
import math

import pytest

from prefixflow.services.engine_worker.kv_events import KeyTranslator
from prefixflow.services.engine_worker.kv_subscriber import (
    MAX_KEYS_PER_MESSAGE,
    CacheEventForwarder,
    KvEventSubscriber,
)
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import PrefixAware
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.messages import CacheOp

pytestmark = pytest.mark.unit

NOW = 100.0
K = [11, 12, 13]
"""A bucket's prefix key (three hash blocks)."""


def fleet(*names: str) -> Fleet:
    f = Fleet(cap_tokens=10_000)
    for name in names:
        f.observe(name, NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=0)
    return f


def route(f: Fleet, key, tokens: int = 100) -> str:
    [(r, _)] = PrefixAware(split_factor=math.inf).route(f, NOW, 1, tokens, list(key))
    return r.name


def events(f: Fleet, replica: str, seq: int, *ops, epoch: str = "e1") -> None:
    """A CacheEvents message, through the wire codec, applied to the fleet."""
    msg = m.cache_events_decoder.decode(m.encode(m.CacheEvents(replica, epoch, seq, list(ops))))
    f.apply_cache_events(msg.replica, msg.epoch, msg.seq, msg.ops)


def test_the_cache_overrules_the_history_where_they_disagree():
    """History says `a` has K (it was sent there); a's events say K was evicted and b's that
    b holds two blocks of it. Without events the history decides; with them, the cache."""
    for precise in (False, True):
        f = fleet("a", "b")
        if precise:
            events(f, "a", 0)
            events(f, "b", 0)
        assert route(f, K) == "a"  # nothing held anywhere: least loaded, first name
        f.replicas["a"].outstanding = 0  # the work is done; loads equal again
        if precise:
            events(f, "a", 1, (CacheOp.STORED, K), (CacheOp.REMOVED, K))  # a's engine ran it, then evicted it
            events(f, "b", 1, (CacheOp.STORED, K[:2]))  # b's engine holds its first two blocks
        assert route(f, K) == ("b" if precise else "a")


def test_the_router_measures_where_the_history_would_have_been_wrong():
    """The situation above, counted: the history believes `a` holds K (overestimated) and
    would have preferred `a`; the cache sends it to `b` (misplaced)."""
    f = fleet("a", "b")
    events(f, "a", 0)
    events(f, "b", 0)
    route(f, K)  # nothing held anywhere: both models agree
    assert (f.history_checks.decisions, f.history_checks.wrong, f.history_checks.misplaced) == (1, 0, 0)
    f.replicas["a"].outstanding = 0
    events(f, "a", 1, (CacheOp.STORED, K), (CacheOp.REMOVED, K))
    events(f, "b", 1, (CacheOp.STORED, K[:2]))
    assert route(f, K) == "b"
    checks = f.history_checks
    assert (checks.decisions, checks.wrong, checks.overestimated, checks.misplaced) == (2, 1, 1, 1)
    # a cache that holds what the history says: right, and the same choice
    f.replicas["b"].outstanding = 0
    # The history still believes a holds K (wrong), but picks b, sent K more recently:
    # the same replica as the cache's.
    assert route(f, K) == "b"
    assert (checks.decisions, checks.wrong, checks.misplaced) == (3, 2, 1)


def test_replicas_without_events_keep_the_history():
    f = fleet("a", "b")
    events(f, "a", 0, (CacheOp.STORED, [1]))  # a sends events, b does not
    f.replicas["a"].outstanding = 500
    assert route(f, K) == "b"  # no match anywhere: least loaded
    f.replicas["a"].outstanding = f.replicas["b"].outstanding = 0
    assert f.best_match(f.replicas["b"], K) == (3, 1)  # b's history
    assert route(f, K) == "b"  # b's history beats the first name
    events(f, "a", 1, (CacheOp.STORED, K))
    assert f.matches(K) == {f.replicas["a"]: (3, 0), f.replicas["b"]: (3, 2)}


def test_a_bucket_sent_to_a_precise_replica_counts_as_held_there_at_once():
    """The next bucket of the same prefix must follow it before the engine reports it."""
    f = fleet("a", "b")
    events(f, "a", 0)
    events(f, "b", 0)
    first = route(f, K, tokens=100)
    assert f.blocks.blocks_of(first) == frozenset(K)
    assert route(f, K, tokens=100) == first  # though now the busier one
    policy = PrefixAware(split_factor=math.inf)
    policy.route(f, NOW, 1, 100, K + [14])
    assert policy.last_matches == [3]  # what its cache held before


def test_a_new_epoch_or_a_restarted_worker_starts_from_nothing():
    f = fleet("a", "b")
    events(f, "a", 0, (CacheOp.STORED, K))
    events(f, "a", 1, (CacheOp.STORED, [7]))
    assert f.blocks.blocks_of("a") == {*K, 7}
    events(f, "a", 0, (CacheOp.STORED, [8]), epoch="e2")  # a new worker process
    assert f.blocks.blocks_of("a") == {8}
    events(f, "a", 3, (CacheOp.STORED, [9]), epoch="e2")  # batches 1 and 2 were lost
    assert f.cache_gaps == 2 and f.blocks.blocks_of("a") == {8, 9}
    events(f, "a", 4, (CacheOp.CLEARED, []), (CacheOp.STORED, [5]), epoch="e2")
    assert f.blocks.blocks_of("a") == {5}
    # The worker restarts (its done count goes back) without events: history again.
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=50, kv_blocks=0)
    f.observe("a", NOW, ready=True, outstanding=0, done_tokens=0, kv_blocks=0)
    assert "a" not in f.precise and f.blocks.blocks_of("a") == frozenset()


def forwarder(sent: list[bytes]) -> CacheEventForwarder:
    async def publish(data: bytes) -> None:
        sent.append(data)

    return CacheEventForwarder("r0", KvEventSubscriber("ipc:///nonexistent", KeyTranslator(16)), publish)


def test_forwarder_batches_in_order_cuts_big_batches_and_says_cleared():
    sent: list[bytes] = []
    fw = forwarder(sent)
    many = list(range(MAX_KEYS_PER_MESSAGE + 5))
    fw._add([(CacheOp.STORED, [1, 2]), (CacheOp.STORED, [3])])
    fw._add([(CacheOp.REMOVED, [2]), (CacheOp.STORED, many)])
    asyncio.run(fw.flush())
    msgs = [m.cache_events_decoder.decode(d) for d in sent]
    assert [x.seq for x in msgs] == [0, 1] and {x.epoch for x in msgs} == {fw.epoch}
    assert msgs[0].ops[:3] == [(CacheOp.CLEARED, []), (CacheOp.STORED, [1, 2, 3]), (CacheOp.REMOVED, [2])]
    assert sum(len(k) for x in msgs for _, k in x.ops) == 3 + 1 + len(many)
    assert max(sum(len(k) for _, k in x.ops) for x in msgs) <= MAX_KEYS_PER_MESSAGE
    f = fleet("r0")
    for x in msgs:
        f.apply_cache_events(x.replica, x.epoch, x.seq, x.ops)
    assert f.blocks.blocks_of("r0") == {1, 3, *many}
    # A reset of the engine's cache: whatever was pending is moot.
    fw._add([(CacheOp.STORED, [99])])
    fw.cleared()
    asyncio.run(fw.flush())
    last = m.cache_events_decoder.decode(sent[-1])
    assert last.seq == 2 and last.ops == [(CacheOp.CLEARED, [])]
    f.apply_cache_events(last.replica, last.epoch, last.seq, last.ops)
    assert f.blocks.blocks_of("r0") == frozenset() and f.cache_gaps == 0
