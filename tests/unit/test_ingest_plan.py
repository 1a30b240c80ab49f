"""prefixflow.services.ingestor.plan (pure planning of an ingest batch) and the ingestor's use of it:
tokenizing happens off the event loop."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.ingestor.plan import Incoming, Model, batch_src, plan_batch, poison_rows
from prefixflow.services.ingestor.service import Ingestor
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.sharding import Sharder
from prefixflow.shared.process.config import IngestorConfig
from prefixflow.shared.wire import messages as m
from tests.unit import fakes

pytestmark = pytest.mark.unit


def encode_chars(texts: list[str]) -> list[list[int]]:
    """A stand-in tokenizer: one token per character."""
    return [[ord(c) % 1000 for c in t] for t in texts]


MODEL = Model(encode_batch=encode_chars, vocab_size=1000, max_model_len=64, hash_block_size=4)
SPEC = m.JobSpec(job="j", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=8))


def msg(job: str, body) -> Incoming:
    return Incoming(f"pfx.ingest.{job}", json.dumps(body).encode())


def test_plan_sorts_every_row_into_prompts_errors_or_dead():
    batch = [
        msg("j", {"id": 1, "prompt": "hello world", "gold": "x"}),
        msg("j", {"id": 2, "prompt": ""}),  # empty: error row
        msg("j", {"id": 3, "prompt": "y" * 60}),  # 60 + 8 > 64: error row
        msg("j", {"id": 4, "prompt_token_ids": [5, 2000]}),  # outside vocabulary
        msg("j", {"prompt": "no id"}),  # no id: dead letter
        msg("gone", {"id": 9, "prompt": "hi"}),  # unknown job: dead letter, not failed
        msg("bad", {"id": 10, "prompt": "hi"}),  # invalid spec: dead letter and failed
    ]
    jobs = {
        "j": m.JobLookup(SPEC),
        "gone": m.JobLookup(None, "unknown job 'gone'", exists=False),
        "bad": m.JobLookup(None, "invalid job spec: max_tokens"),
    }
    plan = plan_batch(batch, jobs, MODEL, lambda key: "n0")
    [prompt] = plan.prompts["n0"]
    assert (prompt.id, tk.unpack(prompt.tokens), prompt.max_tokens) == (1, encode_chars(["hello world"])[0], 8)
    # Only model inputs travel: the row's other fields are kept in the batch's blob.
    assert prompt.columns == b"" and prompt.src == plan.src >= m.INGEST_SRC_BASE
    assert msgspec.msgpack.decode(plan.kept["j"][prompt.row]) == {"prompt": "hello world", "gold": "x"}
    errors = {r.id: r.error for r in plan.errors["j"]}
    assert set(errors) == {2, 3, 4}
    assert "empty" in errors[2] and "too long" in errors[3] and "vocabulary" in errors[4]
    assert all(r.finish_reason == m.FinishReason.ERROR for r in plan.errors["j"])
    assert sorted(plan.dead) == [4, 5, 6]
    assert plan.failed_jobs == {"bad": "invalid job spec: max_tokens"}


def test_plan_shards_by_first_block():
    nodes = ["a", "b", "c"]
    sharder = Sharder(epsilon=100.0)
    batch = [msg("j", {"id": i, "prompt": f"{'abcd' if i % 2 else 'wxyz'}-{i}"}) for i in range(40)]
    plan = plan_batch(batch, {"j": m.JobLookup(SPEC)}, MODEL, lambda key: sharder.pick(key, nodes))
    node_of = {p.id: node for node, ps in plan.prompts.items() for p in ps}
    assert len(node_of) == 40
    assert len({node_of[i] for i in range(1, 40, 2)}) == 1, "one first block, one node"
    assert len({node_of[i] for i in range(0, 40, 2)}) == 1


def test_poison_rows_keep_every_recoverable_id():
    rows = poison_rows(Incoming("pfx.ingest.j", json.dumps([{"id": 1, "prompt": "a"}, {"id": 2}]).encode()), "poison")
    assert [(job, r.id, r.error) for job, r in rows] == [("j", 1, "poison"), ("j", 2, "poison")]


class FakeMsg:
    def __init__(self, subject: str, data: bytes, seq: int = 1) -> None:
        self.subject, self.data, self.headers = subject, data, None
        self.metadata = fakes.meta(seq, 1, "PFX_INGEST")
        self.acked = False

    async def ack(self) -> None:
        self.acked = True


def test_ingestor_tokenizes_off_the_event_loop(monkeypatch):
    """A big batch's tokenization must not stall the loop (heartbeats, acks): it runs in a
    worker thread."""
    threads: list[bool] = []

    def encode(texts):
        threads.append(threading.current_thread() is threading.main_thread())
        return encode_chars(texts)

    ing = Ingestor.__new__(Ingestor)
    ing.cfg = IngestorConfig()
    ing.model = Model(encode, 1000, 64, 4)
    ing.bucketers, ing.sharder = {"node0": time.monotonic()}, Sharder()
    published: list[str] = []

    async def lookup(job):
        return m.JobLookup(SPEC)

    async def publish(js, subject, payload, **kw):
        published.append(subject)

    async def put_blob(js, nc, job, key, data):
        published.append(f"blob {job}/{key}")

    monkeypatch.setattr(ing, "lookup", lookup)
    monkeypatch.setattr("prefixflow.services.ingestor.service.publish", publish)
    monkeypatch.setattr("prefixflow.services.ingestor.service.put_blob", put_blob)
    ing.js = ing.nc = None
    msgs = [FakeMsg("pfx.ingest.j", json.dumps({"id": i, "prompt": "abc"}).encode(), seq=7 + i) for i in range(3)]
    asyncio.run(ing.handle(msgs))
    assert threads == [False], "tokenized once, in a worker thread"
    # The rows' other fields (their `prompt`) are stored before the prompts that refer to them.
    assert published == [f"blob j/in-{batch_src([7, 8, 9])}", "pfx.bucket.node0.j"] and all(x.acked for x in msgs)


def test_prompts_go_only_to_nodes_a_bucketer_reported():
    """No guessed node: a prompt sent to a node no bucketer runs on would wait forever."""
    ing = Ingestor.__new__(Ingestor)
    ing.bucketers = {}
    assert ing.live_nodes() == []  # the ingestor fetches nothing until a bucketer reports
    now = time.monotonic()
    ing.bucketers = {"b": now, "a": now - 60}
    assert ing.live_nodes() == ["b"]  # only the live ones while any is
    ing.bucketers = {"b": now - 30, "a": now - 60}
    assert ing.live_nodes() == ["a", "b"]  # none live (a late heartbeat): the known ones keep their streams


@given(st.lists(st.integers(0, 2**40), min_size=1, max_size=6, unique=True), st.lists(st.integers(0, 2**40), max_size=5))
def test_a_batch_blob_is_named_by_its_messages(seqs, others):
    seqs = sorted(seqs)
    src = batch_src(seqs)
    assert m.INGEST_SRC_BASE <= src < m.INGEST_SRC_BASE + (1 << 56) and src == batch_src(list(seqs))
    regrouped = sorted(set(seqs[:1] + others))  # the same first message, other messages with it
    if regrouped != seqs:
        assert batch_src(regrouped) != src


@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=8), min_size=1, max_size=4))
def test_rows_of_every_attempt_find_their_own_fields_after_redeliveries(attempts):
    """Torture seed 7 round 53: after a crash, the unacked messages came again grouped
    otherwise under the same first message; the old blob name (the first message's
    sequence) let the new grouping overwrite the blob the first attempt's published rows
    pointed into (a row came out with another row's prompt). Every attempt's rows (good
    and error rows) must find their own fields in the blobs as the last write left them."""
    rows = [{"id": i, "prompt": "" if i == 3 else f"prompt {i}", "tag": f"t{i}"} for i in range(8)]  # 3: error row
    blobs: dict[int, list[bytes]] = {}
    refs = []
    for attempt in attempts:
        seqs = sorted(set(attempt))
        batch = [Incoming("pfx.ingest.j", json.dumps(rows[s]).encode(), seq=100 + s) for s in seqs]
        plan = plan_batch(batch, {"j": m.JobLookup(SPEC)}, MODEL, lambda key: "n0")
        blobs[plan.src] = plan.kept["j"]  # put_blob: the last write of a name wins
        refs += [(p.id, p.src, p.row) for p in plan.prompts["n0"]] + [(r.id, r.src, r.row) for r in plan.errors["j"]]
    for rid, src, row in refs:
        fields = msgspec.msgpack.decode(blobs[src][row])
        assert fields == {k: v for k, v in rows[rid].items() if k != "id"}, (rid, fields)


def test_a_rows_work_counts_every_completion_it_asks_for():
    """Issue 40: a row asking `n` completions is `n` times the output work (load, routing,
    KV admission go by `Prompt.max_tokens`); its length check is per completion."""
    from prefixflow.services.engine_worker.feeder import Held, max_tokens

    spec = m.JobSpec(job="j", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=8, temperature=1.0, n=3))
    batch = [msg("j", {"id": 1, "prompt": "hello world"}),
             msg("j", {"id": 2, "prompt": "hello there", "sampling": {"n": 5}}),
             msg("j", {"id": 3, "prompt": "z" * 50})]  # 50 + 8 <= 64: fits, whatever n
    plan = plan_batch(batch, {"j": m.JobLookup(spec)}, MODEL, lambda key: "n0")
    budgets = {p.id: p.max_tokens for p in plan.prompts["n0"]}
    assert budgets == {1: 24, 2: 40, 3: 24} and not plan.errors.get("j")
    held = {p.id: Held(None, p, m.JobLookup(spec), "b") for p in plan.prompts["n0"]}
    assert (max_tokens(held[1]), max_tokens(held[2])) == (24, 40)
