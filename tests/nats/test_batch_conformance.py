"""The batch API as OpenAI's (issue 40, items 6 and 7), with the real `openai` client on
the shared echo cluster: OpenAI's limits refused at create with its error, a 24h-only
`completion_window`, 404 for malformed ids, uploads refused while they stream (413) and a
full files store (507); and batches with every kind of line (good, bad, oversize,
over-deep, duplicate, cancelled, expired) whose every output and error line validates
with the `openai` package's own types."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai.types import Batch

from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import subjects
from tests.conftest import SLOW_ECHO
from tests.nats.test_batch_api import ApiProcess, chat_line, lines_of, wait_for, write_batch
from tests.openai_lines import check_error_line, check_output_line

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

MAX_FILE = 4_000_000
MAX_BATCH = 3_000_000
FINAL = {"completed", "failed", "cancelled", "expired"}


@pytest.fixture
def api(clusters, tiny_model, tmp_path):
    cluster = clusters.get(engine_args=SLOW_ECHO)
    a = ApiProcess(cluster.url, tiny_model, tmp_path)
    a.env.update(PFX_MAX_FILE_BYTES=str(MAX_FILE), PFX_MAX_BATCH_BYTES=str(MAX_BATCH), PFX_COMPLETION_WINDOWS="24h,15s")
    a.start()
    yield a
    a.stop()


def upload(client: openai.OpenAI, path: Path) -> str:
    return client.files.create(file=path.open("rb"), purpose="batch").id


def create(client: openai.OpenAI, fid: str, window: str = "24h") -> Batch:
    return client.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window=window)


def chunked_upload(port: int, total: int) -> tuple[bytes, int]:
    """POST a multipart upload of `total` file bytes with chunked encoding (no length
    given), reading the socket between chunks: (the first response bytes, bytes sent
    when the response came)."""
    boundary = "pfxboundary"
    head = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n').encode()
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer key-a\r\nTransfer-Encoding: chunked\r\n"
                  f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode())
        s.setblocking(False)
        chunk = b"x" * 65536
        pieces = [head] + [chunk] * (total // len(chunk))
        for piece in pieces:
            try:
                answer = s.recv(4096)
                if answer:
                    return answer, sent
            except BlockingIOError:
                pass
            try:
                s.setblocking(True)
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
                sent += len(piece)
                s.setblocking(False)
            except (BrokenPipeError, ConnectionResetError):
                break
        s.setblocking(True)
        return s.recv(4096), sent


def test_limits_windows_ids_and_uploads_answer_as_openai_does(api, tmp_path):
    alice = api.client("key-a")
    # 50,001 requests (the limit): refused at create with OpenAI's error, nothing run.
    many = tmp_path / "many.jsonl"
    many.write_text("".join(f'{{"custom_id": "r{i}"}}\n' for i in range(50_001)))  # lines are counted at upload
    assert many.stat().st_size < MAX_BATCH
    with pytest.raises(openai.BadRequestError) as exc:
        create(alice, upload(alice, many))
    assert exc.value.code == "too_many_requests_in_batch" and exc.value.param == "input_file_id"
    assert "at most 50000 requests" in exc.value.message
    # Over the batch bytes limit (a config value here; OpenAI's 200 MB by default).
    wide = write_batch(tmp_path / "wide.jsonl", [chat_line(0) | {"pad": "x" * (MAX_BATCH // 2)}] * 2)
    with pytest.raises(openai.BadRequestError) as exc:
        create(alice, upload(alice, wide))
    assert exc.value.code == "batch_file_too_large"
    small = upload(alice, write_batch(tmp_path / "small.jsonl", [chat_line(0)]))
    for window in ("48h", "1h", ""):  # only 24h (and what the API is configured with)
        with pytest.raises(openai.BadRequestError) as exc:
            create(alice, small, window)
        assert exc.value.param == "completion_window"
    # Malformed ids are unknown ids: 404, never a 500.
    for bad in ("a:b", "a.b", "a*b", "x" * 300):
        with pytest.raises(openai.NotFoundError):
            alice.files.retrieve(bad)
        with pytest.raises(openai.NotFoundError):
            alice.batches.retrieve(bad)
        with pytest.raises(openai.NotFoundError):
            alice.batches.cancel(bad)
    with pytest.raises(openai.NotFoundError):
        create(alice, "a:b")
    before = {f.id for f in alice.files.list()}
    # An upload over the limit: refused before its body is read (a length given) ...
    r = httpx.post(f"http://127.0.0.1:{api.port}/v1/files", headers={"Authorization": "Bearer key-a"},
                   files={"file": ("big.jsonl", b"x" * (MAX_FILE + 100_000))}, data={"purpose": "batch"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"
    # ... or as soon as its streamed body passes it (no length given).
    answer, sent = chunked_upload(api.port, 40 * MAX_FILE)
    assert answer.startswith(b"HTTP/1.1 413"), answer
    assert sent < 10 * MAX_FILE, f"{sent} bytes sent before the 413: the body was read past the limit"
    # Neither refused upload was stored (the tenant's other files come from other tests on
    # this shared cluster: only what appeared since counts).
    assert [f for f in alice.files.list() if f.id not in before] == []


def deep_line(cid: str, levels: int) -> str:
    return ('{"custom_id": "%s", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": '
            '[{"role": "user", "content": "hi"}], "response_format": %s}}'
            % (cid, '{"k": ' * levels + '"x"' + "}" * levels))


def check_all(client: openai.OpenAI, batch: Batch) -> tuple[list[dict], list[dict], list[str]]:
    """Every line of the batch's files checked with openai's types: (output lines, error
    lines, the error lines' codes)."""
    Batch.model_validate(batch.model_dump())
    out, errors = lines_of(client, batch.output_file_id), lines_of(client, batch.error_file_id)
    for x in out:
        check_output_line(x, "/v1/chat/completions")
    codes = [check_error_line(x) for x in errors]
    assert len({x["custom_id"] for x in out}) == len(out), "one output line per custom_id"
    assert not {x["custom_id"] for x in out} & {x["custom_id"] for x in errors}, "no id both succeeded and failed"
    return out, errors, codes


def test_every_line_of_batches_with_every_kind_of_line_is_openais(api, tmp_path):
    alice = api.client("key-a")
    # Good lines with an oversize line (over half the server's 1 MiB max_payload), lines
    # nested 100 and 1,000 deep, a line that is not JSON: each its own error line.
    oversize = json.dumps(chat_line(1) | {"custom_id": "huge"} | {"body": {"messages": [
        {"role": "user", "content": "y" * 700_000}]}})
    mixed = upload(alice, write_batch(tmp_path / "mixed.jsonl", [chat_line(i) for i in range(20)] + [
        oversize, deep_line("deep-100", 100), deep_line("deep-1000", 1000), "{oops"]))
    mixed_batch = create(alice, mixed)
    dups = upload(alice, write_batch(tmp_path / "dups.jsonl", [chat_line(i) for i in range(5)] + [chat_line(2)]))
    dup_batch = create(alice, dups)

    # Mixed: completed, its bad lines error lines naming why; nothing failed the batch.
    done = wait_for(alice, mixed_batch.id, FINAL)
    assert done.status == "completed", done
    out, errors, codes = check_all(alice, done)
    assert len(out) == 20 and codes == ["invalid_request"] * 4
    by_id = {x["custom_id"]: x["response"]["body"]["error"]["message"] for x in errors}
    assert "over the limit" in by_id["huge"] and "nested deeper" in by_id["deep-100"]
    assert "nested deeper" in by_id["deep-1000"] and "not JSON" in by_id[None]

    # Duplicates: failed at validation as OpenAI does, each duplicate line named.
    failed = wait_for(alice, dup_batch.id, FINAL)
    assert failed.status == "failed" and failed.output_file_id is None
    assert [(e.code, e.line, e.param) for e in failed.errors.data] == [("duplicate_custom_id", 6, "custom_id")]
    _, _, codes = check_all(alice, failed)
    assert codes == ["duplicate_custom_id"]

    # Then (the cluster warm: its ingestor renders chat) one batch that expires and one
    # cancelled, both mid-run.
    n = 6000  # ~15 s of the slow echo engine: cancelled after a while, expired at 15 s
    long = upload(alice, write_batch(tmp_path / "long.jsonl", [chat_line(i) for i in range(n)]))
    expired = create(alice, long, "15s")
    while (now := alice.batches.retrieve(expired.id)).request_counts.completed < 100:
        assert now.status not in FINAL, now
        time.sleep(0.2)
    cancelled = create(alice, long)
    while alice.batches.retrieve(cancelled.id).request_counts.completed < 20:
        time.sleep(0.2)
    alice.batches.cancel(cancelled.id)
    # Cancelled and expired: partial output, the rest as OpenAI's `response: null` lines.
    for batch, status, code in ((cancelled, "cancelled", "batch_cancelled"), (expired, "expired", "batch_expired")):
        done = wait_for(alice, batch.id, FINAL, timeout=120)
        assert done.status == status, done
        out, errors, codes = check_all(alice, done)
        assert 0 < len(out) < n and set(codes) == {code}, (status, len(out), set(codes))
        assert all(x["response"] is None for x in errors)
        assert len(out) + len(errors) == n == done.request_counts.total
        assert (done.request_counts.completed, done.request_counts.failed) == (len(out), len(errors))


def test_a_full_files_store_answers_507(nats_server, tiny_model, tmp_path):
    """The files store at its max_bytes: an upload is answered 507 with an OpenAI error
    body (not 500), and the API goes on serving."""

    async def small_store() -> None:
        nc = await connect(nats_server.url, "tests")
        try:
            await nc.jetstream().create_object_store(subjects.FILES_OBJ, max_bytes=1_000_000)
        finally:
            await close(nc)

    asyncio.run(small_store())
    a = ApiProcess(nats_server.url, tiny_model, tmp_path)
    a.start()
    try:
        alice = a.client("key-a")
        ok = upload(alice, write_batch(tmp_path / "ok.jsonl", [chat_line(0)]))
        with pytest.raises(openai.APIStatusError) as exc:
            upload(alice, write_batch(tmp_path / "big.jsonl", [chat_line(0) | {"pad": "x" * 1_500_000}]))
        assert exc.value.status_code == 507 and exc.value.code == "storage_full", exc.value
        assert exc.value.body["type"] == "server_error"
        assert [f.id for f in alice.files.list()] == [ok]
    finally:
        a.stop()


def test_a_file_of_only_bad_lines_ends_with_its_complete_error_file_while_others_are_served(api, tmp_path):
    """Issue 40, the suite's size (`prefixflow bench batch-limits` runs 50,000 lines of
    ~4 KB and reports the API's peak RSS): every line bad, the batch ends `failed` with
    an error file holding a line for each, while another tenant's requests are answered."""
    from prefixflow.bench.batch_limits import run_against, write_bad_lines

    lines = 5000
    path = write_bad_lines(tmp_path / "bad.jsonl", lines, 512)
    result = run_against(f"http://127.0.0.1:{api.port}/v1", path, lines)
    assert result["status"] == "failed" and result["complete"], result
    assert result["other_tenant_requests"] > 0 and not result["other_tenant_errors"], result
