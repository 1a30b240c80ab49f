"""Per-tenant quotas and key management at the batch API (issue 40, item 4), with the
real `openai` client on the shared echo cluster and one API process started with a keys
file and a quota file: tenant A over each quota is refused with the documented error
(507 `storage_quota_exceeded`, 429 `rate_limit_exceeded` naming the quota) while tenant B's
batch completes; the quota file edited while the API runs takes effect; deleting a file or
a batch deletes its data and its quota usage drops; keys added, rotated and revoked while
the API runs take effect at the next request; lists page through every item once."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import openai
import pytest

from prefixflow.batchapi.runner import error_file_object
from prefixflow.shared.openai_batch import object_names
from prefixflow.shared.wire import subjects
from tests.conftest import SLOW_ECHO
from tests.nats.test_batch_api import ApiProcess, chat_line, lines_of, objects_present, wait_for, write_batch

pytestmark = [pytest.mark.nats, pytest.mark.timeout(300)]

FINAL = {"completed", "failed", "cancelled", "expired"}


def rewrite(path: Path, text: str) -> None:
    """Change a watched file (its modification time moved on, so a change within one
    clock tick shows too)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def alice_quotas(stored_bytes: int, open_batches: int, queued_rows: int, concurrent_jobs: int) -> str:
    return (f"[tenants.qalice]\nstored_bytes = {stored_bytes}\nopen_batches = {open_batches}\n"
            f"queued_rows = {queued_rows}\nconcurrent_jobs = {concurrent_jobs}\n")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("quotas")


@pytest.fixture(scope="module")
def api(clusters, tiny_model, files):
    cluster = clusters.get(engine_args=SLOW_ECHO)
    keys, quotas = files / "keys", files / "quotas.toml"
    # Tenants of this module alone (q...): the shared cluster's stores hold other tests'
    # tenants' files (alice's, bob's), and a quota counts everything a tenant stores.
    keys.write_text("qalice key-a\nqbob key-b\n")
    quotas.write_text("")
    a = ApiProcess(cluster.url, tiny_model, files)
    a.env.update(PFX_API_KEYS="", PFX_API_KEYS_FILE=str(keys), PFX_QUOTAS_FILE=str(quotas))
    a.cluster_url, a.keys, a.quotas = cluster.url, keys, quotas
    a.start()
    yield a
    a.stop()


def usage(api: ApiProcess, key: str) -> dict:
    r = httpx.get(f"http://127.0.0.1:{api.port}/v1/quota", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return r.json()


def refused(call, error: type[openai.APIStatusError], status: int, code: str, words: str) -> None:
    with pytest.raises(error) as exc:
        call()
    assert exc.value.status_code == status and exc.value.code == code and words in exc.value.message, exc.value
    assert exc.value.type == ("insufficient_quota" if status == 429 else "server_error")
    assert exc.value.response.headers.get("x-should-retry") == "false"


def test_a_tenant_over_each_quota_is_refused_while_another_tenant_goes_on(api, files):
    alice, bob = api.client("key-a"), api.client("key-b")
    big = write_batch(files / "big.jsonl", [chat_line(i) for i in range(800)])  # open for seconds (cancelled once checked)
    small = write_batch(files / "small.jsonl", [chat_line(i) for i in range(10)])
    room = big.stat().st_size + small.stat().st_size + 100
    rewrite(api.quotas, alice_quotas(room, 1, 810, 5))
    f_big, f_small = (alice.files.create(file=p.open("rb"), purpose="batch") for p in (big, small))
    # Bytes stored: the next upload is past the room left (100 bytes): 507, nothing stored.
    refused(lambda: alice.files.create(file=small.open("rb"), purpose="batch"), openai.InternalServerError, 507,
            "storage_quota_exceeded", "quota stored_bytes exceeded")
    assert usage(api, "key-a")["stored_bytes"] == {"used": room - 100, "limit": room}
    # Tenant B (no quotas) uploads and runs a batch meanwhile.
    f_bob = bob.files.create(file=small.open("rb"), purpose="batch")
    b_bob = bob.batches.create(input_file_id=f_bob.id, endpoint="/v1/chat/completions", completion_window="24h")

    def create(fid: str):
        return lambda: alice.batches.create(input_file_id=fid, endpoint="/v1/chat/completions",
                                            completion_window="24h")

    b1 = create(f_big.id)()  # each refusal below depends on b1 alone, open for seconds
    # Open batches (1).
    refused(create(f_small.id), openai.RateLimitError, 429, "rate_limit_exceeded", "quota open_batches exceeded")
    rewrite(api.quotas, alice_quotas(room, 5, 810, 1))  # the quota file changed while the API runs
    # Concurrent jobs (1): b1's job runs.
    refused(create(f_small.id), openai.RateLimitError, 429, "rate_limit_exceeded", "quota concurrent_jobs exceeded")
    rewrite(api.quotas, alice_quotas(room, 5, 805, 5))
    # Queued requests: 800 queued, 10 more asked, 805 allowed.
    refused(create(f_small.id), openai.RateLimitError, 429, "rate_limit_exceeded", "quota queued_rows exceeded")
    now = usage(api, "key-a")
    assert alice.batches.retrieve(b1.id).status not in FINAL | {"finalizing"}, "b1 ran out before the checks"
    assert {q: now[q]["used"] for q in ("open_batches", "queued_rows", "concurrent_jobs")} == {
        "open_batches": 1, "queued_rows": 800, "concurrent_jobs": 1}, now
    # A batch that is not final cannot be deleted (409).
    r = httpx.delete(f"http://127.0.0.1:{api.port}/v1/batches/{b1.id}", headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "batch_not_final", r.text
    assert alice.batches.cancel(b1.id).status == "cancelling"  # done with it: its rows stop

    # Deleting a file deletes its content and frees its bytes: the upload refused above fits now.
    before = usage(api, "key-a")["stored_bytes"]["used"]
    assert alice.files.delete(f_small.id).deleted
    assert usage(api, "key-a")["stored_bytes"]["used"] == before - small.stat().st_size
    with pytest.raises(openai.NotFoundError):
        alice.files.content(f_small.id)
    assert objects_present(api.cluster_url, [f_small.id]) == []
    again = alice.files.create(file=small.open("rb"), purpose="batch")
    assert alice.files.content(again.id).content == small.read_bytes()
    rewrite(api.quotas, alice_quotas(room, 5, 810, 5))
    b2 = create(again.id)()  # 800 + 10 queued: within the raised limit

    # B's batch completed while A was refused.
    done_bob = wait_for(bob, b_bob.id, FINAL)
    assert done_bob.status == "completed" and done_bob.request_counts.completed == 10

    # Deleting a final batch deletes its output and error files and its job's exports.
    assert wait_for(alice, b2.id, FINAL).status == "completed"
    done = wait_for(alice, b1.id, FINAL)
    assert done.status == "cancelled" and done.error_file_id is not None, done
    outputs = [fid for fid in (done.output_file_id, done.error_file_id) if fid is not None]
    assert len(lines_of(alice, done.output_file_id)) + len(lines_of(alice, done.error_file_id)) == 800
    before = usage(api, "key-a")
    assert before["open_batches"]["used"] == before["queued_rows"]["used"] == before["concurrent_jobs"]["used"] == 0
    out_bytes = sum(alice.files.retrieve(fid).bytes for fid in outputs)
    r = httpx.delete(f"http://127.0.0.1:{api.port}/v1/batches/{b1.id}", headers={"Authorization": "Bearer key-a"})
    assert r.status_code == 200 and r.json() == {"id": b1.id, "object": "batch.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        alice.batches.retrieve(b1.id)
    for fid in outputs:
        with pytest.raises(openai.NotFoundError):
            alice.files.retrieve(fid)
    assert usage(api, "key-a")["stored_bytes"]["used"] == before["stored_bytes"]["used"] - out_bytes
    assert objects_present(api.cluster_url, [*object_names(subjects.api_job(b1.id)), error_file_object(subjects.api_job(b1.id))]) == []
    assert alice.files.retrieve(b1.input_file_id).id == f_big.id, "its input file is the tenant's own: kept"
    assert b1.id not in {b.id for b in alice.batches.list()} and b2.id in {b.id for b in alice.batches.list()}


def test_keys_added_rotated_and_revoked_while_the_api_runs_take_effect_at_once(api):
    base = f"http://127.0.0.1:{api.port}/v1"
    with pytest.raises(openai.AuthenticationError):
        api.client("key-c").files.list()
    rewrite(api.keys, "qalice key-a\nqbob key-b\nqcarol key-c\n")  # carol added
    carol = api.client("key-c")
    f = carol.files.create(file=("c.jsonl", json.dumps(chat_line(0)).encode()), purpose="batch")
    rewrite(api.keys, "qalice key-a\nqcarol key-c\nqcarol key-c2\n")  # bob revoked; carol's second key for rotating
    r = httpx.get(f"{base}/files", headers={"Authorization": "Bearer key-b"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", "a revoked key: 401 at once"
    assert api.client("key-c2").files.retrieve(f.id).id == f.id, "a tenant's new key sees its files"
    rewrite(api.keys, "qalice key-a\nqcarol key-c2\nqbob key-b\n")  # carol's old key rotated out, bob back
    with pytest.raises(openai.AuthenticationError):
        carol.files.list()
    rewrite(api.keys, "qalice key-a\nqcarol key-c2\nqbob key-b\nbroken\n")  # a bad edit: the keys in force stay
    assert api.client("key-c2").files.retrieve(f.id).id == f.id
    assert "API keys not reloaded" in api.log.read_text()
    rewrite(api.keys, "qalice key-a\nqcarol key-c2\nqbob key-b\n")


def test_lists_page_through_every_item_once_and_are_bounded(api, files):
    rewrite(api.keys, "qalice key-a\nqbob key-b\nqdave key-d\n")
    dave = api.client("key-d")
    uploaded = [dave.files.create(file=(f"f{i}.jsonl", json.dumps(chat_line(i)).encode()), purpose="batch").id
                for i in range(7)]
    first = dave.files.list(limit=3)
    assert len(first.data) == 3 and first.has_more and [x.id for x in first.data] == uploaded[::-1][:3]
    assert [x.id for x in dave.files.list(limit=3)] == uploaded[::-1], "every file once, newest first"
    assert [x.id for x in dave.files.list(limit=2, order="asc")] == uploaded
    batches = [dave.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h").id
               for fid in uploaded[:3]]
    page = dave.batches.list(limit=2)
    assert len(page.data) == 2 and page.has_more
    assert [b.id for b in dave.batches.list(limit=2)] == batches[::-1]
    for kind, most in (("files", 10_000), ("batches", 100)):
        for limit in (0, most + 1):
            r = httpx.get(f"http://127.0.0.1:{api.port}/v1/{kind}", params={"limit": limit},
                          headers={"Authorization": "Bearer key-d"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text
    deadline = time.monotonic() + 120
    while {dave.batches.retrieve(b).status for b in batches} - FINAL:  # leave no job running
        assert time.monotonic() < deadline
        time.sleep(0.3)
