"""prefixflow.services.ingestor.takeover (pure rules) and the mover's move: a bucketer node gone for
good has its prompts moved to live nodes, each prompt once, published before the ack."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.ingestor import mover as mover_mod
from prefixflow.services.ingestor.mover import Mover
from prefixflow.services.ingestor.takeover import Takeover, move_id, node_of, place
from prefixflow.shared.bus.poison import PRIOR_DELIVERIES
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import first_block_key
from prefixflow.shared.prefix.sharding import Sharder
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.unit import fakes

pytestmark = pytest.mark.unit

GONE, LIVE = 60.0, 3.0


def rules(since: float = 0.0) -> Takeover:
    return Takeover(GONE, LIVE, since=since)


# --- who is gone -------------------------------------------------------------------------


def test_silent_node_with_prompts_is_gone_after_gone_after_only():
    t = rules()
    heard = {"a": 100.0, "b": 100.0}
    assert t.decide({**heard, "b": 159.0}, {"a": 5}, 159.0).move == ()  # silent 59 s
    d = t.decide({**heard, "b": 160.5}, {"a": 5}, 160.5)
    assert d.move == ("a",) and d.targets == ("b",)


def test_nothing_left_nothing_to_take():
    t = rules()
    assert t.decide({"a": 0.0, "b": 100.0}, {"a": 0}, 100.0).move == ()
    assert t.decide({"a": 0.0, "b": 100.0}, {}, 100.0).move == ()


def test_heartbeat_back_stops_the_takeover():
    t = rules()
    assert t.decide({"a": 0.0, "b": 100.0}, {"a": 5}, 100.0).move == ("a",)
    d = t.decide({"a": 100.5, "b": 100.5}, {"a": 4}, 101.0)
    assert d.move == () and d.stop == ("a",)
    assert t.taking == set()


def test_drained_node_stops():
    t = rules()
    t.decide({"a": 0.0, "b": 100.0}, {"a": 5}, 100.0)
    d = t.decide({"a": 0.0, "b": 101.0}, {"a": 0}, 101.0)
    assert d.stop == ("a",) and d.move == ()


def test_no_live_target_moves_nothing():
    t = rules()
    d = t.decide({"a": 0.0, "b": 10.0}, {"a": 5}, 100.0)  # b silent too (not live)
    assert d.move == () and d.targets == ()


def test_targets_are_live_and_not_gone():
    t = rules()
    d = t.decide({"a": 0.0, "b": 99.0, "c": 96.0, "d": 98.5}, {"a": 1}, 100.0)
    assert d.targets == ("b", "d")


def test_silence_counts_from_start_and_reconnect():
    t = rules(since=50.0)
    # Never heard since we started: gone only gone_after after our start.
    assert t.decide({"b": 100.0}, {"a": 3}, 100.0).move == ()
    t.on_reconnect(105.0)
    assert t.decide({"a": 0.0, "b": 160.0}, {"a": 3}, 160.0).move == ()  # 55 s since the reconnect
    assert t.decide({"a": 0.0, "b": 165.0}, {"a": 3}, 165.0).move == ("a",)


def test_never_heard_node_counts_from_when_its_backlog_showed_up():
    t = rules(since=0.0)
    assert t.decide({"b": 100.0}, {"a": 3}, 100.0).move == ()  # first seen at 100
    assert t.decide({"b": 159.0}, {"a": 3}, 159.0).move == ()
    assert t.decide({"b": 160.0}, {"a": 3}, 160.0).move == ("a",)
    t.decide({"b": 161.0}, {"a": 0}, 161.0)
    assert "a" not in t.first_seen  # forgotten once drained: bounded by the nodes


@given(
    heard=st.dictionaries(st.sampled_from("abcdef"), st.floats(0, 200), max_size=6),
    backlog=st.dictionaries(st.sampled_from("abcdefg"), st.integers(0, 3), max_size=7),
    now=st.floats(0, 300),
)
def test_decisions_are_consistent(heard, backlog, now):
    t = rules()
    t.taking = {"a", "g"}
    d = t.decide(heard, backlog, now)
    assert not set(d.move) & set(d.targets)
    assert not set(d.move) & set(d.stop)
    for node in d.move:
        assert backlog[node] > 0 and t.silent_for(node, heard, now) >= GONE
        assert node not in heard or now - heard[node] >= GONE
    for node in d.targets:
        assert now - heard[node] < LIVE
    assert set(d.stop) == {"a", "g"} - set(d.move)
    assert t.taking == set(d.move)


# --- where prompts go ---------------------------------------------------------------------


def prompt(i: int, prefix: int, n: int = 40) -> m.Prompt:
    return m.Prompt("j", i, tk.pack([prefix] * 20 + [i] * (n - 20)), max_tokens=4)


@given(
    ids=st.lists(st.integers(0, 10_000), unique=True, max_size=60),
    prefixes=st.integers(1, 8),
    targets=st.lists(st.sampled_from(["n1", "n2", "n3", "node-4"]), min_size=1, unique=True),
)
def test_place_moves_every_prompt_once_to_a_target(ids, prefixes, targets):
    prompts = [prompt(i, i % prefixes + 1) for i in ids]
    parts = place(prompts, targets, 16)
    assert set(parts) <= set(targets)
    moved = [p.id for part in parts.values() for p in part]
    assert sorted(moved) == sorted(ids)
    for part in parts.values():  # order kept within a part
        assert [p.id for p in part] == [i for i in ids if any(p.id == i for p in part)]
    assert place(prompts, list(reversed(targets)), 16) == parts  # deterministic, order-free


def test_same_prefix_lands_where_the_ingestor_would_send_it_now():
    """The first choice of the ingestor's sharder among the same nodes, so a moved prompt
    meets the new prompts of its prefix (and one prefix stays on one node)."""
    targets = ["n1", "n2", "n3"]
    prompts = [prompt(i, i % 5 + 1) for i in range(50)]
    parts = place(prompts, targets, 16)
    where = {}
    for node, part in parts.items():
        for p in part:
            key = first_block_key(p.tokens, 16)
            assert Sharder().pick(key, targets) == node
            assert where.setdefault(key, node) == node


def test_place_needs_a_target():
    with pytest.raises(ValueError):
        place([prompt(1, 1)], [], 16)


def test_message_ids_name_the_original_and_the_part():
    assert move_id("PFX_BUCKET", 7, "n1") == move_id("PFX_BUCKET", 7, "n1")
    assert len({move_id("PFX_BUCKET", s, n) for s in (7, 8) for n in ("n1", "n2")}) == 4


def test_node_of_bucket_subject():
    assert node_of(subjects.bucket("node-1", "job7")) == "node-1"
    assert node_of(subjects.work("r0")) is None
    assert node_of(subjects.bucket("", "job7")) is None
    assert node_of(subjects.bucket("node-1", "")) is None
    assert node_of("pfx.bucket.node-1") is None  # the old per-node subject


def test_rules_import_no_nats():
    code = "import sys, prefixflow.services.ingestor.takeover; print(sorted(m for m in sys.modules if m.split('.')[0] in ('nats', 'vllm', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the move: publish every part (with its id), then ack; never nak ----------------------


def FakeMsg(data: bytes, seq: int = 42, delivered: int = 1, headers: dict | None = None) -> fakes.FakeMsg:
    return fakes.FakeMsg(data, seq, delivered, headers, subject=subjects.bucket("gone", "j"), stream="PFX_BUCKET")


def test_move_publishes_each_part_with_its_id_then_acks(monkeypatch):
    published: list[tuple[str, list[int], dict]] = []
    msg = FakeMsg(m.encode(m.PromptBatch([prompt(i, i % 4 + 1) for i in range(30)])), seq=42, delivered=2,
                  headers={PRIOR_DELIVERIES: "1"})

    async def publish(js, subject, payload, headers=None):
        assert "ack" not in msg.calls, "published before the ack"
        published.append((subject, [p.id for p in m.prompt_batch_decoder.decode(payload).prompts], headers))

    monkeypatch.setattr(mover_mod, "publish", publish)
    mover = Mover({}, 60.0, 3.0, 16)
    mover.js = object()
    asyncio.run(mover.move(msg, ("n1", "n2")))
    assert msg.calls == ["ack"]
    assert sorted(i for _, ids, _ in published for i in ids) == list(range(30))
    for subject, _, headers in published:
        node = node_of(subject)
        assert headers["Nats-Msg-Id"] == move_id("PFX_BUCKET", 42, node)
        assert headers[PRIOR_DELIVERIES] == "2"  # 1 before + this one's failed 1st delivery
    assert mover.moved == 1


def test_full_stream_keeps_the_message_leased_never_naks(monkeypatch):
    monkeypatch.setattr(mover_mod.subjects, "IN_PROGRESS_EVERY", 0.01)
    msg = FakeMsg(m.encode(m.PromptBatch([prompt(1, 1)])))

    async def slow_publish(js, subject, payload, headers=None):
        await asyncio.sleep(0.1)  # the stream is full: publish waits

    monkeypatch.setattr(mover_mod, "publish", slow_publish)
    mover = Mover({}, 60.0, 3.0, 16)
    mover.js = object()
    asyncio.run(mover.move(msg, ("n1",)))
    assert "nak" not in msg.calls and msg.calls[-1] == "ack"
    assert msg.calls.count("in_progress") >= 2
