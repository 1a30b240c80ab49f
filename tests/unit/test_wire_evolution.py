"""Wire messages are lenient, user input is strict (issue 38, item 5).

Each message type decodes as a newer peer would send it, with a field this version does
not know (ignored); a user's unknown sampling field is still refused where a user's input
enters: the CLI, the client's job creation, the batch API's request bodies and an input
row's own `sampling` (checked by the ingestor)."""

from __future__ import annotations

import json

import msgspec
import pytest

from prefixflow.cli.main import parse_args, sampling_from
from prefixflow.client.openai_batch import parse_line
from prefixflow.services.engine_worker.requests import prompt_sampling
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.sampling import row_sampling, user_sampling

pytestmark = pytest.mark.unit

NEW = {"added_by_a_newer_peer": [1, {"nested": True}]}
"""A field this version does not know, as a newer peer would add it."""


def newer(struct: msgspec.Struct, **extra) -> dict:
    """`struct` as a map with the newer peer's field(s) added."""
    return {**msgspec.to_builtins(struct), **NEW, **extra}


# --- (1) every wire message decodes with a field it does not know ----------------------


def test_job_spec_with_a_newer_sampling_and_structured_field_decodes():
    spec = m.JobSpec("j", "/o", m.SamplingSpec(max_tokens=7, structured=m.StructuredSpec(choice=["a", "b"])))
    raw = newer(spec)
    raw["sampling"] = newer(spec.sampling, min_p=0.1)
    raw["sampling"]["structured"] = newer(spec.sampling.structured, whitespace_pattern=" ")
    assert m.job_spec_decoder.decode(json.dumps(raw).encode()) == spec


def test_job_status_decodes():
    st = m.JobStatus("j", rows=3, done=True)
    assert m.job_status_decoder.decode(json.dumps(newer(st)).encode()) == st


def test_a_prompts_own_sampling_from_a_newer_ingestor_reaches_the_engine():
    own = m.SamplingSpec(max_tokens=3, temperature=0.0)
    data = msgspec.msgpack.encode(newer(own, min_p=0.05))
    assert m.sampling_decoder.decode(data) == own
    prompt = m.Prompt("j", 1, tk.pack([1, 2]), sampling=data)
    assert prompt_sampling(prompt, m.SamplingSpec()) == own


def test_array_like_batches_decode_with_trailing_fields():
    t = tk.pack([1, 2, 3])
    full = ["j", 1, t, b"", 4, b"", 2, 5, 9, "a", 12.5, b"g", "new"]  # every field of a Prompt, and one more
    assert m.prompt_batch_decoder.decode(msgspec.msgpack.encode([[full], 3, "new"])) == m.PromptBatch(
        [m.Prompt("j", 1, t, max_tokens=4, src=2, row=5, cost=9, lora="a", admitted_at=12.5, grant=b"g")], priority=3
    )
    assert m.work_batch_decoder.decode(msgspec.msgpack.encode(["b", [full], [7], [1], "new"])) == m.WorkBatch(
        "b", [m.Prompt("j", 1, t, max_tokens=4, src=2, row=5, cost=9, lora="a", admitted_at=12.5, grant=b"g")], [7], [1]
    )
    result = ["id", b"", "out", 0, 1, 0, 1, "r0", None, "b", 1.0, 2.0, ["out"], [], [], -1, -1, "", 0, b"g", "new"]
    step = [0.01, 1e-4, 2e-4, 2048, 256, 65536, "new"]  # a StepModel, and one more
    batch = m.result_batch_decoder.decode(msgspec.msgpack.encode(["j", [result], 1.5, step, "new"]))
    assert batch.results[0].outputs == ["out"] and batch.decode_cost == 1.5
    assert batch.step == m.StepModel(0.01, 1e-4, 2e-4, 2048, 256, 65536)
    events = m.CacheEvents("r0", "e1", 4, [(m.CacheOp.STORED, [1, 2])], ts=5.0)
    raw = msgspec.msgpack.encode(["r0", "e1", 4, [[0, [1, 2]]], 5.0, "new"])
    assert m.cache_events_decoder.decode(raw) == events


@pytest.mark.parametrize(
    "decoder,message",
    [
        (m.engine_status_decoder, m.EngineStatus("r0", 1.0, ready=True, inflight=3, adapters=["a"])),
        (m.heartbeat_decoder, m.BucketerHeartbeat("n", 2.0, buffered=4)),
        (m.route_request_decoder, m.RouteRequest("b", 2, 8, [1], [m.RoutePart(2, 8, [1])], "bk", 4, "a")),
        (m.route_reply_decoder, m.RouteReply([m.Assignment("r0", 2, 9)])),
        (m.router_room_decoder, m.RouterRoom(100, 2, False)),
        (msgspec.msgpack.Decoder(m.DoneQuery), m.DoneQuery([1, "x"])),
        (msgspec.msgpack.Decoder(m.DoneReply), m.DoneReply([True], on_disk=1)),
        (m.set_policy_decoder, m.SetPolicy("round-robin")),
        (m.set_scheduling_decoder, m.SetScheduling("fcfs")),
        (m.control_reply_decoder, m.ControlReply(False, "busy")),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, msgspec.Struct) else "",
)
def test_map_messages_decode_with_a_new_field(decoder, message):
    assert decoder.decode(msgspec.msgpack.encode(newer(message))) == message


def test_an_older_routers_in_band_error_still_decodes():
    """Routers now answer a failure as a nats.micro error reply; an older one set `error`."""
    raw = msgspec.msgpack.encode({"retry_after": 1.0, "error": "boom", **NEW})
    assert m.route_reply_decoder.decode(raw) == m.RouteReply(retry_after=1.0, error="boom")


def test_control_messages_are_tagged():
    assert msgspec.msgpack.decode(m.encode(m.SetPolicy("daft"))) == {"kind": "policy", "name": "daft"}
    assert msgspec.msgpack.decode(m.encode(m.ControlReply(True, "fcfs"))) == {"kind": "reply", "ok": True, "detail": "fcfs"}
    with pytest.raises(msgspec.ValidationError):  # a reply is no policy request
        m.set_policy_decoder.decode(m.encode(m.ControlReply(True)))
    with pytest.raises(msgspec.ValidationError):  # raw text, as before: refused (a 400 reply)
        m.set_policy_decoder.decode(b"daft")


# --- (2) a user's unknown sampling field is still refused -----------------------------


def test_user_sampling_refuses_unknown_fields_at_both_levels():
    with pytest.raises(msgspec.ValidationError, match="unknown field `temprature`"):
        user_sampling({"temprature": 0.5})
    with pytest.raises(msgspec.ValidationError, match=r"unknown field `regx` - at `\$.structured`"):
        user_sampling({"structured": {"regx": "a+"}})
    assert user_sampling({"temperature": 0.5, "structured": {"regex": "a+"}}) == m.SamplingSpec(
        temperature=0.5, structured=m.StructuredSpec(regex="a+")
    )


def test_cli_refuses_an_unknown_sampling_option():
    with pytest.raises(SystemExit):  # argparse: no such option
        parse_args(["submit", "x.jsonl", "--out", "o", "--temprature", "0.5"])
    spec = sampling_from(parse_args(["submit", "x.jsonl", "--out", "o", "--temperature", "0.5", "--stop", "!"]))
    assert spec == m.SamplingSpec(temperature=0.5, stop=["!"])


def test_client_job_creation_takes_only_known_fields():
    """The client (`prefixflow.client.submit.submit`) takes a `SamplingSpec`, built by keyword."""
    with pytest.raises(TypeError, match="temprature"):
        m.SamplingSpec(temprature=0.5)


def test_batch_api_request_with_an_unknown_sampling_field_is_refused():
    """A request body's unknown field goes to its row's `sampling`, which the ingestor
    checks strictly (`row_sampling`): the request becomes an error row naming it."""
    line = json.dumps({"custom_id": "c1", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "hi", "max_tokens": 4, "temprature": 0.5}})
    _, _, _, row = parse_line(1, line, set())
    assert row["sampling"] == {"max_tokens": 4, "temprature": 0.5}
    with pytest.raises(ValueError, match="unknown field `temprature`"):
        row_sampling(m.SamplingSpec(), row)


def test_an_input_rows_unknown_sampling_field_is_refused():
    with pytest.raises(ValueError, match="unknown field `temprature`"):
        row_sampling(m.SamplingSpec(), {"prompt": "hi", "sampling": {"temprature": 0.5}})
    with pytest.raises(ValueError, match="unknown field `regx`"):
        row_sampling(m.SamplingSpec(), {"prompt": "hi", "sampling": {"structured": {"regx": "a"}}})
