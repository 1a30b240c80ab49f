"""The OpenAI Batch API (`prefixflow serve api`, issue #24) with the real `openai` client,
on a local cluster of echo engines: files up and down, a batch with good and bad lines
to `completed` (its files validated with openai's own types), list and pagination,
tenants that cannot see each other (404), a batch cancelled mid-run (partial output,
the rest as `batch_cancelled` error lines), the API restarted mid-batch, and the races
of issue 40: jobs that finish while the API is down (its input deleted or not) and a
cancel right after create."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
from nats.js.errors import KeyNotFoundError, NotFoundError
from openai.types.chat import ChatCompletion

from prefixflow.batchapi.runner import parsed_names
from prefixflow.launch.local_cluster import free_port
from prefixflow.shared.bus.connection import close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from tests.conftest import REPO, SLOW_ECHO, VENV_BIN

pytestmark = [pytest.mark.nats, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("api-root")


@pytest.fixture
def cluster(clusters):
    # ~400 prompts/s: a batch of a few thousand requests runs for seconds. (The sinks'
    # output root is the session's temporary directory, which holds `root`.)
    return clusters.get(engine_args=SLOW_ECHO)


class ApiProcess:
    def __init__(self, url: str, model: Path, root: Path) -> None:
        self.port = free_port()
        self.env = {**os.environ, "PFX_NATS_URL": url, "PFX_MODEL": str(model), "PFX_API_KEYS": "alice:key-a,bob:key-b",
                    "PFX_PORT": str(self.port), "PFX_LOG_FORMAT": "json", "PFX_SERVED_NAMES": "tiny-llama"}
        self.log = root / f"api-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        seen = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen([str(VENV_BIN / "prefixflow"), "serve", "api"], cwd=REPO, env=self.env,
                                     stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while '"api ready"' not in self.log.read_text()[seen:]:
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(api_key=key, base_url=f"http://127.0.0.1:{self.port}/v1", max_retries=0)


@pytest.fixture
def api(cluster, tiny_model, root):
    a = ApiProcess(cluster.url, tiny_model, root)
    a.start()
    yield a
    a.stop()


def chat_line(i: int, model: str = "tiny-llama") -> dict:
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": f"question {i % 7}: say {i}"}],
                     "max_tokens": 4}}


def write_batch(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def wait_for(client: openai.OpenAI, bid: str, states: set[str], timeout: float = 180, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(bid)).status not in states:
        assert time.monotonic() < deadline, batch
        time.sleep(every)
    return batch


def lines_of(client: openai.OpenAI, fid: str | None) -> list[dict]:
    if fid is None:
        return []
    return [json.loads(x) for x in client.files.content(fid).text.splitlines() if x.strip()]


def test_a_batch_with_bad_lines_completes_and_only_its_tenant_sees_it(api, tmp_path):
    alice, bob = api.client("key-a"), api.client("key-b")
    good = [chat_line(i) for i in range(20)]
    bad = ["{not json", chat_line(100, model="gpt-4o"),
           {"custom_id": "other-url", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}]
    path = write_batch(tmp_path / "batch.jsonl", good[:10] + bad + good[10:])
    f = alice.files.create(file=path.open("rb"), purpose="batch")
    assert f.bytes == path.stat().st_size and alice.files.retrieve(f.id).filename == "batch.jsonl"
    assert alice.files.content(f.id).content == path.read_bytes()
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                 metadata={"team": "a"})
    assert batch.status == "validating" and batch.metadata == {"team": "a"}
    done = wait_for(alice, batch.id, {"completed", "failed", "cancelled", "expired"})
    assert done.status == "completed", done
    assert done.request_counts.total == 23 and done.request_counts.completed == 20 and done.request_counts.failed == 3
    out = lines_of(alice, done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(x["custom_id"] for x in good)
    for x in out:
        assert x["response"]["status_code"] == 200
        ChatCompletion.model_validate(x["response"]["body"])
    errors = lines_of(alice, done.error_file_id)
    assert len(errors) == 3 and all(x["response"]["status_code"] == 400 for x in errors)
    assert any("model 'gpt-4o' is not served" in x["response"]["body"]["error"]["message"] for x in errors)
    assert {b.id for b in alice.batches.list()} >= {batch.id}

    # Tenant B sees none of it.
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(f.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(done.output_file_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(batch.id)
    assert batch.id not in {b.id for b in bob.batches.list()} and f.id not in {x.id for x in bob.files.list()}
    with pytest.raises(openai.AuthenticationError):
        api.client("no-such-key").batches.list()
    assert alice.batches.retrieve(batch.id).status == "completed"  # A's work unaffected
    with pytest.raises(openai.BadRequestError, match="metadata.priority"):  # a job weight is 1..100
        alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                             metadata={"priority": "high"})

    # A file of bad lines only: the batch fails, its errors name the lines.
    only_bad = alice.files.create(file=write_batch(tmp_path / "bad.jsonl", bad).open("rb"), purpose="batch")
    failed = wait_for(alice, alice.batches.create(input_file_id=only_bad.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id, {"completed", "failed"})
    assert failed.status == "failed" and [e.line for e in failed.errors.data] == [1, 2, 3]


def created_batch(client: openai.OpenAI, path: Path, n: int):
    """A batch of `n` chat requests, just created."""
    f = client.files.create(file=write_batch(path, [chat_line(i) for i in range(n)]).open("rb"), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_completed(client: openai.OpenAI, bid: str, done: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while client.batches.retrieve(bid).request_counts.completed < done:
        assert time.monotonic() < deadline
        time.sleep(0.3)


def started_batch(client: openai.OpenAI, path: Path, n: int, done: int):
    """A batch of `n` chat requests, once `done` of them are completed."""
    batch = created_batch(client, path, n)
    wait_completed(client, batch.id, done)
    return batch


def test_a_batch_cancelled_mid_run_keeps_its_results(api, tmp_path):
    alice = api.client("key-a")
    n = 3000
    batch = started_batch(alice, tmp_path / "big.jsonl", n, 300)
    assert alice.batches.cancel(batch.id).status == "cancelling"
    done = wait_for(alice, batch.id, {"cancelled", "completed", "failed"})
    assert done.status == "cancelled", done
    out, errors = lines_of(alice, done.output_file_id), lines_of(alice, done.error_file_id)
    assert 300 <= len(out) < n
    others = [x for x in errors if x["response"] is not None or x["error"]["code"] != "batch_cancelled"]
    assert errors and not others, others[:3]
    ids = [x["custom_id"] for x in out + errors]
    assert len(ids) == len(set(ids)) == n, "every request once: a result or a batch_cancelled line"
    assert done.request_counts.completed == len(out) and done.request_counts.failed == len(errors)


def test_the_api_restarted_mid_batch_finishes_it(api, tmp_path):
    alice = api.client("key-a")
    n = 2000
    batch = started_batch(alice, tmp_path / "long.jsonl", n, 200)
    api.stop()
    api.start()
    done = wait_for(api.client("key-a"), batch.id, {"completed", "failed", "cancelled"})
    assert done.status == "completed" and done.request_counts.completed == n, done
    out = lines_of(api.client("key-a"), done.output_file_id)
    assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
    assert api.client("key-a").files.content(batch.input_file_id).content == (tmp_path / "long.jsonl").read_bytes()


def wait_jobs(url: str, jobs: list[str], bucket: str, decoder, ready, timeout: float = 120) -> list:
    """Each job's record in the KV `bucket` (decoded) once `ready(record)` holds for all."""

    async def main() -> list:
        nc = await connect(url, "tests")
        try:
            kv = await nc.jetstream().key_value(bucket)
            deadline = time.monotonic() + timeout
            while True:
                recs = []
                for job in jobs:
                    with contextlib.suppress(KeyNotFoundError):
                        recs.append(decoder.decode((await kv.get(job)).value))
                if len(recs) == len(jobs) and all(ready(r) for r in recs):
                    return recs
                assert time.monotonic() < deadline, recs
                await asyncio.sleep(0.3)
        finally:
            await close(nc)

    return asyncio.run(main())


def objects_present(url: str, names: list[str]) -> list[str]:
    """Which of these objects the files object store holds."""

    async def main() -> list[str]:
        nc = await connect(url, "tests")
        try:
            objects = await nc.jetstream().object_store(subjects.FILES_OBJ)
            present = []
            for name in names:
                with contextlib.suppress(NotFoundError):
                    await objects.get_info(name)
                    present.append(name)
            return present
        finally:
            await close(nc)

    return asyncio.run(main())


def test_batches_whose_jobs_finish_while_the_api_is_down_complete_at_its_restart(api, cluster, tmp_path):
    """Issue 40: the API stopped (SIGTERM) mid-batch, the jobs completed meanwhile, the
    API started again: each batch ends `completed` with every line in its output file,
    also the one whose input file was deleted before the restart (nothing resubmitted)."""
    alice = api.client("key-a")
    n = 2000  # each: ~10 s of the slow echo engine for both, so they run on after the stop
    kept, gone = (created_batch(alice, tmp_path / f"{name}.jsonl", n) for name in ("kept", "gone"))
    # Every row published (the job sealed): the jobs go on without the API.
    jobs = [subjects.api_job(b.id) for b in (kept, gone)]  # the batch service's namespace
    wait_jobs(cluster.url, jobs, subjects.JOBS_KV, m.job_spec_decoder, lambda s: s.total == n)
    alice.files.delete(gone.input_file_id)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(gone.input_file_id)
    assert {alice.batches.retrieve(b.id).status for b in (kept, gone)} == {"in_progress"}
    api.stop()
    statuses = wait_jobs(cluster.url, jobs, subjects.JOB_STATUS_KV, m.job_status_decoder,
                         lambda st: st.done)
    assert all(st.rows == n and not st.cancelled for st in statuses), statuses
    api.start()
    alice = api.client("key-a")
    for batch in (kept, gone):
        done = wait_for(alice, batch.id, {"completed", "failed", "cancelled", "expired"}, timeout=60)
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (n, n, 0)
        out = lines_of(alice, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(n))
        assert done.error_file_id is None
    # The parsed input kept for finalizing is gone once the batches are final.
    assert objects_present(cluster.url, [name for job in jobs for name in parsed_names(job)]) == []


def test_a_cancel_right_after_create_is_never_undone(api, tmp_path):
    """Issue 40: a 50,000-line batch cancelled at once (while its input is still being
    read), or a batch cancelled the moment it is `in_progress` (as its job is created), ends
    `cancelled`, never back in `in_progress` or `completed`; every request has one line
    (a result or `batch_cancelled`)."""
    alice = api.client("key-a")
    n = 50_000
    files = {"at once": alice.files.create(file=write_batch(tmp_path / "large.jsonl", [chat_line(i) for i in range(n)])
                                          .open("rb"), purpose="batch").id,
             "in_progress": alice.files.create(file=write_batch(tmp_path / "small.jsonl", [chat_line(i) for i in range(2000)])
                                              .open("rb"), purpose="batch").id}
    for when, fid in files.items():
        batch = alice.batches.create(input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h")
        if when == "in_progress":  # the runner is creating its job (the race needs no large file)
            wait_for(alice, batch.id, {"in_progress"}, timeout=60, every=0.02)
        assert alice.batches.cancel(batch.id).status == "cancelling", when
        deadline = time.monotonic() + 120
        while (now := alice.batches.retrieve(batch.id)).status not in ("cancelled", "completed", "failed", "expired"):
            assert now.status in ("cancelling", "finalizing"), (when, now)  # never back to in_progress
            assert time.monotonic() < deadline, (when, now)
            time.sleep(0.1)
        assert now.status == "cancelled", (when, now)
        out, errors = lines_of(alice, now.output_file_id), lines_of(alice, now.error_file_id)
        total = n if when == "at once" else 2000
        codes = {x["response"] is None and x["error"]["code"] for x in errors}
        if when == "at once":  # cancelled while its input was still read: most requests never ran
            assert len(out) < total and codes == {"batch_cancelled"}, when
        else:  # the job may have run every row before the cancel reached it: no cancelled line then
            assert codes <= {"batch_cancelled"}, when
        ids = [x["custom_id"] for x in out + errors]
        assert len(ids) == len(set(ids)) == total, "every request once: a result or a batch_cancelled line"
        assert (now.request_counts.completed, now.request_counts.failed) == (len(out), len(errors)), when


def test_a_cancel_that_found_no_job_cancels_the_job_once_it_is_created(cluster, tmp_path):
    """The window the API's cancel cannot close: the tenant cancels after the runner
    checked the record and before its `submit` created the job (the cancel's `cancel_job`
    found none). The runner's follow cancels the job once it exists, and again when a
    resubmit rewrites its spec without the cancel."""
    from prefixflow.batchapi import lifecycle
    from prefixflow.batchapi.runner import Runner
    from prefixflow.batchapi.store import BatchRec, Store, batch_key, new_id, now
    from prefixflow.shared.bus.provision import provision

    async def main() -> None:
        nc = await connect(cluster.url, "tests")
        try:
            js = nc.jetstream()
            await provision(js)
            store = await Store(nc).open()
            cfg = SimpleNamespace(model="m", served_names="", lora_adapters="")  # what `follow` reads of the config
            runner = await Runner(store, cluster.url, cfg, js, nc).open()
            bid = new_id("batch")
            rec = BatchRec("alice", bid, {"id": bid, "status": "in_progress", "request_counts": {}}, requests=5,
                           validated=True)
            await store.create_batch(rec)
            follow = asyncio.create_task(runner.follow(rec))
            await store.update_batch("alice", bid, lifecycle.cancel(now()))  # the tenant's cancel: no job yet
            spec = m.JobSpec(job=bid, out_dir=str(tmp_path / "out"))
            jobs = await js.key_value(subjects.JOBS_KV)
            try:
                for _ in ("created", "rewritten by a resubmit"):
                    await jobs.put(bid, m.encode_json(spec))
                    deadline = time.monotonic() + 10
                    while not (await runner.job_spec(bid)).cancelled_at:
                        assert time.monotonic() < deadline, "the job was not cancelled"
                        await asyncio.sleep(0.1)
            finally:
                follow.cancel()
                await store.kv.delete(batch_key("alice", bid))  # no API resumes it later
        finally:
            await close(nc)

    asyncio.run(main())
