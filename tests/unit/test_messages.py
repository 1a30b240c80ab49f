"""prefixflow.shared.wire.messages: wire structs survive their codecs; validation; schema evolution."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.sampling import user_sampling
from prefixflow.shared.prefix import tokens as tk
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit

ids = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.text(max_size=20))
tokens = st.lists(st.integers(min_value=0, max_value=2**32 - 1), max_size=40).map(tk.pack)

prompts = st.builds(
    m.Prompt,
    job=st.text(min_size=1, max_size=10),
    id=ids,
    tokens=tokens,
    columns=st.binary(max_size=30),
    max_tokens=st.integers(0, 10**6),
)
results = st.builds(
    m.Result,
    id=ids,
    columns=st.binary(max_size=30),
    output=st.text(max_size=30),
    finish_reason=st.sampled_from(list(m.FinishReason)),
    prompt_tokens=st.integers(0, 10**6),
    cached_tokens=st.integers(0, 10**6),
    output_tokens=st.integers(0, 10**6),
    replica=st.text(max_size=5),
    error=st.none() | st.text(max_size=20),
)


# --- msgpack round trips -------------------------------------------------------------


@settings(COSTLY)
@given(st.lists(prompts, max_size=5))
def test_prompt_batch_round_trip(ps):
    batch = m.PromptBatch(ps)
    out = m.prompt_batch_decoder.decode(m.encode(batch))
    assert out == batch
    assert [type(p.id) for p in out.prompts] == [type(p.id) for p in ps]


@settings(COSTLY)
@given(st.text(max_size=10), st.lists(prompts, max_size=4), st.lists(st.integers(0, 2**63 - 1), max_size=5))
def test_work_batch_round_trip(bucket, ps, key):
    batch = m.WorkBatch(bucket, ps, key)
    assert m.work_batch_decoder.decode(m.encode(batch)) == batch


@settings(COSTLY)
@given(st.text(max_size=10), st.lists(results, max_size=5))
def test_result_batch_round_trip(job, rs):
    batch = m.ResultBatch(job, rs)
    out = m.result_batch_decoder.decode(m.encode(batch))
    assert out == batch
    for r in out.results:
        assert isinstance(r.finish_reason, m.FinishReason)


def test_int_and_str_ids_keep_their_type():
    one = tk.pack([1])
    batch = m.PromptBatch([m.Prompt("j", 7, one), m.Prompt("j", "7", one), m.Prompt("j", "", b""), m.Prompt("j", -3, b"")])
    out = m.prompt_batch_decoder.decode(m.encode(batch))
    assert [p.id for p in out.prompts] == [7, "7", "", -3]
    assert [type(p.id) for p in out.prompts] == [int, str, str, int]
    rb = m.result_batch_decoder.decode(m.encode(m.ResultBatch("j", [m.Result(2**63 - 1), m.Result("abc")])))
    assert [r.id for r in rb.results] == [2**63 - 1, "abc"]


def test_defaults_survive_and_are_omitted():
    r = m.Result(5)
    raw = m.encode(m.ResultBatch("j", [r]))
    # array_like: positional, no field names on the wire
    wire = msgspec.msgpack.decode(raw)
    assert wire[0] == "j" and isinstance(wire[1][0], list) and wire[1][0][0] == 5
    out = m.result_batch_decoder.decode(raw).results[0]
    assert out == r
    assert out.error is None and out.finish_reason is m.FinishReason.STOP and out.columns == b""


def test_engine_status_round_trip():
    s = m.EngineStatus(
        replica="r1",
        ts=12.5,
        ready=True,
        running=3,
        waiting=4,
        inflight=7,
        outstanding_tokens=1234,
        kv_usage=0.25,
        kv_blocks=1000,
        block_size=16,
        prompt_tokens=99,
        cached_tokens=50,
        completed=11,
        done_tokens=5000,
        window=32,
    )
    assert m.engine_status_decoder.decode(m.encode(s)) == s
    bare = m.EngineStatus("r2", 1.0)
    assert m.engine_status_decoder.decode(m.encode(bare)) == bare


def test_heartbeat_route_request_route_reply_round_trip():
    hb = m.BucketerHeartbeat("node3", 4.5, buffered=17)
    assert m.heartbeat_decoder.decode(m.encode(hb)) == hb
    rq = m.RouteRequest("b0", prompts=12, tokens=3400, key=[1, 2**62, 3])
    assert m.route_request_decoder.decode(m.encode(rq)) == rq
    bare = m.route_request_decoder.decode(m.encode(m.RouteRequest("b0", 1, 2)))
    assert bare.key == [] and bare.parts == []
    pooled = m.RouteRequest("b0", prompts=5, tokens=50, parts=[m.RoutePart(2, 20, [7, 8]), m.RoutePart(3, 30)])
    out = m.route_request_decoder.decode(m.encode(pooled))
    assert out == pooled and sum(p.prompts for p in out.parts) == out.prompts
    rp = m.RouteReply([m.Assignment("r0", 5), m.Assignment("r1", 7)])
    out = m.route_reply_decoder.decode(m.encode(rp))
    assert out == rp and out.retry_after == 0.0 and out.error is None
    busy = m.RouteReply(retry_after=0.5, error="all capped")
    assert m.route_reply_decoder.decode(m.encode(busy)) == busy


def test_wrong_decoder_rejects():
    with pytest.raises(msgspec.DecodeError):
        m.engine_status_decoder.decode(m.encode(m.BucketerHeartbeat("n", 1.0)))
    with pytest.raises(msgspec.DecodeError):
        m.prompt_batch_decoder.decode(b"\xc1")


# --- JSON (key-value records) ----------------------------------------------------------


def test_job_spec_json_round_trip():
    spec = m.JobSpec(
        "job-1",
        "/tmp/out",
        sampling=m.SamplingSpec(max_tokens=10, min_tokens=2, temperature=0.0, top_p=0.5, top_k=4, seed=3, ignore_eos=True),
        model="tiny",
        created_at=123.5,
        total=42,
    )
    raw = m.encode_json(spec)
    assert raw.startswith(b"{")
    assert m.job_spec_decoder.decode(raw) == spec
    bare = m.JobSpec("j", "/o")
    out = m.job_spec_decoder.decode(m.encode_json(bare))
    assert out == bare and out.total is None and out.sampling == m.SamplingSpec()
    # omit_defaults: defaulted scalars are not written
    wire = msgspec.json.decode(m.encode_json(bare))
    assert {"job": "j", "out_dir": "/o"}.items() <= wire.items()
    assert not {"model", "created_at", "total"} & wire.keys()


def test_job_status_json_round_trip():
    st_ = m.JobStatus("j", rows=10, errors=2, total=12, done=True, updated_at=9.0, summary={"rows": 10, "replicas": {"r0": {"rows": 3}}})
    assert m.job_status_decoder.decode(m.encode_json(st_)) == st_
    assert m.job_status_decoder.decode(b'{"job": "x"}') == m.JobStatus("x")


def test_job_spec_ignores_an_unknown_sampling_field_a_user_gets_it_refused():
    """Lenient on the wire (a newer client's field), strict at the user's boundary."""
    spec = m.job_spec_decoder.decode(b'{"job": "j", "out_dir": "/o", "sampling": {"max_tokens": 5, "max_token": 5}}')
    assert spec.sampling == m.SamplingSpec(max_tokens=5)
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_token`"):
        user_sampling({"max_token": 5})


# --- SamplingSpec validation -------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"max_tokens": 1_000_001},
        {"temperature": -0.01},
        {"top_p": 0.0},
        {"top_p": 1.0001},
        {"top_k": -2},
        {"min_tokens": -1},
        {"max_tokenz": 5},
        {"max_tokens": 5, "min_tokens": 6},
        {"max_tokens": "5"},
    ],
)
def test_sampling_spec_rejects(bad):
    """A user's sampling (`user_sampling`, where it enters) is checked strictly."""
    with pytest.raises((msgspec.ValidationError, ValueError)):
        user_sampling(bad)


@pytest.mark.parametrize(
    "good",
    [
        {},
        {"max_tokens": 1},
        {"max_tokens": 5, "min_tokens": 5},
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_k": -1},
        {"top_k": 0},
        {"seed": 7, "ignore_eos": True},
    ],
)
def test_sampling_spec_accepts(good):
    spec = user_sampling(good)
    assert spec == msgspec.convert(good, m.SamplingSpec)
    for k, v in good.items():
        assert getattr(spec, k) == v


# --- schema evolution: unknown trailing fields are ignored --------------------------------


def test_prompt_work_tokens():
    p = m.Prompt("j", 1, tk.pack([5, 6, 7]), max_tokens=10)
    assert p.work_tokens == 13
    assert m.Prompt("j", 1, b"").work_tokens == 0


def test_array_like_extra_trailing_field_is_ignored():
    t12 = tk.pack([1, 2])
    raw = msgspec.msgpack.encode([[["j", 1, t12, b"c", 64, b"", 3, 7, 90, "a1", 12.5, b"g", "new-field"]], 2, {"new": "batch field"}])
    out = m.prompt_batch_decoder.decode(raw)
    assert out == m.PromptBatch([m.Prompt("j", 1, t12, b"c", 64, src=3, row=7, cost=90, lora="a1", admitted_at=12.5, grant=b"g")],
                                priority=2)
    # A batch from an ingestor that predates priorities: weight 1.
    raw = msgspec.msgpack.encode([[["j", 1, t12]]])
    assert m.prompt_batch_decoder.decode(raw).priority == 1

    raw = msgspec.msgpack.encode(["b1", [["j", "x", tk.pack([3])]], [9, 8], [1], 99])
    assert m.work_batch_decoder.decode(raw) == m.WorkBatch("b1", [m.Prompt("j", "x", tk.pack([3]))], [9, 8], [1])

    raw = msgspec.msgpack.encode({"bucketer": "b", "prompts": 2, "tokens": 4, "parts": [[2, 4, [1], 3, "a1", "extra"]]})
    assert m.route_request_decoder.decode(raw).parts == [m.RoutePart(2, 4, [1], 3, "a1")]
    # ... and a part from before output budgets: not told (-1)
    raw = msgspec.msgpack.encode({"bucketer": "b", "prompts": 2, "tokens": 4, "parts": [[2, 4, [1]]]})
    assert m.route_request_decoder.decode(raw).parts[0].output == -1

    full = ["id7", b"c", "out", 1, 10, 5, 3, "r0", None, "b9", 1.0, 2.0]
    raw = msgspec.msgpack.encode(["job", [full + [[], [], [], 4, 9, "res-1", 1, b"g", "more"]]])  # a newer peer's field after Result.grant
    r = m.result_batch_decoder.decode(raw).results[0]
    assert r == m.Result("id7", b"c", "out", m.FinishReason.LENGTH, 10, 5, 3, "r0", None, "b9", 1.0, 2.0, src=4, row=9, blob="res-1",
                         dedupe=1, grant=b"g")
    # ... and a result from before bucket / started_at / finished_at gets their defaults
    raw = msgspec.msgpack.encode(["job", [full[:9]]])
    assert m.result_batch_decoder.decode(raw).results[0] == m.Result("id7", b"c", "out", m.FinishReason.LENGTH, 10, 5, 3, "r0", None)

    raw = msgspec.msgpack.encode({"assignments": [["r0", 3, 40, "extra"]], "retry_after": 0.0})
    assert m.route_reply_decoder.decode(raw).assignments == [m.Assignment("r0", 3, 40)]


def test_map_structs_ignore_extra_keys():
    raw = msgspec.msgpack.encode({"replica": "r0", "ts": 1.0, "ready": True, "gpu_temp": 71, "future": [1, 2]})
    assert m.engine_status_decoder.decode(raw) == m.EngineStatus("r0", 1.0, ready=True)
    raw = msgspec.msgpack.encode({"node": "n", "ts": 2.0, "zone": "a"})
    assert m.heartbeat_decoder.decode(raw) == m.BucketerHeartbeat("n", 2.0)
    raw = msgspec.msgpack.encode({"bucketer": "b", "prompts": 1, "tokens": 2, "priority": 5})
    assert m.route_request_decoder.decode(raw) == m.RouteRequest("b", 1, 2)
    raw = b'{"job": "j", "out_dir": "/o", "owner": "me"}'
    assert m.job_spec_decoder.decode(raw) == m.JobSpec("j", "/o")
    assert m.job_status_decoder.decode(b'{"job": "j", "rows": 3, "eta": 5}') == m.JobStatus("j", rows=3)


def test_older_message_without_trailing_fields_gets_defaults():
    raw = msgspec.msgpack.encode([[["j", 1, tk.pack([1, 2])]]])  # no columns, no max_tokens
    p = m.prompt_batch_decoder.decode(raw).prompts[0]
    assert (p.columns, p.max_tokens) == (b"", 0)
    raw = msgspec.msgpack.encode(["job", [["id1"]]])
    r = m.result_batch_decoder.decode(raw).results[0]
    assert r == m.Result("id1")
    raw = msgspec.msgpack.encode({"replica": "r0", "ts": 3.0})
    s = m.engine_status_decoder.decode(raw)
    assert (s.ready, s.outstanding_tokens, s.completed, s.done_tokens, s.window) == (False, 0, 0, 0, 0)


def test_columns_decoder():
    cols = msgspec.msgpack.encode({"prompt": "hi", "lang": "en", "n": 3})
    assert m.columns_decoder.decode(cols) == {"prompt": "hi", "lang": "en", "n": 3}
