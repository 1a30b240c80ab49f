"""Security pieces that need no server: job ids, confined output paths, the NATS roles
generated from the subjects module, and what `prefixflow cluster config` writes (the
committed deploy/nats configs are its output, checked for drift)."""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch.fleet_config import render_permissions, render_server
from cli.main import build_parser
from services.sink.writer import OutsideRoot, confine
from shared.bus.connection import NatsOptions
from shared.bus.provision import cluster_size, replicas_for
from shared.wire import subjects
from shared.wire.permissions import ROLES, SERVICE_ROLES, allowed, matches, permissions

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]

# --- job ids -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "job,why",
    [
        ("", "it is empty"),
        ("a.b", "it contains '.', which separates NATS subject tokens"),
        ("a*", "it contains the NATS wildcard '*'"),
        ("x>", "it contains the NATS wildcard '>'"),
        ("my job", "it contains whitespace"),
        ("tab\there", "it contains whitespace"),
        ("j" * 65, "it is 65 characters long (at most 64)"),
        ("é", "it contains 'é'; use letters, digits, '-' and '_'"),
    ],
)
def test_bad_job_ids_are_refused_with_the_reason(job, why):
    assert subjects.name_problem(job) == why
    from client.submit import submit
    from shared.wire.messages import SamplingSpec

    with pytest.raises(SystemExit) as exc:  # before connecting to anything
        asyncio.run(submit("x.parquet", nats_url="nats://127.0.0.1:1", job=job, out_dir="out", sampling=SamplingSpec()))
    assert str(exc.value).startswith(f"invalid job id {job!r}: {why} (a job id is one NATS subject token")


@pytest.mark.parametrize("job", ["a", "job-2026_01", "x" * 64])
def test_good_job_ids(job):
    assert subjects.name_problem(job) is None and subjects.is_valid_name(job)


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
    for subject in (subjects.work("r0"), subjects.bucket("n0", "job1"), subjects.results("job1"), subjects.status("r0"),
                    subjects.dead("x"), subjects.ROUTE, subjects.ROUTER_POLICY, subjects.engine_reset("r0"),
                    f"$KV.{subjects.JOB_STATUS_KV}.job1", "$JS.API.STREAM.CREATE.PFX_WORK", "$JS.API.STREAM.DELETE.PFX_INGEST",
                    "$JS.API.CONSUMER.CREATE.PFX_RESULTS.snoop", "$JS.API.CONSUMER.MSG.NEXT.PFX_RESULTS.sink",
                    "$JS.API.STREAM.PURGE.PFX_INGEST"):
        assert not may("publish", subject), subject
    for subject in ("pfx.results.>", subjects.results("job1"), "pfx.>", ">", "_INBOX.>", "_INBOX_sink.>", subjects.work("r0")):
        assert not may("subscribe", subject), subject
    # The replicas' status (load, prompts held per job): the progress line shows work under way.
    assert may("subscribe", subjects.ALL_STATUS)


def test_services_have_what_they_need():
    assert allowed("ingestor", "publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_INGEST.ingestor")
    assert allowed("ingestor", "publish", "$JS.ACK.PFX_INGEST.ingestor.1.2.3.4.5")
    assert allowed("ingestor", "publish", subjects.bucket("node7", "j"))
    assert allowed("ingestor", "publish", subjects.results("j"))
    assert allowed("ingestor", "publish", subjects.dead(subjects.ingest("j")))
    assert not allowed("ingestor", "publish", subjects.work("r0"))
    assert allowed("bucketer", "publish", "$JS.API.CONSUMER.MSG.NEXT.PFX_BUCKET.bucketer-node7")
    assert allowed("bucketer", "publish", subjects.ROUTE) and allowed("bucketer", "publish", subjects.work("r0"))
    assert allowed("router", "subscribe", subjects.ROUTE) and permissions("router").allow_responses
    assert allowed("router", "publish", "$JS.API.CONSUMER.DELETE.PFX_WORK.engine-r3"), "failover takes a dead replica's work"
    assert allowed("engine-worker", "subscribe", subjects.engine_reset("r0")) and permissions("engine-worker").allow_responses
    assert allowed("engine-worker", "publish", subjects.results("j")) and not allowed("engine-worker", "publish", subjects.ingest("j"))
    assert allowed("sink", "publish", f"$KV.{subjects.JOB_STATUS_KV}.j") and not allowed("sink", "publish", f"$KV.{subjects.JOBS_KV}.j")
    assert not allowed("sink", "subscribe", "pfx.>")
    for role in ROLES[:-1]:
        assert not allowed(role, "publish", "$JS.API.STREAM.DELETE.PFX_INGEST"), role
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
        assert readers, f"nobody may read {subject}"


def test_admin_may_do_anything():
    assert permissions("admin").publish == (">",) and permissions("admin").subscribe == (">",)


# --- cluster config ------------------------------------------------------------------


def default_args(*extra: str):
    return build_parser().parse_args(["cluster", "config", "--out", "unused", *extra])


def test_committed_deploy_nats_configs_are_the_generated_ones():
    """deploy/nats is `prefixflow cluster config --nodes 3` (hosts nats-1..3) minus the
    secret files: regenerate it when subjects or the generator change."""
    from launch.fleet_config import parse_nodes

    args = default_args()
    nodes = parse_nodes(["nats-1", "nats-2", "nats-3"], None, args)
    assert (REPO / "deploy/nats/permissions.conf").read_text() == render_permissions()
    for node in nodes:
        assert (REPO / f"deploy/nats/{node.name}.conf").read_text() == render_server(node, nodes, args), node.name


def run_config(out: Path, *extra: str) -> None:
    args = build_parser().parse_args(["cluster", "config", "--out", str(out), *extra])
    args.fn(args)


def test_cluster_config_writes_every_node(tmp_path, capsys):
    out = tmp_path / "fleet"
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2,10.0.0.3", "--names", "a,b,c", "--model", "/models/q")
    assert sorted(p.name for p in out.iterdir()) == ["a", "b", "c", "secrets.json"]
    files = {p.name for p in (out / "b").iterdir()}
    assert files == {"nats-server.conf", "users.conf", "permissions.conf", "env", *(f"{r}.env" for r in ROLES)}
    secret = {"users.conf", *(f"{r}.env" for r in ROLES)}
    for name in files:
        mode = stat.S_IMODE((out / "b" / name).stat().st_mode)
        assert mode == (0o600 if name in secret else 0o644), (name, oct(mode))
    assert stat.S_IMODE((out / "secrets.json").stat().st_mode) == 0o600
    env = (out / "b" / "env").read_text()
    assert "PFX_NATS_URL=nats://10.0.0.2:4222,nats://10.0.0.1:4222,nats://10.0.0.3:4222\n" in env
    assert "PFX_MODEL=/models/q\n" in env and "PASSWORD" not in env
    sink = NatsOptions.from_env(dict(line.split("=", 1) for line in (out / "b" / "sink.env").read_text().splitlines() if "=" in line and not line.startswith("#")))
    assert sink.nats_user == "sink" and len(sink.nats_password) >= 24
    conf = (out / "b" / "nats-server.conf").read_text()
    assert 'server_name: "b"' in conf and "routes: $ROUTES" in conf
    secrets = json.loads((out / "secrets.json").read_text())
    for pw in [secrets["route"], *secrets["users"].values()]:
        assert pw not in conf and pw not in env, "nats-server.conf and env hold no secret"
        assert pw in (out / "b" / "users.conf").read_text()
    # Passwords are kept when the command runs again (say, for a fourth node).
    before = (out / "secrets.json").read_text()
    run_config(out, "--hosts", "10.0.0.1,10.0.0.2,10.0.0.3,10.0.0.4")
    assert (out / "secrets.json").read_text() == before
    assert (out / "nats-4" / "sink.env").read_text().split("PFX_NATS_PASSWORD=")[1].split("\n")[0] == sink.nats_password


@pytest.mark.parametrize("tls", [False, True])
def test_nats_server_accepts_the_generated_config(tmp_path, tls):
    binary = Path(sys.executable).parent / "nats-server"
    if not binary.exists():
        binary = shutil.which("nats-server")
    if not binary:
        pytest.skip("no nats-server")
    extra = ["--store-dir", str(tmp_path / "{node}")]
    if tls:
        for name in ("c.pem", "k.pem", "ca.pem"):
            (tmp_path / name).write_text("")
        extra += ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"), "--tls-ca", str(tmp_path / "ca.pem")]
    run_config(tmp_path / "out", *extra)
    conf = tmp_path / "out" / "nats-2" / "nats-server.conf"
    if tls:
        text = conf.read_text()
        assert text.count("verify: true") == 1 and "tls {" in text  # clients and (verified) routes
        assert "PFX_NATS_TLS_CA=" in (tmp_path / "out" / "nats-2" / "env").read_text()
        assert "tls://nats-2:4222," in (tmp_path / "out" / "nats-2" / "env").read_text()
        return  # empty certificate files: nats-server -t would (rightly) refuse them
    res = subprocess.run([str(binary), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, res.stdout + res.stderr


# --- connection options and replicas -------------------------------------------------


def test_options_from_the_environment_and_connect_kwargs(tmp_path):
    opts = NatsOptions.from_env({"PFX_NATS_USER": "sink", "PFX_NATS_PASSWORD": "pw", "PFX_STREAM_REPLICAS": "3"})
    assert (opts.nats_user, opts.nats_password, opts.stream_replicas) == ("sink", "pw", 3)
    kw = opts.connect_kwargs(["nats://a:4222"])
    assert kw == {"user": "sink", "password": "pw", "inbox_prefix": "_INBOX_sink"}
    assert "tls" in NatsOptions().connect_kwargs(["tls://a:4222"])
    assert NatsOptions().connect_kwargs(["nats://a:4222"]) == {}


def test_config_checks_credentials_and_tls_files(tmp_path):
    from shared.process.config import SinkConfig, load

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
