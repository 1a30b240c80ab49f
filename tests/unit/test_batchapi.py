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
from prefixflow.shared.api_keys import OPEN_TENANT, load_keys, parse_keys, parse_keys_file, render_keys_file, tenant_of
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
    assert b.window_seconds("24h") == 86400
    assert b.window_seconds("90m", ["24h", "90m"]) == 5400 and b.window_seconds("5s", "24h,5s".split(",")) == 5
    for bad in ("", "24", "0h", "1d", "h", "90m", "48h"):  # OpenAI serves only 24h; more only when configured
        with pytest.raises(b.Invalid, match="completion_window") as exc:
            b.window_seconds(bad)
        assert exc.value.param == "completion_window"
    with pytest.raises(b.Invalid):
        b.window_seconds("0h", ["0h"])
    b.check_endpoint("/v1/chat/completions", "generate")
    b.check_endpoint("/v1/embeddings", "embed")
    for endpoint, task in (("/v1/embeddings", "generate"), ("/v1/chat/completions", "embed"), ("/v1/responses", "generate")):
        with pytest.raises(b.Invalid):
            b.check_endpoint(endpoint, task)


def line(cid: str, url: str = "/v1/chat/completions", model: str = "m", **body) -> str:
    body = body or {"messages": [{"role": "user", "content": cid}]}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": model, **body}})


def parse(tmp_path, text: str | bytes, **kw) -> tuple[b.Parsed, list[str], list[dict], list[dict]]:
    """parse_file on `text`: (what it found, good ids, rows, error lines)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(text if isinstance(text, bytes) else text.encode())
    files = [tmp_path / n for n in ("rows.jsonl", "bad.jsonl", "ids.jsonl")]
    parsed = b.parse_file(src, *files, "/v1/chat/completions", {"m"}, **{"max_requests": 50_000, **kw})
    rows, bad, ids = ([json.loads(x) for x in f.read_text().splitlines()] for f in files)
    return parsed, ids, rows, bad


def test_parse_file_keeps_good_requests_and_names_every_bad_line(tmp_path):
    parsed, ids, rows, bad = parse(tmp_path, "\n".join([
        line("a"), "{oops", line("b", model="other"), line("c", url="/v1/completions", prompt="x"), "",
        line("a"), line("d", model=""), line("e"), line("f"),
    ]) + "\n", max_requests=3)
    assert ids == ["a", "d", "e"] and (parsed.requests, parsed.bad, parsed.duplicates) == (3, 5, 1)
    assert [r["id"] for r in rows] == ["a", "d", "e"] and rows[0]["messages"][0]["content"] == "a"
    assert [e["line"] for e in parsed.errors] == [6, 2, 3, 4, 9], "duplicates first: they alone fail a batch"
    assert parsed.errors[0] == {"code": "duplicate_custom_id", "line": 6, "param": "custom_id",
                                "message": "duplicate custom_id 'a': custom_id must be unique in a batch"}
    messages = [x["response"]["body"]["error"]["message"] for x in bad]
    assert "not JSON" in messages[0] and "model 'other' is not served" in messages[1]
    assert "url /v1/completions in a batch for /v1/chat/completions" in messages[2]
    assert "duplicate custom_id" in messages[3] and "more than 3 requests" in messages[4]
    assert [x["custom_id"] for x in bad] == [None, "b", "c", "a", "f"]
    assert [x["response"]["body"]["error"]["code"] for x in bad][3] == "duplicate_custom_id"


def deep(levels: int) -> dict:
    value: object = "x"
    for _ in range(levels):
        value = {"k": value}
    return value


def deep_text(levels: int) -> str:
    """`deep(levels)` as JSON text (json.dumps itself gives up near 1,000 levels)."""
    return '{"k": ' * levels + '"x"' + "}" * levels


def test_oversize_and_over_deep_lines_are_error_lines_that_name_their_request(tmp_path):
    """A line over the message limit is never held whole (read in pieces; its custom_id
    found in its first bytes); a line nested ~1,000 deep (the JSON decoder's recursion
    limit) or past MAX_LINE_DEPTH is an error line, not a failed batch."""
    big = line("big", messages=[{"role": "user", "content": "y" * 900_000}])
    # A field that travels (`response_format`) past MAX_LINE_DEPTH; one the API ignores
    # (`metadata`) so deep that the JSON decoder gives up.
    nested = ['{"custom_id": "deep-%d", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
              '[{"role": "user", "content": "hi"}], "%s": %s}}'
              % (n, "response_format" if n < 1000 else "metadata", deep_text(n))
              for n in (b.MAX_LINE_DEPTH, 1000, 100_000)]
    ok_deep = json.dumps({"custom_id": "ok-deep", "method": "POST", "url": "/v1/chat/completions",
                          "body": {"messages": [{"role": "user", "content": "hi"}],
                                   "response_format": {"type": "json_schema", "json_schema": {
                                       "name": "s", "schema": deep(b.MAX_LINE_DEPTH - 8)}}}})
    parsed, ids, rows, bad = parse(tmp_path, "\n".join([line("a"), big, *nested, ok_deep, line("z")]),
                                   max_line_bytes=800_000)
    assert ids == ["a", "ok-deep", "z"] and parsed.bad == 4
    assert [x["custom_id"] for x in bad] == ["big", "deep-80", "deep-1000", "deep-100000"]
    why = [x["response"]["body"]["error"]["message"] for x in bad]
    assert why[0].startswith("line 2: line of 900") and "over the limit of 800000 bytes" in why[0]
    assert all(f"nested deeper than {b.MAX_LINE_DEPTH} levels" in w for w in why[1:]), why


def test_a_file_of_many_bad_lines_is_parsed_in_bounded_memory(tmp_path):
    """Issue 40: every bad line's error went into a list (~1.2 KB each). Now they stream
    to the error file: 5,000 bad lines take no more memory than 200 do."""
    import tracemalloc

    src, files = tmp_path / "in.jsonl", [tmp_path / n for n in ("rows.jsonl", "bad.jsonl", "ids.jsonl")]

    def peak(n: int) -> int:
        src.write_text("".join(f'{{"custom_id": "r{i}", "method": "GET", "url": "/v1/chat/completions", '
                               f'"body": {{}}}}\n' for i in range(n)))
        tracemalloc.start()
        parsed = b.parse_file(src, *files, "/v1/chat/completions", {"m"}, 50_000)
        top = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert parsed.bad == n and len(parsed.errors) == min(n, b.MAX_LISTED_ERRORS)
        return top

    small, large = peak(200), peak(5_000)
    assert large < small + 500_000, (small, large)  # 5,000 kept errors: ~6 MB
    assert sum(1 for _ in files[1].open()) == 5_000


def test_counts_and_missing_lines():
    from openai.types.batch_error import BatchError

    assert b.counts(10, 2, 7, 1) == {"total": 12, "completed": 6, "failed": 3}
    lines = list(b.missing_lines(["a", "b", "c"], {"b"}, "batch_expired"))
    assert [x["custom_id"] for x in lines] == ["a", "c"]
    for x in lines:  # as OpenAI writes them: no response, the error's code and message
        assert x["response"] is None and x["id"].startswith("batch_req_")
        assert BatchError.model_validate(x["error"]).code == "batch_expired"
    assert b.served_names("/x/models/tiny", "hub/tiny, t2") == {"/x/models/tiny", "tiny", "hub/tiny", "t2"}


def test_a_batch_input_over_openais_limits_is_refused(tmp_path):
    from prefixflow.batchapi.store import FileRec

    def rec(size: int, lines: int) -> FileRec:
        return FileRec("file_x", "alice", "in.jsonl", "batch", size, 0, "file_x", lines)

    b.check_input(rec(200, 50_000), 200, 50_000)
    b.check_input(rec(10, 0), 200, 50_000)  # a file stored before lines were counted: the runner checks
    with pytest.raises(b.Invalid, match="at most 50000 requests") as exc:
        b.check_input(rec(100, 50_001), 200, 50_000)
    assert (exc.value.code, exc.value.param) == ("too_many_requests_in_batch", "input_file_id")
    with pytest.raises(b.Invalid, match="at most 200 bytes") as exc:
        b.check_input(rec(201, 1), 200, 50_000)
    assert exc.value.code == "batch_file_too_large"


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


def test_every_kind_of_result_line_validates_with_openai_types():
    """Success lines (chat, completion, embedding), error rows, bad lines and requests that
    never ran (cancelled, expired) with the `openai` package's types (vLLM's own:
    tests/heavy/test_batch_lines.py)."""
    from prefixflow.shared.openai_batch import error_line, not_run_line, result_line
    from tests.openai_lines import check_error_line, check_output_line

    row = {"output": "hi", "finish_reason": "length", "prompt_tokens": 3, "cached_tokens": 1, "output_tokens": 2,
           "embedding": [0.5, -1.0]}
    for url in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
        good, out = result_line("r1", url, row, "tiny", 1)
        assert good
        check_output_line(out, url)
    good, err = result_line("r2", "/v1/chat/completions", {"error": "engine died"}, "tiny", 1, "line 2")
    assert not good and check_error_line(err) == "invalid_request"
    assert check_error_line(error_line(None, "line 3: not JSON")) == "invalid_request"
    for code in ("batch_cancelled", "batch_expired"):
        assert check_error_line(not_run_line("r3", code)) == code


def test_a_batch_is_not_failed_by_the_api_stopping(tmp_path):
    """SIGTERM (a restart) while a batch's runner connects to NATS: the connect ends with
    `StoppedWhileConnecting` — the process's fault, not the batch's. Its record stays as
    it is for the next start to resume (the torture run, seed 13 round 100, saw it
    `failed` with `internal_error`); any other error still fails the batch."""
    import asyncio

    from prefixflow.batchapi import runner as runner_module
    from prefixflow.shared.bus.connection import SHUTDOWN, StoppedWhileConnecting

    class Store:
        def __init__(self):
            self.changes = []

        async def batch(self, tenant, bid):
            return type("Rec", (), {"batch": {"id": bid, "status": "validating"}})()

    def make(exc):
        r = runner_module.Runner.__new__(runner_module.Runner)
        r.store = Store()

        async def step(rec, work):
            raise exc

        async def change(tenant, bid, change):
            r.store.changes.append(change)

        r.step, r.change = step, change
        return r

    async def main():
        stop = asyncio.Event()
        SHUTDOWN.set(stop)
        left = make(StoppedWhileConnecting("asked to stop before a NATS server answered"))
        await left.run("alice", "batch_1")
        assert left.store.changes == [], "stopped while connecting: never the batch's failure"
        broken = make(ValueError("a real fault"))
        await broken.run("alice", "batch_2")
        assert len(broken.store.changes) == 1, "anything else still fails the batch"
        stop.set()
        late = make(ConnectionError("nats closed while stopping"))
        await late.run("alice", "batch_3")
        assert late.store.changes == [], "while the API stops, nothing it meets fails a batch"

    asyncio.run(main())
