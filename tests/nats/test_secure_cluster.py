"""One secure cluster: 3 nats-servers (a JetStream cluster) configured by
`prefixflow cluster config`, each node its own network namespace (as root; else the
nodes share 127.0.0.1), streams provisioned by the operator (`prefixflow cluster
provision`, admin), the services started from the systemd units with the generated env
files (`tests/fleet.py`), once as generated (TLS by default: the command's own CA and
node certificates, for clients and routes) and once with `--no-tls` (refusals and a job
end to end only: the grants checked below do not depend on the transport).

- a client without credentials, or with a wrong password, is refused at once;
- the submitter role cannot subscribe to `pfx.results.>` (nor one job's results), cannot
  create a consumer on the results stream, cannot publish to `pfx.work.*`;
- an engine-worker's credentials cannot publish results as another replica or a service
  (refused by the server), and the rows it publishes under its own name for prompts it was
  never routed (no grant, a made-up one) are refused by the sink: the job's output has
  only the rows its replicas computed (prefixflow/shared/wire/provenance.py);
- an engine-worker's credentials cannot publish another replica's status or pull its
  work, nor create, update or delete a stream;
- tenants (`cluster config --tenant alice --tenant bob`): alice's job (`prefixflow submit`
  with her env file: job id `alice.<name>`, output under the root's `alice/`) runs, with
  every row, while bob sends cancel notices of it (refused by the server) and alice's own
  credentials send one its spec does not confirm (ignored); bob's credentials can neither
  read nor write alice's job spec or status, publish prompts into her job, ask the sink
  about it nor read its results (each refused by the server), and her job's output and
  status are unchanged by his attempts; `prefixflow cancel` with alice's env cancels a
  job of hers, the spec saying who (`tenant-alice`);
- a job submitted with `prefixflow submit` as the submitter runs end to end (every id
  exactly once), with R3 streams and buckets, and no service hits a permission error;
- a job whose `--out` escapes the sink's root fails with the reason, writing nothing;
- the batch API (`prefixflow-api.service` on the head, its `api.env` and keys file)
  starts under its grant and runs alice's batch (tests/nats/test_fleet_api.py does more
  on one node).
"""

from __future__ import annotations

import asyncio
import subprocess
import time

import msgspec
import nats
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import prefix_repetition
from prefixflow.launch.local_cluster import free_port
from prefixflow.shared.bus.connection import NatsOptions, NatsRefused, close, connect
from prefixflow.shared.wire import messages as m
from prefixflow.shared.bus.kv_keys import bound
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.permissions import kv_stream
from tests.conftest import VENV_BIN
from tests.fleet import Fleet, wait_ready
from tests.nats.test_fleet_api import REQUESTS, run_batch, shell_value

pytestmark = [pytest.mark.nats, pytest.mark.timeout(240)]

N = 300
ECHO = {"PFX_ENGINE": "echo"}


@pytest.fixture(scope="module")
def data(tiny_model, tmp_path_factory):
    table = prefix_repetition(tokenizer_dir=tiny_model, num_prompts=N, prefix_len=64, suffix_len=16, num_prefixes=6, seed=3)
    path = tmp_path_factory.mktemp("secure-data") / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "prompt": r["prompt"]} for r in table.to_pylist()]), path)
    return path


def start_fleet(tmp_path, tiny_model, tls: bool) -> Fleet:
    """Nodes 1 and 2: a bucketer and an engine-worker each; node 3: ingestor, router, sink."""
    fleet = Fleet(tmp_path / "fleet", 3, model=tiny_model, no_tls=not tls, tenants=("alice", "bob"))
    fleet.start()
    try:
        for i in (0, 1):
            fleet.service("prefixflow-bucketer.service", i)
            fleet.service("prefixflow-engine@.service", i, instance="0", env=ECHO)
        for unit in ("ingestor", "router", "sink"):
            fleet.service(f"prefixflow-{unit}.service", 2)
        asyncio.run(wait_ready(fleet.url(2), fleet.options("admin"), ["nats-1-gpu0", "nats-2-gpu0"], 90, fleet.check_alive))
    except BaseException:
        fleet.stop()
        raise
    return fleet


async def refused(url: str, options: NatsOptions) -> str:
    t0 = time.monotonic()
    with pytest.raises((NatsRefused, OSError, nats.errors.Error, TimeoutError)) as exc:
        await connect(url, "intruder", options=options, wait=3)
    assert time.monotonic() - t0 < 15
    return str(exc.value)


async def check_refusals(fleet: Fleet, tls: bool) -> None:
    url = fleet.url(2)
    ca = fleet.options("admin").nats_tls_ca
    why = await refused(url, NatsOptions(nats_tls_ca=ca))
    assert "authorization violation (no credentials)" in why, why
    why = await refused(url, NatsOptions("submitter", "not-the-password", nats_tls_ca=ca))
    assert "authorization violation (user 'submitter')" in why, why
    if tls:
        # The right password, but without the CA: the server's certificate is not trusted.
        await refused(url, NatsOptions(**{**fleet.options("submitter").__dict__, "nats_tls_ca": ""}))


async def connect_collecting(opts: NatsOptions, urls: list[str]) -> tuple[nats.NATS, list[str]]:
    """A raw connection whose asynchronous errors (the server's permission denials) are
    kept in the returned list."""
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(servers=urls, error_cb=on_error, connect_timeout=3, **opts.connect_kwargs(urls))
    return nc, errors


DENIALS_WAIT = 60.0
"""Seconds the server's permission denials (asynchronous -ERR lines) may take to arrive:
a loaded machine's nats-server was seen taking 10 s over one read loop."""


async def denials_arrived(errors: list[str], *expected: str) -> None:
    """Until each `expected` denial (lowercased) is among the connection's errors, or
    DENIALS_WAIT seconds (the assertions after it then say which is missing): a fixed
    wait let a loaded machine close the connection before the -ERR lines came."""
    deadline = time.monotonic() + DENIALS_WAIT
    while time.monotonic() < deadline and not all(e in "\n".join(errors).lower() for e in expected):
        await asyncio.sleep(0.1)


async def check_submitter_is_confined(fleet: Fleet) -> None:
    """The submitter's forbidden operations are denied by the server itself."""
    opts = fleet.options("submitter")
    urls = fleet.url(2).split(",")
    nc, errors = await connect_collecting(opts, urls)
    js = nc.jetstream()
    got = []

    async def on_msg(msg) -> None:
        got.append(msg)

    try:
        await nc.subscribe("pfx.results.>", cb=on_msg)
        await nc.subscribe(subjects.results(subjects.ANY_ORIGIN, "someone-elses-job"), cb=on_msg)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError)):
            await js.publish(subjects.work("nats-1-gpu0"), b"not a work batch", timeout=2)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError, nats.js.errors.APIError)):
            await js.add_consumer(subjects.RESULTS_STREAM.name, durable_name="snoop", filter_subject="pfx.results.>", timeout=2)
        await nc.flush()
        await denials_arrived(errors, 'permissions violation for subscription to "pfx.results.>"',
                              'permissions violation for publish to "$js.api.consumer.durable.create.pfx_results.snoop"')
    finally:
        await nc.close()
    denied = "\n".join(errors).lower()  # nats.py lowercases the server's -ERR
    print("\nsubmitter denied:\n" + denied)
    assert 'permissions violation for subscription to "pfx.results.>"' in denied
    assert 'permissions violation for subscription to "pfx.results.*.someone-elses-job"' in denied
    assert 'permissions violation for publish to "pfx.work.nats-1-gpu0"' in denied
    assert 'permissions violation for publish to "$js.api.consumer.durable.create.pfx_results.snoop"' in denied
    assert got == []
    admin = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        ajs = admin.jetstream()
        assert (await ajs.stream_info(subjects.WORK_STREAM.name)).state.messages == 0, "nothing reached pfx.work"
        with pytest.raises(nats.js.errors.NotFoundError):
            await ajs.consumer_info(subjects.RESULTS_STREAM.name, "snoop")
    finally:
        await close(admin)


async def engine_worker_attempts(opts: NatsOptions, urls: list[str]) -> list[str]:
    """nats-1-gpu0's forbidden publishes, pull and stream changes on a connection of its
    own; returns the errors the connection got (the server's denials among them)."""
    nc, errors = await connect_collecting(opts, urls)
    js = nc.jetstream()
    try:
        await nc.publish(subjects.status("nats-2-gpu0"), b"a forged status")
        await nc.publish(subjects.cache_events("nats-2-gpu0"), b"forged events")
        for call in (
            js.update_stream(name=subjects.WORK_STREAM.name, subjects=list(subjects.WORK_STREAM.subjects), max_msgs=1),
            js.delete_stream(subjects.INGEST_STREAM.name),
            js.add_stream(name="PFX_MINE", subjects=["mine.>"]),
            js.pull_subscribe_bind(durable="engine-nats-2-gpu0", stream=subjects.WORK_STREAM.name),
        ):
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError,
                                nats.js.errors.APIError)):
                sub = await asyncio.wait_for(call, 3)
                await sub.fetch(1, timeout=2)  # only the bind gets here: pulling is what is denied
        await nc.flush()
        await denials_arrived(errors, 'permissions violation for publish to "pfx.status.nats-2-gpu0"',
                              'permissions violation for publish to "$js.api.consumer.msg.next.pfx_work.engine-nats-2-gpu0"')
    finally:
        await nc.close()
    return errors


async def check_engine_worker_is_confined(fleet: Fleet) -> None:
    """nats-1-gpu0's own credentials: another replica's status, work and stream changes
    are denied by the server."""
    opts = fleet.options("engine-worker-0", 0)
    assert opts.nats_user == "engine-nats-1-gpu0"
    urls = fleet.url(0).split(",")
    expected = [f'permissions violation for publish to "{s}"' for s in (
        "pfx.status.nats-2-gpu0", "pfx.cache.nats-2-gpu0", "$js.api.stream.update.pfx_work",
        "$js.api.stream.delete.pfx_ingest", "$js.api.stream.create.pfx_mine",
        "$js.api.consumer.msg.next.pfx_work.engine-nats-2-gpu0")]
    for _ in range(3):
        denied = "\n".join(await engine_worker_attempts(opts, urls)).lower()
        if all(e in denied for e in expected):
            break
        # A transport error cut the TLS connection under load (seen once on CI: "application
        # data after close notify") before the server's -ERR lines arrived: on a new one, again.
        print(f"\nengine-worker denials missing ({denied[:200]}): again")
    print("\nengine-worker nats-1-gpu0 denied:\n" + denied)
    for e in expected:
        assert e in denied, e
    admin = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        ajs = admin.jetstream()
        info = await ajs.stream_info(subjects.WORK_STREAM.name)
        assert info.config.max_msgs == subjects.WORK_STREAM.max_msgs, "the work stream is as provisioned"
        await ajs.stream_info(subjects.INGEST_STREAM.name)
        with pytest.raises(nats.js.errors.NotFoundError):
            await ajs.stream_info("PFX_MINE")
    finally:
        await close(admin)


async def forge_results(fleet: Fleet, job: str) -> str:
    """nats-1-gpu0's own credentials forge ok rows of every id of `job` before the job
    exists (no replica holds any of its prompts): as another replica and as the ingestor
    (denied by the server), and under its own name, without a grant and with a made-up
    one (published: only the sink can tell). Returns the server's denials."""
    opts = fleet.options("engine-worker-0", 0)
    nc, errors = await connect_collecting(opts, fleet.url(0).split(","))
    js = nc.jetstream()
    rows = [m.Result(i, output="forged", replica="nats-1-gpu0", prompt_tokens=1, output_tokens=1) for i in range(N)]
    try:
        for origin in ("nats-2-gpu0", subjects.ORIGIN_INGESTOR):
            posing = [msgspec.structs.replace(r, replica=origin) for r in rows]
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError)):
                await js.publish(subjects.results(origin, job), m.encode(m.ResultBatch(job, posing)), timeout=2)
        for grant in (b"", bytes(12)):
            signed = [msgspec.structs.replace(r, grant=grant) for r in rows]
            await js.publish(subjects.results("nats-1-gpu0", job), m.encode(m.ResultBatch(job, signed)))
        await nc.flush()
        await denials_arrived(errors, f'permissions violation for publish to "{subjects.results("nats-2-gpu0", job)}"',
                              f'permissions violation for publish to "{subjects.results(subjects.ORIGIN_INGESTOR, job)}"')
    finally:
        await nc.close()
    return "\n".join(errors).lower()


async def refused_results(fleet: Fleet, job: str) -> list[str]:
    """The sink's dead letters of `job`'s results from nats-1-gpu0 (the reasons), once
    both forged batches are there."""
    nc = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 60
        while True:
            info = await js.stream_info(subjects.DEAD_STREAM.name,
                                        subjects_filter=subjects.dead(subjects.results("nats-1-gpu0", job)))
            if info.state.messages >= 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        reasons, seq = [], 0
        for _ in range(info.state.messages):
            got = await js.get_msg(subjects.DEAD_STREAM.name, seq=seq + 1, next=True,
                                   subject=subjects.dead(subjects.results("nats-1-gpu0", job)))
            reasons.append((got.headers or {}).get("Pfx-Error", ""))
            seq = got.seq
        return reasons
    finally:
        await close(nc)


async def check_tenants_are_apart(fleet: Fleet, job: str) -> None:
    """Bob's credentials against alice's job `job` (done): every attempt is refused by
    the server, and nothing of hers changes."""
    opts = fleet.options("tenant-bob")
    assert opts.nats_user == "tenant-bob"
    urls = fleet.url(2).split(",")
    admin = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    ajs = admin.jetstream()
    spec_before = (await (await ajs.key_value(subjects.JOBS_KV)).get(job)).value
    status_before = (await (await ajs.key_value(subjects.JOB_STATUS_KV)).get(job)).value

    nc, errors = await connect_collecting(opts, urls)
    js = nc.jetstream()
    got = []

    async def on_msg(msg) -> None:
        got.append(msg)

    denied_calls = (nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError, nats.js.errors.APIError)
    try:
        await nc.subscribe(subjects.results(subjects.ANY_ORIGIN, job), cb=on_msg)
        jobs_kv = bound(js, subjects.JOBS_KV)  # as every client binds it: no stream info
        status_kv = bound(js, subjects.JOB_STATUS_KV)
        for call in (jobs_kv.get(job), status_kv.get(job), jobs_kv.put(job, b'{"job": "hijacked"}'),
                     js.stream_info(f"KV_{subjects.JOBS_KV}", subjects_filter=">"),  # would list every job id
                     js.stream_info(subjects.INGEST_STREAM.name, subjects_filter=">"),
                     js.publish(subjects.ingest(job), b"[]", timeout=2),
                     nc.request(subjects.done_query(job), b"", timeout=2)):
            with pytest.raises(denied_calls):
                await asyncio.wait_for(call, 3)
        await nc.flush()
        await denials_arrived(errors, f'permissions violation for publish to "{subjects.done_query(job).lower()}"')
    finally:
        await nc.close()
    denied = "\n".join(errors).lower()
    print(f"\ntenant bob denied on alice's job {job}:\n" + denied)
    j = job.lower()
    assert f'permissions violation for subscription to "pfx.results.*.{j}"' in denied
    for bucket in (subjects.JOBS_KV, subjects.JOB_STATUS_KV):
        b = bucket.lower()
        assert f'permissions violation for publish to "$js.api.direct.get.kv_{b}.$kv.{b}.{j}"' in denied, bucket
    assert f'permissions violation for publish to "$kv.{subjects.JOBS_KV.lower()}.{j}"' in denied
    for stream in (f"KV_{subjects.JOBS_KV}", subjects.INGEST_STREAM.name):
        assert f'permissions violation for publish to "$js.api.stream.info.{stream.lower()}"' in denied, stream
    assert f'permissions violation for publish to "{subjects.ingest(job).lower()}"' in denied
    assert f'permissions violation for publish to "{subjects.done_query(job).lower()}"' in denied
    assert got == []
    try:
        assert (await (await ajs.key_value(subjects.JOBS_KV)).get(job)).value == spec_before
        assert (await (await ajs.key_value(subjects.JOB_STATUS_KV)).get(job)).value == status_before
        assert (await ajs.stream_info(subjects.INGEST_STREAM.name)).state.messages == 0
    finally:
        await close(admin)


async def spoof_cancels(fleet: Fleet, job: str, submit: subprocess.Popen) -> tuple[str, int]:
    """While alice's `submit` of `job` runs: bob sends cancel notices of it, on its subject
    and on the old shared one (each refused by the server: his grant names his own jobs'
    subjects only), and alice herself one that her job's spec does not confirm (allowed,
    and ignored by her submit). Returns bob's denials (lowercased) and the rounds sent."""
    urls = fleet.url(2).split(",")
    bob, bob_errors = await connect_collecting(fleet.options("tenant-bob"), urls)
    alice, alice_errors = await connect_collecting(fleet.options("tenant-alice"), urls)
    rounds = 0
    try:
        while rounds == 0 or submit.poll() is None:  # at least one round, however soon her job ends
            await bob.publish(subjects.job_cancelled(job), m.encode(m.CancelNotice(job, "tenant-bob", time.time())))
            await bob.publish("pfx.jobs.cancelled", job.encode())  # the notice that stalled any job before
            await alice.publish(subjects.job_cancelled(job), m.encode(m.CancelNotice(job, "tenant-alice")))
            await bob.flush()
            await alice.flush()
            rounds += 1
            await asyncio.sleep(0.1)
        await denials_arrived(bob_errors, f'permissions violation for publish to "{subjects.job_cancelled(job).lower()}"',
                              'permissions violation for publish to "pfx.jobs.cancelled"')
    finally:
        await bob.close()
        await alice.close()
    assert alice_errors == [], alice_errors
    return "\n".join(bob_errors).lower(), rounds


async def alice_cancels_her_own(fleet: Fleet) -> m.JobSpec:
    """`prefixflow cancel` with alice's env of a job of hers (its spec only): her grant
    covers the spec's compare-and-set and the notice; the spec records who cancelled."""
    nc = await connect(fleet.url(2), "alice", options=fleet.options("tenant-alice"))
    try:
        kv = bound(nc.jetstream(), subjects.JOBS_KV)  # her grant: no stream info
        await kv.put("alice.stop", m.encode_json(m.JobSpec(job="alice.stop", out_dir=str(fleet.out_root / "alice" / "stop"))))
    finally:
        await close(nc)
    res = subprocess.run([str(VENV_BIN / "prefixflow"), "cancel", "stop", "--no-wait"], capture_output=True, text=True,
                         timeout=60, env=fleet.cli_env(2, "tenant-alice"))
    assert res.returncode == 0 and "job alice.stop: cancelling" in res.stdout, res.stdout + res.stderr
    admin = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        return m.job_spec_decoder.decode((await (await admin.jetstream().key_value(subjects.JOBS_KV)).get("alice.stop")).value)
    finally:
        await close(admin)


async def replicas(fleet: Fleet) -> dict[str, int]:
    nc = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        js = nc.jetstream()
        names = [s.name for s in subjects.STREAMS] + [kv_stream(subjects.JOBS_KV), kv_stream(subjects.JOB_STATUS_KV)]
        return {n: (await js.stream_info(n)).config.num_replicas for n in names}
    finally:
        await close(nc)


def submit(fleet: Fleet, data, out, job: str, *extra: str) -> subprocess.CompletedProcess:
    """`prefixflow submit` on node 3 as the submitter (README: set -a; . env; . submitter.env)."""
    argv = [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--job", job,
            "--max-tokens", "4", "--no-progress", "--timeout", "120", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=fleet.cli_env(2))


@pytest.mark.parametrize("tls", [True, False], ids=["default-tls", "no-tls"])
def test_secure_cluster(tmp_path, tiny_model, data, tls):
    fleet = start_fleet(tmp_path, tiny_model, tls)
    try:
        assert fleet.url(2).startswith("tls://" if tls else "nats://")
        asyncio.run(check_refusals(fleet, tls))
        if tls:  # the grants do not depend on the transport: checked once (suite time)
            asyncio.run(check_submitter_is_confined(fleet))
            asyncio.run(check_engine_worker_is_confined(fleet))

        if tls:  # an engine answers only the prompts routed to it (provenance.py)
            denied = asyncio.run(forge_results(fleet, "forged"))
            res = submit(fleet, data, fleet.out_root / "forged", "forged")
            assert res.returncode == 0 and f"job forged: {N} rows (0 errors)" in res.stdout, res.stdout + res.stderr
            got = pq.read_table(fleet.out_root / "forged").to_pylist()
            assert sorted(r["id"] for r in got) == list(range(N)) and not any(r["output"] == "forged" for r in got)
            reasons = asyncio.run(refused_results(fleet, "forged"))
            print(f"\nforged results: server denied {denied.count('violation')}, sink refused {len(reasons)}: {reasons[0][:120]}")
            assert len(reasons) == 2 and all("holds no assignment" in r for r in reasons), reasons

        out = fleet.out_root / "job"
        res = submit(fleet, data, out, "secure")
        assert res.returncode == 0, res.stdout + res.stderr + fleet.tail("sink@nats-3")
        assert f"job secure: {N} rows (0 errors)" in res.stdout
        table = pq.read_table(out)
        assert sorted(table.column("id").to_pylist()) == list(range(N)), "every id exactly once"
        assert table.column("error").null_count == N
        assert set(table.column("replica").to_pylist()) <= {"nats-1-gpu0", "nats-2-gpu0"}
        assert asyncio.run(replicas(fleet)) == dict.fromkeys(asyncio.run(replicas(fleet)), 3), "R3 on a 3-server cluster"

        if tls:  # the tenants' separation is the grants': checked once
            # Tenants: alice's job runs under her own id and part of the root; bob cannot touch
            # it, nor stall it with cancel notices (refused), nor can her own unconfirmed ones.
            proc = subprocess.Popen(
                [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(fleet.out_root / "alice" / "report"),
                 "--job", "report", "--max-tokens", "4", "--no-progress", "--timeout", "120"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fleet.cli_env(2, "tenant-alice"))
            try:
                denied, rounds = asyncio.run(spoof_cancels(fleet, "alice.report", proc))
                out_s, err_s = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
            print(f"\ntenant bob's cancel notices of alice's job ({rounds} rounds) denied:\n" + denied[:400])
            assert 'permissions violation for publish to "pfx.jobs.cancelled.alice.report"' in denied, denied
            assert 'permissions violation for publish to "pfx.jobs.cancelled"' in denied, denied
            assert proc.returncode == 0, out_s + err_s
            assert f"job alice.report: {N} rows (0 errors)" in out_s, out_s
            assert "permission" not in err_s.lower(), err_s
            assert "ignored a cancel notice" in err_s, err_s  # hers, unconfirmed by her job's spec
            alice_out = fleet.out_root / "alice" / "report"
            assert sorted(pq.read_table(alice_out).column("id").to_pylist()) == list(range(N))
            asyncio.run(check_tenants_are_apart(fleet, "alice.report"))
            assert sorted(pq.read_table(alice_out).column("id").to_pylist()) == list(range(N)), "her output unchanged"
            # bob's own job may not write into alice's part of the output root
            res = subprocess.run(
                [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(fleet.out_root / "alice" / "mine"),
                 "--job", "mine", "--max-tokens", "4", "--no-progress", "--timeout", "120"],
                capture_output=True, text=True, timeout=180, env=fleet.cli_env(2, "tenant-bob"))
            assert res.returncode != 0 and "outside the sink's output root" in res.stderr, res.stdout + res.stderr
            assert not (fleet.out_root / "alice" / "mine").exists()
            # nor the submitter's (a job without a tenant), even with --overwrite of hers
            res = submit(fleet, data, alice_out, "hijack", "--overwrite")
            assert res.returncode != 0 and "tenant 'alice''s directory" in res.stderr, res.stdout + res.stderr
            assert sorted(pq.read_table(alice_out).column("id").to_pylist()) == list(range(N)), "her output untouched"
            stopped = asyncio.run(alice_cancels_her_own(fleet))
            assert stopped.cancelled_at and stopped.cancelled_by == "tenant-alice", stopped

            # The batch API on the head, as `cluster config` set it up: alice's batch completes.
            port = free_port()
            fleet.api(2, port)
            key = shell_value([fleet.etc_root / "clients" / "tenant-alice.env"], "OPENAI_API_KEY")
            alice = openai.OpenAI(api_key=key, base_url=fleet.api_url(2, port), max_retries=0)
            _, batch = run_batch(alice, tmp_path / "batch.jsonl", tiny_model.name)
            assert batch.status == "completed" and batch.request_counts.completed == REQUESTS, batch

        escape = fleet.out_root / ".." / "escape"
        res = submit(fleet, data, escape, "escape")
        assert res.returncode != 0
        assert "job escape failed" in res.stderr and "outside the sink's output root" in res.stderr, res.stderr
        assert not (fleet.workdir / "escape").exists()
        print(f"\nescaping --out: {res.stderr.strip()}")

        # The grants are enough for every service: no permission error in any log.
        for name, proc in fleet.procs.items():
            text = proc.log.read_text(errors="replace")
            if name.startswith("nats-"):  # the servers log every violation, with the user
                forged = ("nats-2-gpu0", "PFX_MINE", "STREAM.UPDATE.PFX_WORK", "STREAM.DELETE.PFX_INGEST", "_ingestor")
                bad = [line for line in text.splitlines() if "Violation" in line
                       and not any(f"user:{u}" in line for u in ("submitter", "tenant-bob"))
                       and not ("user:engine-nats-1-gpu0" in line and any(f in line for f in forged))]
            else:
                bad = [line for line in text.splitlines() if "permission denied" in line]
            assert bad == [], (name, bad[:5])
    finally:
        fleet.stop()
