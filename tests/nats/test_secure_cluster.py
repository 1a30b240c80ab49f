"""One secure cluster: 3 nats-servers (a JetStream cluster) configured by
`prefixflow cluster config`, each node its own network namespace (as root; else the
nodes share 127.0.0.1), the services started
from the systemd units with the generated env files (`tests/fleet.py`), once with
authentication and once with authentication and TLS (certificates made here with
openssl, for clients and routes).

- a client without credentials, or with a wrong password, is refused at once;
- the submitter role cannot subscribe to `pfx.results.>` (nor one job's results), cannot
  create a consumer on the results stream, cannot publish to `pfx.work.*`;
- a job submitted with `prefixflow submit` as the submitter runs end to end (every id
  exactly once), with R3 streams and buckets, and no service hits a permission error;
- a job whose `--out` escapes the sink's root fails with the reason, writing nothing.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time

import nats
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from datagen.dataset import prefix_repetition
from shared.bus.connection import NatsOptions, NatsRefused, close, connect
from shared.wire import subjects
from shared.wire.permissions import kv_stream
from tests.conftest import VENV_BIN
from tests.fleet import Fleet, make_certs, wait_ready

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
    fleet = Fleet(tmp_path / "fleet", 3, model=tiny_model)
    if tls:
        fleet.tls = make_certs(tmp_path / "pki", fleet.lan.addrs if fleet.lan else [])
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


async def check_submitter_is_confined(fleet: Fleet) -> None:
    """The submitter's forbidden operations are denied by the server itself."""
    opts = fleet.options("submitter")
    urls = fleet.url(2).split(",")
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    nc = await nats.connect(servers=urls, error_cb=on_error, connect_timeout=3, **opts.connect_kwargs(urls))
    js = nc.jetstream()
    got = []

    async def on_msg(msg) -> None:
        got.append(msg)

    try:
        await nc.subscribe("pfx.results.>", cb=on_msg)
        await nc.subscribe(subjects.results("someone-elses-job"), cb=on_msg)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError)):
            await js.publish(subjects.work("nats-1-gpu0"), b"not a work batch", timeout=2)
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError, asyncio.TimeoutError, nats.js.errors.APIError)):
            await js.add_consumer(subjects.RESULTS_STREAM.name, durable_name="snoop", filter_subject="pfx.results.>", timeout=2)
        await nc.flush()
        await asyncio.sleep(0.5)
    finally:
        await nc.close()
    denied = "\n".join(errors).lower()  # nats.py lowercases the server's -ERR
    print("\nsubmitter denied:\n" + denied)
    assert 'permissions violation for subscription to "pfx.results.>"' in denied
    assert 'permissions violation for subscription to "pfx.results.someone-elses-job"' in denied
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


async def replicas(fleet: Fleet) -> dict[str, int]:
    nc = await connect(fleet.url(2), "admin", options=fleet.options("admin"))
    try:
        js = nc.jetstream()
        names = [s.name for s in subjects.STREAMS] + [kv_stream(subjects.JOBS_KV), kv_stream(subjects.JOB_STATUS_KV)]
        return {n: (await js.stream_info(n)).config.num_replicas for n in names}
    finally:
        await close(nc)


def submit(fleet: Fleet, data, out, job: str) -> subprocess.CompletedProcess:
    """`prefixflow submit` on node 3 as the submitter (README: set -a; . env; . submitter.env)."""
    argv = [str(VENV_BIN / "prefixflow"), "submit", str(data), "--out", str(out), "--job", job,
            "--max-tokens", "4", "--no-progress", "--timeout", "120"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=fleet.cli_env(2))


@pytest.mark.parametrize("tls", [False, True], ids=["auth", "auth+tls"])
def test_secure_cluster(tmp_path, tiny_model, data, tls):
    if tls and shutil.which("openssl") is None:
        pytest.skip("openssl not installed (the test makes its certificates with it)")
    fleet = start_fleet(tmp_path, tiny_model, tls)
    try:
        asyncio.run(check_refusals(fleet, tls))
        asyncio.run(check_submitter_is_confined(fleet))

        out = fleet.out_root / "job"
        res = submit(fleet, data, out, "secure")
        assert res.returncode == 0, res.stdout + res.stderr + fleet.tail("sink@nats-3")
        assert f"job secure: {N} rows (0 errors)" in res.stdout
        table = pq.read_table(out)
        assert sorted(table.column("id").to_pylist()) == list(range(N)), "every id exactly once"
        assert table.column("error").null_count == N
        assert set(table.column("replica").to_pylist()) <= {"nats-1-gpu0", "nats-2-gpu0"}
        assert asyncio.run(replicas(fleet)) == dict.fromkeys(asyncio.run(replicas(fleet)), 3), "R3 on a 3-server cluster"

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
                bad = [line for line in text.splitlines() if "Violation" in line and "user:submitter" not in line]
            else:
                bad = [line for line in text.splitlines() if "permission denied" in line]
            assert bad == [], (name, bad[:5])
    finally:
        fleet.stop()
