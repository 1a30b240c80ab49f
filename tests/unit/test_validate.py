"""prefixflow.services.ingestor.validate: parsing one ingest message into a Record or a Rejected."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.ingestor.validate import ID_HEADER, PLAN_FIELDS, Record, Rejected, header_id, length_error, parse
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire.messages import ROW_FIELD, SRC_FIELD

pytestmark = pytest.mark.unit


def cols(rec: Record) -> dict:
    return msgspec.msgpack.decode(rec.columns)


# --- good messages ---------------------------------------------------------------------


def test_json_body():
    rec = parse(b'{"id": 3, "prompt": "hello"}')
    assert isinstance(rec, Record)
    assert (rec.id, rec.prompt) == (3, "hello")
    assert cols(rec) == {"prompt": "hello"}


def test_json_body_with_leading_whitespace():
    for lead in (b" ", b"\n", b"\t", b"  \n\t "):
        rec = parse(lead + b'{"id": "a", "prompt": "p"}')
        assert isinstance(rec, Record), lead
        assert rec.id == "a"


def test_msgpack_body():
    rec = parse(msgspec.msgpack.encode({"id": "doc-1", "prompt": "hi there", "lang": "en"}))
    assert isinstance(rec, Record)
    assert (rec.id, rec.prompt) == ("doc-1", "hi there")
    assert cols(rec) == {"prompt": "hi there", "lang": "en"}


def test_extra_columns_carried_without_id():
    body = {"id": 9, "prompt": "x y", "lang": "fr", "n": 4, "nested": {"a": [1, 2]}, "none": None}
    for data in (json.dumps(body).encode(), msgspec.msgpack.encode(body)):
        rec = parse(data)
        assert isinstance(rec, Record)
        c = cols(rec)
        assert "id" not in c
        assert c == {k: v for k, v in body.items() if k != "id"}


def test_header_id_does_not_override_body_id():
    rec = parse(b'{"id": 1, "prompt": "p"}', {ID_HEADER: "2"})
    assert isinstance(rec, Record) and rec.id == 1


# --- rejections ------------------------------------------------------------------------


def test_bad_json_with_header_id():
    r = parse(b'{"id": 5, "prompt": ', {ID_HEADER: "5"})
    assert isinstance(r, Rejected)
    assert r.id == 5
    assert "malformed" in r.error


def test_bad_json_with_str_header_id():
    r = parse(b"{not json", {ID_HEADER: '"row-7"'})
    assert r == Rejected("row-7", r.error) and "malformed" in r.error


def test_bad_json_without_header():
    r = parse(b'{"id": 5, "prompt": ')
    assert isinstance(r, Rejected)
    assert r.id is None
    assert "malformed" in r.error


@pytest.mark.parametrize("data", [b"", b"\xc1", b"garbage", msgspec.msgpack.encode([1, 2]), b" [1, 2]", b"\x93\x01\x02\x03"])
def test_undecodable_or_not_a_map(data):
    r = parse(data, {ID_HEADER: "11"})
    assert isinstance(r, Rejected)
    assert r.id == 11
    assert r.error
    assert parse(data) == Rejected(None, r.error)


@pytest.mark.parametrize("data", [b"", b"garbage", b" [1, 2]", b'{"id": 1,'])
def test_malformed_text_bodies_say_malformed(data):
    r = parse(data)
    assert isinstance(r, Rejected) and r.id is None
    assert r.error.startswith("malformed message")


@pytest.mark.parametrize(
    "data",
    [msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({1: 2}), msgspec.msgpack.encode({"id": 1, "prompt": "\u00e9\u00e9"})[:-1]],
)
def test_malformed_msgpack_not_labelled_utf8(data):
    r = parse(data)
    assert isinstance(r, Rejected)
    assert "UTF-8" not in r.error
    assert "malformed" in r.error


def test_invalid_utf8_in_json_string():
    r = parse(b'{"id": 3, "prompt": "\xff\xfe"}', {ID_HEADER: "3"})
    assert isinstance(r, Rejected)
    assert r.id == 3
    assert "UTF-8" in r.error
    r = parse(b'{"id": 3, "prompt": "\xff\xfe"}')
    assert isinstance(r, Rejected) and r.id is None and "UTF-8" in r.error


def test_invalid_utf8_in_msgpack_string():
    data = b"\x82\xa2id\x03\xa6prompt\xa2\xff\xfe"  # {"id": 3, "prompt": <2 invalid bytes>}
    r = parse(data, {ID_HEADER: "3"})
    assert isinstance(r, Rejected)
    assert r.id == 3
    assert "UTF-8" in r.error


@pytest.mark.parametrize("prompt", ["", " ", "\n\t  ", "\u3000"])
def test_empty_prompt(prompt):
    r = parse(json.dumps({"id": 1, "prompt": prompt, "tag": 7}).encode())
    assert (r.id, r.error) == (1, "empty prompt")
    assert msgspec.msgpack.decode(r.columns) == {"prompt": prompt, "tag": 7}  # its error row keeps its fields


@pytest.mark.parametrize("body", [{"id": 1}, {"id": 1, "prompt": None}, {"id": 1, "prompt": 5}, {"id": 1, "prompt": ["a"]}])
def test_missing_or_non_string_prompt(body):
    for data in (json.dumps(body).encode(), msgspec.msgpack.encode(body)):
        r = parse(data)
        assert isinstance(r, Rejected)
        assert r.id == 1
        assert "prompt" in r.error


@pytest.mark.parametrize("bad_id", [1.5, True, False, [1], {"a": 1}, None])
def test_id_of_wrong_type(bad_id):
    for data in (json.dumps({"id": bad_id, "prompt": "p"}).encode(), msgspec.msgpack.encode({"id": bad_id, "prompt": "p"})):
        r = parse(data)
        assert isinstance(r, Rejected)
        assert r.id is None
        assert "id" in r.error
        # the header id, when present, names the error row
        r = parse(data, {ID_HEADER: "42"})
        assert isinstance(r, Rejected) and r.id == 42


def test_missing_id_without_header():
    r = parse(b'{"prompt": "p"}')
    assert isinstance(r, Rejected) and r.id is None


def test_missing_body_id_with_header_id():
    r = parse(b'{"prompt": "p"}', {ID_HEADER: "7"})
    assert isinstance(r, (Record, Rejected))
    assert r.id == 7
    if isinstance(r, Record):
        assert cols(r) == {"prompt": "p"}


def test_json_body_with_leading_crlf():
    rec = parse(b'\r\n{"id": 1, "prompt": "p"}')
    assert isinstance(rec, Record)


def test_int_id_outside_wire_range_is_rejected():
    from prefixflow.shared.wire import messages as m

    for big in (2**70, -(2**70), 2**64 - 1, 2**63, -(2**63) - 1):
        for data in (json.dumps({"id": big, "prompt": "p"}).encode(), None):
            if data is None:
                try:
                    data = msgspec.msgpack.encode({"id": big, "prompt": "p"})
                except OverflowError:
                    continue
            r = parse(data)
            if isinstance(r, Record):  # accepted: it must then be encodable on the wire
                m.encode(m.PromptBatch([m.Prompt("j", r.id, b"", r.columns)]))
                m.encode(m.ResultBatch("j", [m.Result(r.id)]))
            else:
                assert isinstance(r, Rejected) and "id" in r.error
    for edge in (2**63 - 1, -(2**63)):
        r = parse(json.dumps({"id": edge, "prompt": "p"}).encode())
        assert isinstance(r, Record) and r.id == edge


# --- header ids ------------------------------------------------------------------------


def test_header_id():
    assert header_id({ID_HEADER: '"abc"'}) == "abc"
    assert header_id({ID_HEADER: "7"}) == 7
    assert type(header_id({ID_HEADER: "7"})) is int
    assert header_id({ID_HEADER: '"7"'}) == "7"
    assert header_id({ID_HEADER: "-3"}) == -3
    assert header_id(None) is None
    assert header_id({}) is None
    assert header_id({"Other": "1"}) is None
    for bad in ("abc", "1.5", "true", "null", "[1]", ""):
        assert header_id({ID_HEADER: bad}) is None, bad


# --- length_error ---------------------------------------------------------------------


def test_length_error_boundaries():
    assert length_error(100, 28, 128) is None
    assert length_error(1, 1, 2) is None
    err = length_error(101, 28, 128)
    assert err is not None and "too long" in err and "101" in err and "128" in err
    assert length_error(100, 29, 128) is not None
    assert length_error(0, 1, 128) is not None
    assert "no tokens" in length_error(0, 1, 128)
    assert length_error(0, 0, 0) is not None


@given(st.integers(1, 10_000), st.integers(1, 10_000), st.integers(1, 20_000))
def test_length_error_property(n, max_tokens, max_len):
    assert (length_error(n, max_tokens, max_len) is None) == (n + max_tokens <= max_len)


# --- property: good rows round-trip ---------------------------------------------------

non_blank = st.text(min_size=1, max_size=40).filter(lambda s: s.strip())
extra_cols = st.dictionaries(  # (hypothesis also tries the module's own strings: "messages" is one, and
    # the client's reserved source columns, which a raw row may carry only as integers)
    st.text(max_size=12).filter(lambda k: k != "id" and k not in PLAN_FIELDS and k not in (SRC_FIELD, ROW_FIELD)),
    st.text(max_size=20), max_size=5,
)


@given(
    rid=st.one_of(st.integers(-(2**63), 2**63 - 1), st.text(max_size=20)),
    prompt=non_blank,
    extra=extra_cols,
    encoding=st.sampled_from(["json", "msgpack"]),
)
def test_round_trip_property(rid, prompt, extra, encoding):
    body = {"id": rid, "prompt": prompt, **extra}
    data = json.dumps(body).encode() if encoding == "json" else msgspec.msgpack.encode(body)
    rec = parse(data)
    assert isinstance(rec, Record), rec
    assert rec.id == rid and type(rec.id) is type(rid)
    assert rec.prompt == prompt
    assert cols(rec) == {"prompt": prompt, **extra}


# --- pre-tokenized prompts ------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids",
    [[1, 2, 3], [0], [2**32 - 1, 7]],
)
def test_prompt_token_ids_are_packed(ids):
    rec = parse(msgspec.msgpack.encode({"id": 5, "prompt_token_ids": ids, "lang": "en"}))
    assert isinstance(rec, Record) and rec.tokens == tk.pack(ids) and tk.unpack(rec.tokens) == ids
    assert msgspec.msgpack.decode(rec.columns) == {"lang": "en"}  # token ids are not a column


@pytest.mark.parametrize(
    "ids, error",
    [
        ([], "empty prompt"),
        ([1, -1], "invalid 'prompt_token_ids'"),
        ([1, 2**32], "invalid 'prompt_token_ids'"),
        ([1, 2.0], "invalid 'prompt_token_ids'"),
        ([1, True], "invalid 'prompt_token_ids'"),
        ([1, "2"], "invalid 'prompt_token_ids'"),
        ("1 2 3", "invalid 'prompt_token_ids'"),
    ],
)
def test_bad_prompt_token_ids_are_rejected_with_their_id(ids, error):
    rej = parse(msgspec.json.encode({"id": "x", "prompt_token_ids": ids}))
    assert isinstance(rej, Rejected) and rej.id == "x" and error in rej.error


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_prompt_token_ids_roundtrip_property(ids):
    rec = parse(msgspec.msgpack.encode({"id": 1, "prompt_token_ids": ids}))
    assert isinstance(rec, Record) and tk.unpack(rec.tokens) == ids and tk.max_id(rec.tokens) == max(ids)
