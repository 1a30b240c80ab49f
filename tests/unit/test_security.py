"""Security pieces that need no server: job ids, confined output paths, the NATS roles
generated from the subjects module, and what `prefixflow cluster config` writes (the
committed deploy/nats configs are its output, checked for drift)."""

from __future__ import annotations

import asyncio
import inspect
import json
import stat
import ssl
from pathlib import Path

import pytest

from prefixflow.launch.fleet_config import all_users, render_permissions, render_server
from prefixflow.cli.main import build_parser
from prefixflow.services.sink.writer import OutsideRoot, confine
from prefixflow.shared.bus.connection import NatsOptions
from prefixflow.shared.bus.provision import cluster_size, replicas_for
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.permissions import ROLES, SERVICE_ROLES, allowed, matches, permissions

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]

# --- job ids -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job,why",
    [
        ("", "it is empty"),
        ("a.b.c", "it contains more than one '.' (a job id is NAME, or TENANT.NAME)"),
        ("a.", "its name '': it is empty"),
        ("dir.x", "its tenant 'dir': 'dir' is reserved"),
        ("t.a*", "its name 'a*': it contains the NATS wildcard '*'"),
        ("a*", "it contains the NATS wildcard '*'"),
        ("x>", "it contains the NATS wildcard '>'"),
        ("my job", "it contains whitespace"),
        ("tab\there", "it contains whitespace"),
        ("j" * 65, "it is 65 characters long (at most 64)"),
        ("é", "it contains 'é'; use letters, digits, '-' and '_'"),
    ],
)
def test_bad_job_ids_are_refused_with_the_reason(job, why):
    assert subjects.job_problem(job) == why
    from prefixflow.client.submit import submit
    from prefixflow.shared.wire.messages import SamplingSpec

    with pytest.raises(SystemExit) as exc:  # before connecting to anything
        asyncio.run(submit("x.parquet", nats_url="nats://127.0.0.1:1", job=job, out_dir="out", sampling=SamplingSpec()))
    assert str(exc.value).startswith(f"invalid job id {job!r}: {why} (a job id is letters, digits")


@pytest.mark.parametrize("job", ["a", "job-2026_01", "x" * 64, "alice.nightly", "t-1.job_2"])
def test_good_job_ids(job):
    assert subjects.job_problem(job) is None


def test_a_tenants_job_id_is_a_token_of_its_own_in_every_subject_and_key():
    job = subjects.qualify("nightly", "alice")
    assert job == "alice.nightly" and subjects.qualify("alice.nightly", "alice") == job
    assert subjects.qualify("nightly", "") == "nightly" and subjects.tenant_of("nightly") == ""
    assert subjects.tenant_of(job) == "alice"
    for subject in (subjects.ingest(job), subjects.results("r0", job), subjects.done_query(job)):
        assert subject.split(".")[-2:] == ["alice", "nightly"]
    assert subjects.job_from_subject(subjects.ingest(job)) == job
    assert subjects.origin_and_job(subjects.results("r0", job)) == ("r0", job)
    assert subjects.origin_and_job(subjects.results(subjects.ORIGIN_INGESTOR, "plain")) == ("_ingestor", "plain")
    assert subjects.origin_and_job("pfx.results.plain") == ("plain", ""), "a subject of an earlier version names no job"
    assert subjects.job_of_done_query(subjects.done_query(job)) == job
    assert subjects.bucket_parts(subjects.bucket("n1", job)) == ("n1", job)
    assert subjects.bucket_parts(subjects.bucket("n1", "plain")) == ("n1", "plain")
    assert "." not in subjects.bucketer_consumer("n1", job).durable
    assert subjects.bucketer_consumer("n1", job).durable != subjects.bucketer_consumer("n1", "alice_nightly").durable
    assert subjects.dir_key("/out/x", "alice").startswith("alice.dir.") and subjects.is_dir_key(subjects.dir_key("/out/x", "alice"))
    assert subjects.is_dir_key(subjects.dir_key("/out/x")) and not subjects.is_dir_key(job)
    for spec in subjects.STREAMS:  # every job subject lands in its stream, with a tenant or without
        for subject in (subjects.ingest(job), subjects.bucket("n1", job), subjects.results("r0", job), subjects.blob_piece(job, "k", 0)):
            if subject.split(".")[1] == spec.subjects[0].split(".")[1]:
                assert any(matches(p, subject) for p in spec.subjects), (spec.name, subject)


def test_a_tenant_may_touch_only_its_own_jobs():
    alice = lambda action, subject: allowed("tenant", action, subject, "alice")  # noqa: E731
    mine, theirs, plain = "alice.j1", "bob.j1", "j1"
    assert alice("publish", subjects.ingest(mine)) and alice("publish", subjects.blob_piece(mine, "k", 3))
    assert alice("publish", subjects.done_query(mine))
    assert alice("publish", f"$KV.{subjects.JOBS_KV}.{mine}") and alice("publish", f"$KV.{subjects.JOBS_KV}.{subjects.dir_key('/o', 'alice')}")
    assert alice("publish", f"$JS.API.DIRECT.GET.KV_{subjects.JOB_STATUS_KV}.$KV.{subjects.JOB_STATUS_KV}.{mine}")
    for other in (theirs, plain):
        assert not alice("publish", subjects.ingest(other)) and not alice("publish", subjects.blob_piece(other, "k", 3))
        assert not alice("publish", subjects.done_query(other))
        assert not alice("publish", f"$KV.{subjects.JOBS_KV}.{other}")
        for bucket in (subjects.JOBS_KV, subjects.JOB_STATUS_KV):
            assert not alice("publish", f"$JS.API.DIRECT.GET.KV_{bucket}.$KV.{bucket}.{other}")
    assert alice("publish", subjects.job_cancelled(mine)) and alice("subscribe", subjects.job_cancelled(mine))
    for other in (theirs, plain):  # cancel notices: of her own jobs only (sent or read)
        assert not alice("publish", subjects.job_cancelled(other)) and not alice("subscribe", subjects.job_cancelled(other))
    for subject in (subjects.ALL_JOB_CANCELLED, "pfx.jobs.cancelled", "pfx.jobs.>"):
        assert not alice("publish", subject) and not alice("subscribe", subject), subject
    assert allowed("submitter", "publish", subjects.job_cancelled(plain))
    assert not allowed("submitter", "publish", subjects.job_cancelled(mine))
    assert not allowed("submitter", "subscribe", subjects.job_cancelled(mine))
    for role in ("ingestor", "engine-worker", "sink"):  # they follow every job's notices, and send none
        assert allowed(role, "subscribe", subjects.ALL_JOB_CANCELLED) and not allowed(role, "publish", subjects.job_cancelled(mine))
    assert not alice("publish", f"$KV.{subjects.JOBS_KV}.{subjects.dir_key('/o')}"), "no other's directory bindings"
    for subject in (f"$JS.API.DIRECT.GET.KV_{subjects.JOBS_KV}", f"$JS.API.STREAM.MSG.GET.KV_{subjects.JOBS_KV}",
                    f"$KV.{subjects.JOB_STATUS_KV}.{mine}", subjects.results("r0", mine), "$JS.API.CONSUMER.CREATE.KV_PFX_JOBS"):
        assert not alice("publish", subject), "gets that name the key in the body, status writes, results, listing"
    for subject in ("pfx.results.>", subjects.results("r0", mine), subjects.ALL_STATUS, f"$KV.{subjects.JOBS_KV}.>"):
        assert not alice("subscribe", subject), subject
    # No stream info on any stream: with a subject filter it lists every tenant's job,
    # batch and file ids (issue 40, item 5); the client binds its buckets without it.
    from prefixflow.shared.wire.permissions import ALL_STREAMS, JS_API

    for role, tenant in (("tenant", "alice"), ("submitter", "")):
        for stream in ALL_STREAMS:
            assert not allowed(role, "publish", f"{JS_API}.STREAM.INFO.{stream}", tenant), (role, stream)
        assert not allowed(role, "publish", f"{JS_API}.STREAM.NAMES", tenant)
        assert not allowed(role, "publish", f"{JS_API}.STREAM.LIST", tenant)
        probe = subjects.probe_key(tenant)  # its check that the buckets are there: one of its own keys
        assert allowed(role, "publish", f"{JS_API}.DIRECT.GET.KV_{subjects.JOBS_KV}.$KV.{subjects.JOBS_KV}.{probe}", tenant)
    # The submitter (jobs without a tenant) cannot touch a tenant's either.
    assert allowed("submitter", "publish", subjects.ingest(plain))
    assert not allowed("submitter", "publish", subjects.ingest(mine))
    assert not allowed("submitter", "publish", f"$KV.{subjects.JOBS_KV}.{mine}")
    assert not allowed("submitter", "publish", f"$JS.API.DIRECT.GET.KV_{subjects.JOB_STATUS_KV}.$KV.{subjects.JOB_STATUS_KV}.{mine}")


# --- confined output -----------------------------------------------------------------


def test_confine(tmp_path):
    root = tmp_path / "root"
    (root / "in").mkdir(parents=True)
    (tmp_path / "out").mkdir()
    (root / "up").symlink_to(tmp_path / "out")
    (root / "side").symlink_to(root / "in")
    assert confine(root, str(root / "job")) == root / "job"
    assert confine(root, "rel/job") == root / "rel" / "job"
    assert confine(root, str(root)) == root
    assert confine(root, str(root / "side" / "job")) == root / "in" / "job", "a symlink that stays inside is fine"
    for escaping in (f"{root}/../x", str(tmp_path / "x"), "/etc", "../x", str(root / "up" / "job"), f"{root}-evil/x",
                     f"{tmp_path}/../{tmp_path.name}/elsewhere"):
        with pytest.raises(OutsideRoot, match="outside the sink's output root"):
            confine(root, escaping)
    for bad in ("", "a\0b"):
        with pytest.raises(OutsideRoot, match="invalid out_dir"):
            confine(root, bad)


# --- roles ---------------------------------------------------------------------------


def test_submitter_may_submit_and_follow_and_nothing_else():
    may = lambda action, subject: allowed("submitter", action, subject)  # noqa: E731
    assert may("publish", subjects.ingest("job1"))
    assert may("publish", f"$KV.{subjects.JOBS_KV}.job1")
    assert may("publish", f"$JS.API.DIRECT.GET.KV_{subjects.JOB_STATUS_KV}.$KV.{subjects.JOB_STATUS_KV}.job1")
    assert may("subscribe", "_INBOX_submitter.abc.*")
    for subject in (subjects.work("r0"), subjects.bucket("n0", "job1"), subjects.results("r0", "job1"), subjects.status("r0"),
                    subjects.dead("x"), subjects.ROUTE, subjects.ROUTER_POLICY, subjects.engine_reset("r0"),
                    f"$KV.{subjects.JOB_STATUS_KV}.job1", "$JS.API.STREAM.CREATE.PFX_WORK", "$JS.API.STREAM.DELETE.PFX_INGEST",
                    "$JS.API.CONSUMER.CREATE.PFX_RESULTS.snoop", "$JS.API.CONSUMER.MSG.NEXT.PFX_RESULTS.sink",
                    "$JS.API.STREAM.PURGE.PFX_INGEST"):
        assert not may("publish", subject), subject
    for subject in ("pfx.results.>", subjects.results("r0", "job1"), "pfx.>", ">", "_INBOX.>", "_INBOX_sink.>", subjects.work("r0")):
        assert not may("subscribe", subject), subject
    # The replicas' status (load, prompts held per job): the progress line shows work under way.
    assert may("subscribe", subjects.ALL_STATUS)


def test_services_have_what_they_need():
    assert allowed("ingestor", "publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_INGEST.ingestor")
    assert allowed("ingestor", "publish", "$JS.ACK.PFX_INGEST.ingestor.1.2.3.4.5")
    assert allowed("ingestor", "publish", subjects.bucket("node7", "j"))
    assert allowed("ingestor", "publish", subjects.results(subjects.ORIGIN_INGESTOR, "j"))
    assert allowed("ingestor", "publish", subjects.dead(subjects.ingest("j")))
    assert not allowed("ingestor", "publish", subjects.work("r0"))
    assert allowed("bucketer", "publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_BUCKET.bucketer-node7")
    assert allowed("bucketer", "publish", subjects.ROUTE) and allowed("bucketer", "publish", subjects.work("r0"))
    assert allowed("router", "subscribe", subjects.ROUTE) and permissions("router").allow_responses
    assert allowed("router", "publish", "$JS.API.CONSUMER.DELETE.PFX_WORK.engine-r3"), "failover takes a dead replica's work"
    assert allowed("engine-worker", "subscribe", subjects.engine_reset("r0")) and permissions("engine-worker").allow_responses
    assert allowed("engine-worker", "publish", subjects.results("r0", "j")) and not allowed("engine-worker", "publish", subjects.ingest("j"))
    assert allowed("sink", "publish", f"$KV.{subjects.JOB_STATUS_KV}.j") and not allowed("sink", "publish", f"$KV.{subjects.JOBS_KV}.j")
    assert not allowed("sink", "subscribe", "pfx.>")
    for role in ROLES[:-1]:
        for op in ("CREATE", "UPDATE", "DELETE", "PURGE"):
            assert not allowed(role, "publish", f"$JS.API.STREAM.{op}.PFX_WORK"), (role, op)
            assert not allowed(role, "publish", f"$JS.API.STREAM.{op}.KV_{subjects.JOBS_KV}"), (role, op)
        inbox = f"{subjects.inbox_prefix(role)}.x.y"
        assert allowed(role, "subscribe", inbox) and [r for r in ROLES[:-1] if allowed(r, "subscribe", inbox)] == [role]


OPERATOR_ONLY = {subjects.ROUTER_POLICY, subjects.engine_reset("x"), subjects.engine_scheduling("x"),
                 subjects.engine_status_request("x")}
"""Requests only operators (admin: benchmarks, tests) send."""


def every_subject() -> set[str]:
    """Every subject the subjects module spells: its str-valued constants under the
    prefix, and its one-argument helpers called with a token."""
    found = set()
    for name, value in vars(subjects).items():
        if isinstance(value, str) and value.startswith(subjects.PREFIX + "."):
            found.add(value)
        elif inspect.isfunction(value) and value.__module__ == subjects.__name__ and name not in (
                "job_from_subject", "is_valid_name", "name_problem", "inbox_prefix"):
            params = inspect.signature(value).parameters
            if len(params) == 1 and all(p.annotation in (str, "str") for p in params.values()):
                result = value("x")
                if isinstance(result, str) and result.startswith(subjects.PREFIX + "."):
                    found.add(result)
    found.add(subjects.results("x", "x"))  # two tokens: a replica's results
    found.add(subjects.results(subjects.ORIGIN_INGESTOR, "x"))
    found.add(subjects.results(subjects.ORIGIN_BUCKETER, "x"))
    return found


def test_every_subject_in_the_subjects_module_has_a_publisher_and_a_reader():
    """A subject added to subjects.py without a grant fails here (the cluster would
    deny it)."""
    streams = {sub: spec.name for spec in subjects.STREAMS for sub in spec.subjects}
    services_and_submitter = [r for r in ROLES if r != "admin"]
    found = every_subject()
    assert len(found) >= 15, found
    for subject in found:
        publishers = [r for r in services_and_submitter if allowed(r, "publish", subject)]
        assert publishers or subject in OPERATOR_ONLY, f"nobody may publish {subject}"
        stream = next((name for pattern, name in streams.items() if matches(pattern, subject)), None)
        if stream is None:
            readers = [r for r in SERVICE_ROLES if allowed(r, "subscribe", subject)]
        else:
            readers = [r for r in SERVICE_ROLES if any(p.startswith(f"$JS.API.CONSUMER.MSG.NEXT.{stream}.") for p in permissions(r).publish)]
            readers += ["(kept)"] if stream == subjects.DEAD_STREAM.name else []
            readers += [r for r in SERVICE_ROLES if f"$JS.API.STREAM.MSG.GET.{stream}" in permissions(r).publish
                        and stream == subjects.PARKED_STREAM.name]  # read back by subject
        assert readers, f"nobody may read {subject}"


def test_each_bucketer_and_engine_worker_may_use_only_its_own_subjects():
    """Per-process grants: an engine-worker pulls only its own work and publishes only its
    own status, cache events and (suspect) work; a bucketer pulls only its node's prompts."""
    eng = lambda action, subject: allowed("engine-worker", action, subject, "n1-gpu0")  # noqa: E731
    assert eng("publish", subjects.status("n1-gpu0")) and not eng("publish", subjects.status("n2-gpu0"))
    assert eng("publish", subjects.cache_events("n1-gpu0")) and not eng("publish", subjects.cache_events("n1-gpu1"))
    assert eng("publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_WORK.engine-n1-gpu0")
    assert not eng("publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_WORK.engine-n2-gpu0")
    assert not eng("publish", "$JS.ACK.PFX_WORK.engine-n2-gpu0.1.2.3.4.5")
    assert eng("publish", subjects.work("n1-gpu0")) and not eng("publish", subjects.work("n2-gpu0"))
    assert eng("subscribe", subjects.engine_reset("n1-gpu0")) and not eng("subscribe", subjects.engine_reset("n2-gpu0"))
    assert eng("subscribe", "_INBOX_engine-n1-gpu0.x") and not eng("subscribe", "_INBOX_engine-n2-gpu0.x")
    assert eng("publish", subjects.results("n1-gpu0", "j")), "results of the jobs it runs, under its own name"
    assert eng("publish", subjects.results("n1-gpu0", "alice.j"))
    for origin in ("n2-gpu0", "n1-gpu1", subjects.ORIGIN_INGESTOR, subjects.ORIGIN_BUCKETER, "*"):
        assert not eng("publish", subjects.results(origin, "j")), origin  # never as another replica or a service
    buck = lambda action, subject: allowed("bucketer", action, subject, "n1")  # noqa: E731
    assert buck("publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_BUCKET.bucketer-n1-job7")
    assert buck("publish", "$JS.API.CONSUMER.CREATE.PFX_BUCKET.bucketer-n1-job7.pfx.bucket.n1.job7")
    assert not buck("publish", "$JS.API.CONSUMER.CREATE.PFX_BUCKET.bucketer-n1-job7.pfx.bucket.n2.job7")
    assert not buck("publish", "$JS.API.CONSUMER.DURABLE.CREATE.PFX_BUCKET.bucketer-n2-job7")
    assert buck("publish", subjects.bucketer_heartbeat("n1")) and not buck("publish", subjects.bucketer_heartbeat("n2"))
    with pytest.raises(ValueError, match="per process"):
        permissions.__globals__["user_name"]("engine-worker")
    with pytest.raises(ValueError, match="separates NATS subject tokens"):
        permissions("engine-worker", "a.b")


def test_a_jobs_model_is_matched_by_name_without_touching_the_file_system(tmp_path, monkeypatch):
    """The ingestor once resolved a job's `model` as a path on its host (`os.path.exists`):
    a submitter could probe for files there."""
    import os

    from prefixflow.services.ingestor.service import same_model

    def no_look(*_a, **_k):
        raise AssertionError("the file system was looked at")

    for fn in ("exists", "realpath", "isdir", "isfile"):
        monkeypatch.setattr(os.path, fn, no_look)
    assert same_model("/models/Qwen3-8B", "/models/Qwen3-8B")
    assert same_model("/opt/models/Qwen3-8B/", "Qwen/Qwen3-8B"), "the same model by its name"
    assert not same_model("/etc/passwd", "/models/Qwen3-8B")
    assert not same_model("", "/models/Qwen3-8B")


def test_admin_may_do_anything():
    assert permissions("admin").publish == (">",) and permissions("admin").subscribe == (">",)


# --- cluster config ------------------------------------------------------------------


def default_args(*extra: str):
    return build_parser().parse_args(["cluster", "config", "--out", "unused", *extra])


def test_committed_deploy_nats_configs_are_the_generated_ones():
    """deploy/nats is `prefixflow cluster config --nodes 3` (hosts nats-1..3) minus the
    secret files: regenerate it when subjects or the generator change."""
    from prefixflow.launch.fleet_config import parse_nodes

    args = default_args()
    nodes = parse_nodes(["nats-1", "nats-2", "nats-3"], None, args)
    assert (REPO / "deploy/nats/permissions.conf").read_text() == render_permissions(all_users(nodes, "nats-1", ["0"]))
    for node in nodes:
        assert (REPO / f"deploy/nats/{node.name}.conf").read_text() == render_server(node, nodes, args), node.name


def run_config(out: Path, *extra: str) -> None:
    args = build_parser().parse_args(["cluster", "config", "--out", str(out), *extra])
    args.fn(args)


def env_of(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line and not line.startswith("#"))


def test_cluster_config_writes_each_node_only_its_own_secrets(tmp_path, capsys):
    out = tmp_path / "fleet"
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2,10.0.0.3", "--names", "a,b,c", "--head", "c", "--engines", "0,1",
               "--model", "/models/q")
    assert sorted(p.name for p in out.iterdir()) == ["a", "b", "c", "ca", "clients", "secrets.json"]
    common = {"nats-server.conf", "users.conf", "permissions.conf", "env", "ca.pem", "server-cert.pem", "server-key.pem"}
    workers = {"bucketer.env", "engine-worker-0.env", "engine-worker-1.env"}
    head = {"ingestor.env", "router.env", "sink.env", "api.env"}
    for node in "abc":
        files = {p.name for p in (out / node).iterdir()}
        assert files == common | workers | (head if node == "c" else set()), node
        assert not files & {"admin.env", "submitter.env", "secrets.json", "ca-key.pem"}, "operators' secrets apart"
        for name in files:
            mode = stat.S_IMODE((out / node / name).stat().st_mode)
            secret = name.endswith(".env") or name in ("users.conf", "server-key.pem")
            assert mode == (0o600 if secret else 0o644), (node, name, oct(mode))
    assert {p.name for p in (out / "clients").iterdir()} == {"env", "ca.pem", "admin.env", "submitter.env"}
    assert stat.S_IMODE((out / "secrets.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca" / "ca-key.pem").stat().st_mode) == 0o600

    # Each process's file holds its own user; no node holds a password of another node's processes.
    secrets = json.loads((out / "secrets.json").read_text())
    passwords = secrets["users"]
    assert env_of(out / "b" / "bucketer.env")["PFX_NATS_USER"] == "bucketer-b"
    eng = env_of(out / "b" / "engine-worker-1.env")
    assert (eng["PFX_NATS_USER"], eng["PFX_REPLICA"]) == ("engine-b-gpu1", "b-gpu1")
    for node in "abc":
        texts = "".join((out / node / f).read_text() for f in sorted(p.name for p in (out / node).iterdir()))
        own = {env_of(out / node / f)["PFX_NATS_USER"] for f in workers | (head if node == "c" else set())}
        for user, pw in passwords.items():
            assert (pw in texts) == (user in own), (node, user)
        assert secrets["route"] in (out / node / "users.conf").read_text(), "the servers' own route secret"
    users = (out / "a" / "users.conf").read_text()
    assert users.count('password: "$2b$') == len(passwords), "every user's password as a bcrypt hash"
    env = env_of(out / "b" / "env")
    assert env["PFX_NATS_URL"] == "tls://10.0.0.2:4222,tls://10.0.0.1:4222,tls://10.0.0.3:4222"
    assert (env["PFX_NODE"], env["PFX_PROVISION"], env["PFX_METRICS_HOST"], env["PFX_MODEL"]) == ("b", "false", "10.0.0.2", "/models/q")
    assert env["PFX_NATS_TLS_CA"] == "/etc/prefixflow/ca.pem"
    conf = (out / "b" / "nats-server.conf").read_text()
    assert 'server_name: "b"' in conf and "routes: $ROUTES" in conf and conf.count("verify: true") == 1

    # No generated grant lets a service or a submitter create, update or delete a stream.
    perms = (out / "a" / "permissions.conf").read_text()
    blocks = perms.split("\n}\n")
    for block in blocks:
        if block.strip() and not block.strip().startswith("PFX_ADMIN") and "= {" in block:
            for op in ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.DELETE"):
                assert op not in block, block.splitlines()[0]

    # Passwords and the CA are kept when the command runs again (say, for a fourth node).
    ca = (out / "ca" / "ca.pem").read_text()
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4", "--names", "a,b,c,d", "--head", "c", "--engines", "0,1")
    again = json.loads((out / "secrets.json").read_text())
    assert {k: again["users"][k] for k in passwords} == passwords and again["route"] == secrets["route"]
    assert (out / "ca" / "ca.pem").read_text() == ca and (out / "d" / "ca.pem").read_text() == ca
    assert env_of(out / "d" / "bucketer.env")["PFX_NATS_USER"] == "bucketer-d"


def test_cluster_config_gives_each_tenant_an_api_key_in_the_heads_keys_file(tmp_path, monkeypatch):
    from prefixflow.shared.api_keys import load_keys
    from prefixflow.launch import fleet_config

    monkeypatch.setattr(fleet_config, "BCRYPT_ROUNDS", 4)  # the cheapest hash: not what is tested here

    out = tmp_path / "fleet"
    out.mkdir()
    chosen = 'ab#01,23 "q" \\x:y'  # an operator's own key, set in secrets.json
    (out / "secrets.json").write_text(json.dumps({"api_keys": {"alice": chosen}}))
    argv = ["--hosts", "10.0.0.1,10.0.0.2", "--names", "a,b", "--head", "b", "--etc-dir", "/srv/pfx/{node}", "--no-tls",
            "--tenant", "alice", "--tenant", "bob"]
    run_config(out, *argv)
    keys_file = out / "b" / "api-keys"
    assert not (out / "a" / "api-keys").exists() and stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert env_of(out / "b" / "api.env")["PFX_API_KEYS_FILE"] == "/srv/pfx/b/api-keys"
    api_keys = json.loads((out / "secrets.json").read_text())["api_keys"]
    assert api_keys["alice"] == chosen and len(api_keys["bob"]) > 32
    assert load_keys("", str(keys_file)) == {chosen: "alice", api_keys["bob"]: "bob"}
    assert f"OPENAI_API_KEY={api_keys['bob']}\n" in (out / "clients" / "tenant-bob.env").read_text()
    for node in "ab":  # no node but the head holds a key
        texts = "".join(f.read_text() for f in (out / node).iterdir())
        assert (api_keys["bob"] in texts) == (node == "b")

    run_config(out, *argv)  # again: the keys are kept
    assert json.loads((out / "secrets.json").read_text())["api_keys"] == api_keys
    run_config(out, *argv[:9])  # without tenants: no keys file left behind
    assert not keys_file.exists() and "PFX_API_KEYS_FILE" not in (out / "b" / "api.env").read_text()
    (out / "secrets.json").write_text(json.dumps({"api_keys": {"alice": "tab\there"}}))
    with pytest.raises(SystemExit, match="printable ASCII"):
        run_config(out, *argv)


def test_node_certificates_are_signed_by_the_fleet_ca_for_the_node_address(tmp_path):
    from cryptography import x509

    run_config(tmp_path / "out", "--hosts", "10.1.2.3,node-b.example", "--names", "a,b")
    ca = x509.load_pem_x509_certificate((tmp_path / "out" / "ca" / "ca.pem").read_bytes())
    for name, host in (("a", "10.1.2.3"), ("b", "node-b.example")):
        cert = x509.load_pem_x509_certificate((tmp_path / "out" / name / "server-cert.pem").read_bytes())
        cert.verify_directly_issued_by(ca)
        alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(v) for v in alt.get_values_for_type(x509.IPAddress)] + alt.get_values_for_type(x509.DNSName)
        assert host in names and name in names


# --- connection options and replicas -------------------------------------------------


def test_options_from_the_environment_and_connect_kwargs(tmp_path):
    opts = NatsOptions.from_env({"PFX_NATS_USER": "sink", "PFX_NATS_PASSWORD": "pw", "PFX_STREAM_REPLICAS": "3"})
    assert (opts.nats_user, opts.nats_password, opts.stream_replicas) == ("sink", "pw", 3)
    kw = opts.connect_kwargs(["nats://a:4222"])
    assert kw == {"user": "sink", "password": "pw", "inbox_prefix": "_INBOX_sink"}
    assert "tls" in NatsOptions().connect_kwargs(["tls://a:4222"])
    assert NatsOptions().connect_kwargs(["nats://a:4222"]) == {}


def test_config_checks_credentials_and_tls_files(tmp_path):
    from prefixflow.shared.process.config import SinkConfig, load

    with pytest.raises(SystemExit, match="nats_user and nats_password go together"):
        load(SinkConfig, environ={"PFX_NATS_USER": "sink"})
    with pytest.raises(SystemExit, match="no such file"):
        load(SinkConfig, environ={"PFX_NATS_TLS_CA": str(tmp_path / "missing.pem")})
    cfg = load(SinkConfig, environ={"PFX_NATS_USER": "sink", "PFX_NATS_PASSWORD": "x", "PFX_OUT_ROOT": "/srv/out"})
    assert cfg.out_root == "/srv/out" and cfg.stream_replicas == 0


class FakeNC:
    def __init__(self, info: dict, servers: int) -> None:
        self._server_info = info
        self.servers = ["s"] * servers


class FakeJS:
    def __init__(self, info: dict, servers: int = 1) -> None:
        self._nc = FakeNC(info, servers)


def test_replicas_default_from_the_cluster_size():
    three = {"cluster": "prefixflow", "connect_urls": ["a:1", "b:1", "c:1"]}
    assert cluster_size(FakeJS({})) == 1
    assert cluster_size(FakeJS(three)) == 3
    assert cluster_size(FakeJS({"cluster": "c", "connect_urls": ["a:1"]}, servers=3)) == 3, "the URLs we were given count"
    assert replicas_for(FakeJS(three), 0) == (3, False)
    assert replicas_for(FakeJS({"cluster": "c", "connect_urls": ["a:1", "b:1"]}), 0) == (1, False)
    assert replicas_for(FakeJS({}), 0) == (1, False)
    assert replicas_for(FakeJS(three), 1) == (1, True), "an explicit setting wins"


@pytest.mark.parametrize("exc, refusal", [
    (ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: unable to get "
                                     "local issuer certificate (_ssl.c:1006)"), True),
    (ssl.SSLError(1, "[SSL: WRONG_VERSION_NUMBER] wrong version number (_ssl.c:1006)"), True),
    (Exception("nats: secure connection - tls required"), True),
    (ssl.SSLError(1, "[SSL: APPLICATION_DATA_AFTER_CLOSE_NOTIFY] application data after close notify (_ssl.c:2706)"),
     False),
    (ssl.SSLEOFError(8, "EOF occurred in violation of protocol (_ssl.c:992)"), False),
    (ssl.SSLError(1, "[SSL: UNEXPECTED_EOF_WHILE_READING] unexpected eof while reading (_ssl.c:2580)"), False),
    (ConnectionRefusedError(111, "Connect call failed"), False),
])
def test_a_tls_failure_refuses_only_when_retrying_cannot_help(exc, refusal):
    """A certificate not trusted or TLS on one side only stops `connect` at once; a
    handshake the server cut off (its TLS timeout on a loaded machine: a fleet test's
    `cluster provision` failed so) is retried within the wait."""
    from prefixflow.shared.bus.connection import tls_refusal

    assert tls_refusal(exc) is refusal


def test_a_job_without_a_tenant_may_not_write_into_a_tenants_directory(tmp_path):
    """The batch service's jobs live in a namespace no user may be (`pfxapi`); a tenant's
    directory of the sink's root is marked when its first job opens; a job without a
    tenant (the `submitter`'s) is refused in either, wherever else in the root it may go."""
    from prefixflow.services.sink.store import TENANT_MARK, Roots, confine_store

    roots = Roots(tmp_path.resolve())
    assert subjects.job_problem(subjects.api_job("batch_abc")) is None, "the batch service's job ids are valid"
    assert subjects.tenant_of(subjects.api_job("batch_abc")) == subjects.API_NAMESPACE
    assert "reserved" in subjects.tenant_problem(subjects.API_NAMESPACE), "no tenant may be called that"
    assert not allowed("submitter", "publish", subjects.ingest(subjects.api_job("batch_abc")))
    assert not allowed("tenant", "publish", subjects.ingest(subjects.api_job("batch_abc")), "alice")
    assert allowed("api", "publish", subjects.ingest(subjects.api_job("batch_abc")))

    api = confine_store(roots, "batches/alice/batch_abc", subjects.API_NAMESPACE)
    assert api.local_dir == tmp_path.resolve() / "pfxapi" / "batches" / "alice" / "batch_abc"
    assert confine_store(roots, "nightly", "alice").local_dir == tmp_path.resolve() / "alice" / "nightly"
    assert (tmp_path / "alice" / TENANT_MARK).exists()
    for theirs in ("alice/nightly", "alice", str(tmp_path / "alice" / "other"), "pfxapi/batches/alice/batch_abc",
                   "./pfxapi/x"):
        with pytest.raises(OutsideRoot, match="tenant .* directory"):
            confine_store(roots, theirs)
    assert confine_store(roots, "bob/x").local_dir == tmp_path.resolve() / "bob" / "x", "no tenant bob has written yet"
    assert confine_store(roots, "mine").local_dir == tmp_path.resolve() / "mine"
