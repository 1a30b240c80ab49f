"""The batch service's pure parts: API keys -> tenants, reading a batch input file (bad
lines and why), counters, deadlines, the lines of requests without a result; and the
sink's export of a job's rows as OpenAI result lines."""

from __future__ import annotations

import json
import string

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.chat import ChatCompletion

from prefixflow.batchapi import batches as b
from prefixflow.batchapi.tenants import OPEN_TENANT, load_keys, parse_keys, parse_keys_file, render_keys_file, tenant_of
from prefixflow.services.sink.export import write_lines

pytestmark = pytest.mark.unit


def test_keys_map_to_tenants_and_bad_items_are_refused(tmp_path):
    keys = parse_keys("alice:ka, bob:kb\ncarol : kc")
    assert keys == {"ka": "alice", "kb": "bob", "kc": "carol"}
    for bad in ("alice", "alice:", ":ka", "al ice:ka", "a:k,b:k", "a:k\tk"):
        with pytest.raises(ValueError):
            parse_keys(bad)
    f = tmp_path / "keys"
    f.write_text("# TENANT KEY\ndave:kd\n  erin  e#1,2 3:4  \r\n\n")
    assert load_keys("alice:ka", str(f)) == {"ka": "alice", "kd": "dave", "e#1,2 3:4": "erin"}
    f.write_text("dave\n")
    with pytest.raises(ValueError, match="line 1: want 'TENANT KEY'"):
        load_keys("", str(f))
    f.write_text("alice k\u00e9y\n")
    with pytest.raises(ValueError, match="printable ASCII"):
        load_keys("", str(f))
    f.write_text("mallory secret-of-mallory\n")
    with pytest.raises(ValueError, match="two tenants") as exc:
        load_keys("alice:secret-of-mallory", str(f))
    assert "secret-of-mallory" not in str(exc.value), "an error never shows a key"
    assert tenant_of(keys, "Bearer kb") == "bob" and tenant_of(keys, "bearer ka") == "alice"
    assert tenant_of(keys, "Bearer nope") is None and tenant_of(keys, None) is None and tenant_of(keys, "kb") is None
    assert tenant_of({}, None) == OPEN_TENANT


KEY_CHARS = st.characters(min_codepoint=0x20, max_codepoint=0x7E)
TENANTS = st.text(st.sampled_from(string.ascii_letters + string.digits + "-_"), min_size=1, max_size=12)


@given(st.dictionaries(TENANTS, st.text(KEY_CHARS, min_size=1, max_size=40).map(str.strip).filter(bool),
                       min_size=1, max_size=5))
def test_any_printable_key_survives_the_keys_file(tenant_keys):
    """`TENANT KEY` lines carry every printable ASCII key (`#`, `,`, `:`, quotes,
    backslashes, inner spaces) to the same tenant, through the file `cluster config`
    writes and the `Authorization` header."""
    if len(set(tenant_keys.values())) != len(tenant_keys):
        return  # one key for two tenants: refused (tested above)
    keys = parse_keys_file(render_keys_file(tenant_keys))
    assert keys == {key: tenant for tenant, key in tenant_keys.items()}
    for tenant, key in tenant_keys.items():
        assert tenant_of(keys, f"Bearer {key}") == tenant


def test_the_env_var_keeps_a_hash_in_a_key():
    from honcho.environ import parse as dotenv

    assert parse_keys("alice:ab#0123456789abcdef") == {"ab#0123456789abcdef": "alice"}
    assert tenant_of(parse_keys("alice:ab#0123456789abcdef"), "Bearer ab") is None
    # `make up` (honcho) reads a .env: quoted, as the Procfile says, the value is whole.
    env = dotenv("PFX_API_KEYS='alice:ab#0123456789abcdef'\nUNQUOTED=alice:ab#01\n")
    assert parse_keys(env["PFX_API_KEYS"]) == {"ab#0123456789abcdef": "alice"}
    assert env["UNQUOTED"] == "alice:ab", "honcho cuts an unquoted value at '#' (why the Procfile says to quote)"


def test_completion_windows_and_endpoints():
    assert b.window_seconds("24h") == 86400 and b.window_seconds("90m") == 5400 and b.window_seconds("5s") == 5
    for bad in ("", "24", "0h", "1d", "h"):
        with pytest.raises(b.Invalid):
            b.window_seconds(bad)
    b.check_endpoint("/v1/chat/completions", "generate")
    b.check_endpoint("/v1/embeddings", "embed")
    for endpoint, task in (("/v1/embeddings", "generate"), ("/v1/chat/completions", "embed"), ("/v1/responses", "generate")):
        with pytest.raises(b.Invalid):
            b.check_endpoint(endpoint, task)


def line(cid: str, url: str = "/v1/chat/completions", model: str = "m", **body) -> str:
    body = body or {"messages": [{"role": "user", "content": cid}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": model, **body}})


def test_parse_file_keeps_good_requests_and_names_every_bad_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([
        line("a"), "{oops", line("b", model="other"), line("c", url="/v1/completions", prompt="x"), "",
        line("a"), line("d", model=""), line("e"), line("f"),
    ]) + "\n")
    parsed = b.parse_file(src, tmp_path / "rows.jsonl", "/v1/chat/completions", {"m"}, max_requests=3)
    assert parsed.ids == ["a", "d", "e"]
    rows = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "d", "e"] and rows[0]["messages"][0]["content"] == "a"
    assert [e["line"] for e in parsed.bad_errors] == [2, 3, 4, 6, 9]
    messages = [x["response"]["body"]["error"]["message"] for x in parsed.bad]
    assert "not JSON" in messages[0] and "model 'other' is not served" in messages[1]
    assert "url /v1/completions in a batch for /v1/chat/completions" in messages[2]
    assert "duplicate custom_id" in messages[3] and "more than 3 requests" in messages[4]
    assert [x["custom_id"] for x in parsed.bad] == [None, "b", "c", "a", "f"]


def test_counts_and_missing_lines():
    assert b.counts(10, 2, 7, 1) == {"total": 12, "completed": 6, "failed": 3}
    lines = b.missing_lines(["a", "b", "c"], {"b"}, "batch_expired")
    assert [x["custom_id"] for x in lines] == ["a", "c"]
    assert {x["response"]["body"]["error"]["code"] for x in lines} == {"batch_expired"}
    assert b.served_names("/x/models/tiny", "hub/tiny, t2") == {"/x/models/tiny", "tiny", "hub/tiny", "t2"}


def test_the_sink_exports_every_row_as_a_result_line(tmp_path):
    part = tmp_path / "part-000000.parquet"
    pq.write_table(pa.table({
        "id": ["r1", "r2"], "url": ["/v1/chat/completions"] * 2, "output": ["hi", None], "finish_reason": ["stop", None],
        "prompt_tokens": [5, 5], "cached_tokens": [2, 0], "output_tokens": [1, 0], "error": [None, "engine died"],
        "extra": [1, 2],
    }), part)
    ok, err = tmp_path / "_batch" / "output.jsonl", tmp_path / "_batch" / "errors.jsonl"
    assert write_lines([part], "m", ok, err) == (1, 1)
    good = json.loads(ok.read_text())
    assert good["custom_id"] == "r1" and good["response"]["status_code"] == 200
    body = ChatCompletion.model_validate(good["response"]["body"])
    assert body.choices[0].message.content == "hi" and body.usage.prompt_tokens_details.cached_tokens == 2
    bad = json.loads(err.read_text())
    assert bad["custom_id"] == "r2" and "engine died" in bad["response"]["body"]["error"]["message"]


def test_a_batch_priority_comes_from_its_metadata():
    assert b.priority(None) == 1 and b.priority({"team": "x"}) == 1
    assert b.priority({"priority": "3"}) == 3
    for bad in ("0", "-1", "2.5", "high", "1000"):
        with pytest.raises(b.Invalid):
            b.priority({"priority": bad})


def test_a_bad_keys_file_stops_the_api_with_the_reason_and_no_key(tmp_path):
    from prefixflow.batchapi.service import Api
    from prefixflow.shared.process.config import ApiConfig

    keys = tmp_path / "keys"
    keys.write_text("alice k1\nbob s3cret-of-bob x\nalice\n")
    with pytest.raises(SystemExit, match="keys line 3: want 'TENANT KEY'") as exc:
        Api(ApiConfig(api_keys_file=str(keys)))
    assert "s3cret" not in str(exc.value)
