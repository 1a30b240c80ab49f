"""No message is too large: batches are cut by their encoded size (`messages.encode_batches`),
an item too large alone is flagged, the prompt bound holds, the echo engine gives the
vLLM engine's fields and sizes, and the outbox stores a result too large for a message
by reference (and the sink reads it back) while cutting the rest by size."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.engines.echo import EchoEngine, InstantEchoEngine, echo_completion
from prefixflow.services.engine_worker.outbox import Outbox
from prefixflow.services.sink import large
from prefixflow.shared.bus.blobs import BlobMissing
from prefixflow.shared.bus.ledger import AckLedger
from prefixflow.shared.bus.publish import HEADROOM, MessageTooLarge, message_limit, publish
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m
from tests.unit.fakes import FakeJS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

ids = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=20))
token_lists = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=300)
prompts = st.builds(
    m.Prompt, job=st.text(min_size=1, max_size=10), id=ids, tokens=token_lists.map(tk.pack),
    max_tokens=st.integers(0, 10**6), sampling=st.binary(max_size=50),
    src=st.integers(-1, 2**62), row=st.integers(-1, 2**31),
)
results = st.builds(
    m.Result, id=ids, output=st.text(max_size=400), prompt_tokens=st.integers(0, 10**6),
    outputs=st.lists(st.text(max_size=100), max_size=5),
    logprobs=st.lists(st.fixed_dictionaries({"token": st.text(max_size=5), "logprob": st.floats(allow_nan=False)}),
                      max_size=20),
    embedding=st.lists(st.floats(allow_nan=False), max_size=60),
    error=st.one_of(st.none(), st.text(max_size=50)),
)


def check_batches(items, wrap, decode, max_bytes, max_items):
    batches = m.encode_batches(items, wrap, max_bytes, max_items)
    got = []
    for b in batches:
        run = decode(b.data)
        assert len(run) == b.stop - b.start and len(run) <= max_items
        assert b.oversized == (len(b.data) > max_bytes)
        if b.oversized:  # only ever an item too large on its own
            assert len(run) == 1 and m.encoded_size(run[0]) + m.envelope_size(wrap) > max_bytes
        got.extend(run)
    assert [b.start for b in batches] == [0, *(b.stop for b in batches[:-1])][: len(batches)]  # in order, no gap
    assert got == list(items), "the batches concatenate back to the input"
    return batches


@given(st.lists(prompts, max_size=40), st.integers(64, 20_000), st.integers(1, 50))
def test_prompt_batches_encode_under_the_limit_and_concatenate_back(items, max_bytes, max_items):
    check_batches(items, m.PromptBatch, lambda d: m.prompt_batch_decoder.decode(d).prompts, max_bytes, max_items)


@given(st.lists(results, max_size=40), st.integers(64, 20_000), st.integers(1, 50), st.text(min_size=1, max_size=64))
def test_result_batches_encode_under_the_limit_and_concatenate_back(items, max_bytes, max_items, job):
    batches = check_batches(items, lambda run: m.ResultBatch(job, run),
                            lambda d: m.result_batch_decoder.decode(d).results, max_bytes, max_items)
    assert all(m.result_batch_decoder.decode(b.data).job == job for b in batches)


@given(st.lists(prompts, max_size=30), st.integers(256, 20_000), st.lists(st.integers(0, 2**64 - 1), max_size=100))
def test_work_batches_count_their_key_and_bucket_id(items, max_bytes, key):
    wrap = lambda run: m.WorkBatch("b" * 12, run, key)  # noqa: E731
    check_batches(items, wrap, lambda d: m.work_batch_decoder.decode(d).prompts, max_bytes, 1000)


@given(st.lists(st.integers(0, 5000), max_size=60), st.integers(1, 6000), st.integers(1, 20))
def test_runs_by_size_fill_greedily(sizes, budget, max_items):
    runs = m.runs_by_size(sizes, budget, max_items)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for k, r in enumerate(runs):
        total = sum(sizes[i] for i in r)
        assert len(r) <= max_items and (total <= budget or len(r) == 1)
        if k + 1 < len(runs):  # a run ends only where the next item would not fit
            assert len(r) == max_items or total + sizes[r.stop] > budget


def test_a_batch_is_cut_by_its_real_size_not_a_guess():
    """Rows whose real encoding is far larger than a text-length guess (logprobs, embeddings)."""
    row = m.Result(1, output="x", logprobs=[{"token": "a", "logprob": -1.0, "top": [{"token": "b", "logprob": -2.0}] * 20}] * 200)
    size = m.encoded_size(row)
    batches = m.encode_batches([row] * 10, lambda run: m.ResultBatch("j", run), 3 * size + 100, 64)
    assert [b.stop - b.start for b in batches] == [3, 3, 3, 1]
    assert all(len(b.data) <= 3 * size + 100 for b in batches)


@given(prompts, st.integers(1, 256), st.integers(1000, 100_000))
def test_prompt_fits_is_an_upper_bound_of_its_work_batch(p, block, max_bytes):
    """A prompt the ingestor lets through fits a work batch alone with the longest key
    its bucket can have, a bucket id and the prompt-batch framing."""
    key = [2**64 - 1] * (p.prompt_tokens // block)
    alone = max(m.encoded_size(m.WorkBatch("f" * 12, [p], key)), m.encoded_size(m.PromptBatch([p])))
    if m.prompt_fits(p, max_bytes, block):
        assert alone <= max_bytes


def test_message_limit_asks_the_connection():
    class Conn:
        max_payload = 64 * 1024 * 1024

    class JS:
        _nc = Conn()

    assert message_limit(JS(), 8 * 1024 * 1024) == 8 * 1024 * 1024 - HEADROOM  # the stream's limit is lower
    Conn.max_payload = 1024 * 1024
    assert message_limit(JS(), 8 * 1024 * 1024) == 1024 * 1024 - HEADROOM
    Conn.max_payload = 256 * 1024  # a server configured lower: never an assumed 1 MiB
    assert message_limit(Conn(), 8 * 1024 * 1024) == 256 * 1024 - HEADROOM


def test_publish_raises_a_typed_error_instead_of_maxpayload():
    js = FakeJS(1000)
    with pytest.raises(MessageTooLarge):
        asyncio.run(publish(js, "pfx.results.j", b"x" * 1001))
    with pytest.raises(MessageTooLarge):  # headers count toward the server's limit
        asyncio.run(publish(js, "pfx.results.j", b"x" * 990, headers={"Pfx-Error": "y" * 20}))
    asyncio.run(publish(js, "pfx.results.j", b"x" * 1000))
    assert len(js.published) == 1


def test_publish_waits_out_a_full_reconnect_buffer():
    import nats.errors

    class Flaky(FakeJS):
        fails = 2

        async def publish(self, subject, payload, timeout=None, headers=None):
            if self.fails:
                self.fails -= 1
                raise nats.errors.OutboundBufferLimitError
            await super().publish(subject, payload, timeout, headers)

    js = Flaky()
    asyncio.run(publish(js, "pfx.results.j", b"x"))
    assert len(js.published) == 1 and js.fails == 0


def test_outbox_stores_a_result_too_large_by_reference_and_the_sink_reads_it_back():
    js = FakeJS(64 * 1024)
    ledger = AckLedger()
    outbox = Outbox(js, ledger, origin="r0", batch=64, linger=1.0, on_published=lambda: None)
    big = echo_completion(list(range(100)), m.SamplingSpec(max_tokens=800, min_tokens=800, logprobs=20))
    small = [m.Result(i, output="o" * 3000) for i in range(40)]  # 120 KB in all: more than one message
    huge = m.Result("big", output=big.output, logprobs=big.logprobs, output_tokens=big.output_tokens, replica="r0")
    rows = [*small[:20], huge, *small[20:]]

    async def go():
        for r in rows:
            await outbox.add("j", r, None)
        await outbox.flush("j")

    released: list = []

    async def done(lease, n):
        released.append(n)

    ledger.done = done
    asyncio.run(go())
    batches = [m.result_batch_decoder.decode(d) for s, d, _ in js.published if s == "pfx.results.r0.j"]
    assert len(batches) >= 2 and all(len(d) <= message_limit(js) for s, d, _ in js.published)
    sent = [r for b in batches for r in b.results]
    assert [r.id for r in sent] == [r.id for r in rows] and sum(released) == len(rows)
    (stand_in,) = [r for r in sent if r.blob]
    assert stand_in.id == "big" and stand_in.blob.startswith("res-") and not stand_in.logprobs
    assert stand_in.output_tokens == huge.output_tokens and stand_in.replica == "r0"
    assert any(s.startswith(f"pfx.blob.j.{stand_in.blob}.") for s, _, _ in js.published)

    resolved = [asyncio.run(large.resolve(js, b)) for b in batches]
    assert [r for b in resolved for r in b.results] == rows, "the sink gets every row whole"


def test_sink_turns_a_lost_blob_into_an_error_row():
    js = FakeJS()
    stand_in = m.Result(7, blob="res-gone", output_tokens=3, replica="r1")
    (row,) = asyncio.run(large.resolve(js, m.ResultBatch("j", [stand_in]))).results
    assert row.id == 7 and row.finish_reason == m.FinishReason.ERROR and "gone" in row.error and row.replica == "r1"
    assert issubclass(BlobMissing, KeyError)


def test_sink_hands_back_a_message_whose_blob_cannot_be_read_now():
    import nats.errors

    class Away(FakeJS):
        async def get_last_msg(self, stream, subject):
            raise nats.errors.TimeoutError

    class Msg:
        naked = None

        async def nak(self, delay=None):
            self.naked = delay

    msg = Msg()
    batch = m.ResultBatch("j", [m.Result(1, output="fine"), m.Result(2, blob="res-x")])
    assert asyncio.run(large.resolve_or_hand_back(Away(), batch, msg)) is None and msg.naked is not None
    plain = m.ResultBatch("j", [m.Result(1, output="fine")])
    assert asyncio.run(large.resolve_or_hand_back(Away(), plain, msg)) is plain


def test_echo_gives_the_vllm_engines_fields_and_sizes():
    tokens = list(range(5, 45))
    sampling = m.SamplingSpec(max_tokens=3000, min_tokens=3000, logprobs=20)
    c = echo_completion(tokens, sampling)
    assert len(c.output.split()) == 3000 == c.output_tokens and len(c.logprobs) == 3000
    assert all(set(t) == {"token", "logprob", "top"} and len(t["top"]) == 21 for t in c.logprobs)
    assert c.outputs == []  # n == 1: vLLM's adapter leaves `outputs` empty too
    c = echo_completion(tokens, m.SamplingSpec(max_tokens=1000, min_tokens=1000, n=16))
    assert len(c.outputs) == 16 and all(len(o.split()) == 1000 for o in c.outputs) and c.output_tokens == 16_000
    assert c.output == c.outputs[0] and c.logprobs == []
    c = echo_completion(tokens, m.SamplingSpec(), task="embed", embed_dim=8192)
    assert len(c.embedding) == 8192 and c.output == "" and c.output_tokens == 0 and c.prompt_tokens == 40
    # Plain rows as before: the prompt's last tokens, at most max_tokens of them.
    assert echo_completion([1, 2, 3], m.SamplingSpec(max_tokens=2)).output == "2 3"

    async def both():
        slow = EchoEngine(0.001, task="generate")
        instant = InstantEchoEngine(task="embed", embed_dim=16)
        a = await slow.generate("r", 1, tokens, sampling)
        (b,) = await instant.generate_batch([(tk.pack(tokens), m.SamplingSpec())])
        (p,) = await InstantEchoEngine(task="generate").generate_batch([(tk.pack(tokens), m.SamplingSpec(max_tokens=2))])
        return a, b, p

    a, b, p = asyncio.run(both())
    assert len(a.logprobs) == 3000 and len(b.embedding) == 16 and p.output == "2 tokens"


def test_a_result_too_large_for_one_message_is_what_crashed_the_worker():
    """The issue's row, for scale: logprobs 20 on 2,500 tokens is well over 1 MiB."""
    c = echo_completion(list(range(100)), m.SamplingSpec(max_tokens=2500, min_tokens=2500, logprobs=20))
    r = m.Result(1, output=c.output, logprobs=c.logprobs)
    assert m.encoded_size(r) > 1024 * 1024
    assert msgspec.msgpack.decode(m.encode(r), type=m.Result) == r


def test_ingestor_cuts_prompt_batches_by_size_and_makes_a_prompt_too_large_an_error_row():
    from prefixflow.services.ingestor.plan import Plan
    from prefixflow.services.ingestor.service import Ingestor
    from prefixflow.shared.process.config import IngestorConfig

    ing = Ingestor.__new__(Ingestor)
    ing.cfg = IngestorConfig()
    ing.js = js = FakeJS(64 * 1024)
    plan = Plan()
    prompts = [m.Prompt("j", i, tk.pack(list(range(2000))), max_tokens=16) for i in range(20)]  # 8 KB each
    huge = m.Prompt("j", "huge", tk.pack(list(range(20_000))), max_tokens=16)  # 80 KB: no message takes it
    plan.prompts["node0"] = [*prompts[:10], huge, *prompts[10:]]
    plan.errors["j"] = [m.error_result("bad", "empty prompt")]
    asyncio.run(ing.publish(plan, [], {"j": 2}))
    limit = message_limit(js)
    assert all(len(d) <= limit for _, d, _ in js.published)
    batches = [m.prompt_batch_decoder.decode(d) for s, d, _ in js.published if s == "pfx.bucket.node0.j"]
    sent = [p for b in batches for p in b.prompts]
    assert sent == prompts and len(batches) >= 3
    assert {b.priority for b in batches} == {2}  # the job's weight travels with its prompts
    errors = {r.id: r.error for s, d, _ in js.published if s == "pfx.results._ingestor.j" for r in m.result_batch_decoder.decode(d).results}
    assert errors.keys() == {"bad", "huge"} and "too large for one message" in errors["huge"]


def test_dead_letters_fit_beside_their_headers():
    from prefixflow.shared.bus.poison import dead_payload

    js = FakeJS(64 * 1024)
    headers = {"Pfx-Error": "x" * 512}
    data = dead_payload(js, b"y" * 64 * 1024, headers)  # a foreign message of the whole max_payload
    assert len(data) == message_limit(js) and headers["Pfx-Truncated"] == str(64 * 1024)
    asyncio.run(publish(js, "pfx.dead.pfx.ingest.j", data, headers=headers))
    small = {"Pfx-Error": "x"}
    assert dead_payload(js, b"z" * 10, small) == b"z" * 10 and "Pfx-Truncated" not in small
