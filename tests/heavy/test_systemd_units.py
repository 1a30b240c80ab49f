"""The systemd units in deploy/systemd are real: systemd itself accepts them
(`systemd-analyze verify`, where installed), each has its dependencies and restart
policy, `prefixflow-engine@.service` is one instance per GPU with CUDA_VISIBLE_DEVICES=%i,
and every command line is a valid `prefixflow serve` invocation (parsed by the CLI's own
parser) whose configuration loads from the env files `prefixflow cluster config` writes.
(`tests/nats/test_fleet.py` and `test_secure_cluster.py` then run exactly these units.)"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from prefixflow.cli.main import build_parser
from prefixflow.services.registry import SERVICES
from prefixflow.shared.process import config as cfgmod
from tests.fleet import INSTALL_BIN, UNITS, VENV_BIN, exec_argv, parse_unit, unit_env, values

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(120)]

SERVICE_UNITS = {
    "prefixflow-ingestor.service": "ingestor",
    "prefixflow-router.service": "router",
    "prefixflow-bucketer.service": "bucketer",
    "prefixflow-engine@.service": "engine-worker",
    "prefixflow-sink.service": "sink",
    "prefixflow-api.service": "api",
}
CONFIGS = {**SERVICES, "api": cfgmod.ApiConfig}
ALL_UNITS = [*SERVICE_UNITS, "prefixflow-nats.service"]
HOST = "gpu-node-7"
"""What %l (the short host name) expands to in these tests."""


def test_the_unit_set_is_complete():
    assert sorted(p.name for p in UNITS.iterdir()) == sorted([*ALL_UNITS, "prefixflow.target"])


@pytest.mark.parametrize("name", ALL_UNITS)
def test_dependencies_and_restart_policy(name):
    unit = parse_unit(UNITS / name)
    after = " ".join(values(unit, "Unit", "After")).split()
    assert "network-online.target" in after and "network-online.target" in " ".join(values(unit, "Unit", "Wants"))
    if name != "prefixflow-nats.service":
        assert "prefixflow-nats.service" in after, "services start after this node's NATS server"
    assert values(unit, "Unit", "PartOf") == ["prefixflow.target"]
    assert values(unit, "Unit", "StartLimitIntervalSec") == ["0"], "systemd never stops restarting it"
    assert values(unit, "Service", "Restart") == ["always"]
    assert float(values(unit, "Service", "RestartSec")[0]) >= 1
    assert values(unit, "Service", "User") == ["prefixflow"]
    assert values(unit, "Install", "WantedBy") == ["prefixflow.target"]


@pytest.fixture(scope="module")
def etc(tmp_path_factory) -> Path:
    """A node's /etc/prefixflow as `prefixflow cluster config` writes it (installed in
    place: --etc-dir is the directory itself, so its CA file exists)."""
    out = tmp_path_factory.mktemp("cluster-config")
    args = build_parser().parse_args(["cluster", "config", "--out", str(out), "--nodes", "3", "--model", "/models/m",
                                      "--engines", "0,3,4-7", "--etc-dir", f"{out}/{{node}}"])
    args.fn(args)
    return out / "nats-1"


def engine_unit_config(instance: str, etc: Path | None = None):
    path = UNITS / "prefixflow-engine@.service"
    argv = exec_argv(path, instance=instance, host=HOST)
    env = unit_env(path, etc, instance=instance, host=HOST) if etc is not None else {}
    return cfgmod.load(cfgmod.EngineWorkerConfig, build_parser().parse_args(argv[1:]), environ=env)


def test_engine_unit_is_one_instance_per_gpu(etc):
    cfg = engine_unit_config("3", etc)
    assert cfg.replica == "nats-1-gpu3", "each GPU's worker is its own replica"
    assert cfg.nats_user == "engine-nats-1-gpu3", "with a NATS user of its own"
    assert cfg.gpus == "3", "the worker sets CUDA_VISIBLE_DEVICES=3 before its engine starts"
    assert cfg.metrics_port == 9473


@pytest.mark.parametrize("instance,port", [("0", 9470), ("9", 9479), ("10", 9480), ("15", 9485), ("127", 9597)])
def test_engine_unit_metrics_ports_work_for_any_number_of_gpus(instance, port):
    """The unit once said `--metrics-port 947%i`: GPU 10 became port 94710, invalid."""
    assert engine_unit_config(instance).metrics_port == port


def test_engine_unit_runs_tensor_parallel_over_a_range_of_gpus(etc):
    """`prefixflow-engine@4-7` (a unit name cannot hold a comma): one replica on GPUs 4-7,
    vLLM's tensor-parallel size 4, CUDA graphs on."""
    from prefixflow.services.engine_worker.engine_args import placement_defaults, visible_gpus

    cfg = engine_unit_config("4-7", etc)
    assert (cfg.replica, cfg.gpus, cfg.metrics_port) == ("nats-1-gpu4-7", "4,5,6,7", 9474)
    assert cfg.enforce_eager is None and cfg.max_model_len == 0, "the units leave both to the model and devices"
    assert placement_defaults(visible_gpus({"CUDA_VISIBLE_DEVICES": cfg.gpus}), cfg.enforce_eager) == {
        "enforce_eager": False, "tensor_parallel_size": 4,
    }


@pytest.mark.parametrize("name,service", SERVICE_UNITS.items())
def test_command_lines_are_valid_serve_invocations(name, service, etc):
    path = UNITS / name
    argv = exec_argv(path, instance="0", host=HOST)
    assert argv[0] == INSTALL_BIN + "prefixflow", argv
    args = build_parser().parse_args(argv[1:])
    assert (args.command, args.service) == ("serve", service)
    # Its EnvironmentFile=s are the ones cluster config writes: the common env and the
    # role's credentials, and with them the configuration loads and validates.
    files = [f.lstrip("-") for f in values(parse_unit(path), "Service", "EnvironmentFile")]
    own = "engine-worker-%i" if service == "engine-worker" else service
    assert files == ["/etc/prefixflow/env", f"/etc/prefixflow/{own}.env"]
    env = unit_env(path, etc, instance="0", host=HOST)
    cfg = cfgmod.load(CONFIGS[service], args, environ=env)
    user = {"bucketer": "bucketer-nats-1", "engine-worker": "engine-nats-1-gpu0"}.get(service, service)
    assert cfg.nats_user == user and cfg.nats_password
    assert cfg.nats_url.startswith("tls://nats-1:4222,"), "this node's server first, over TLS"
    assert cfg.nats_tls_ca == str(etc / "ca.pem") and not cfg.provision
    assert cfg.metrics_host == "nats-1", "metrics on the node's own address"
    if service == "bucketer":
        assert cfg.node == "nats-1"
    if service == "sink":
        assert cfg.out_root == "/var/lib/prefixflow/out"
        unit = parse_unit(path)
        assert values(unit, "Service", "ProtectSystem") == ["strict"]
        assert values(unit, "Service", "ReadWritePaths") == ["/var/lib/prefixflow"]


def test_nats_unit_runs_the_generated_config(etc):
    path = UNITS / "prefixflow-nats.service"
    for key in ("ExecStartPre", "ExecStart"):
        argv = exec_argv(path, key)
        assert argv[0] == INSTALL_BIN + "nats-server"
        assert argv[1:3] == ["--config", "/etc/prefixflow/nats-server.conf"]
    assert exec_argv(path, "ExecStartPre")[-1] == "-t", "the config is checked before start"
    assert (etc / "nats-server.conf").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify_accepts_every_unit(tmp_path):
    """systemd's own check (unknown keys, bad values, missing executables, specifiers).
    The units are copied with /opt/prefixflow/.venv/bin pointing at this virtualenv, so
    the executables exist; any message at all fails the test (systemd-analyze exits 0
    on warnings such as an unknown key)."""
    for src in UNITS.iterdir():
        (tmp_path / src.name).write_text(src.read_text().replace(INSTALL_BIN, f"{VENV_BIN}/"))
    units = [n.replace("@.service", "@0.service") for n in ALL_UNITS] + ["prefixflow.target"]
    res = subprocess.run(
        ["systemd-analyze", "verify", *units],
        capture_output=True,
        text=True,
        timeout=60,
        env={"SYSTEMD_UNIT_PATH": f"{tmp_path}:", "PATH": "/usr/bin:/bin", "SYSTEMD_LOG_COLOR": "0"},
    )
    assert res.returncode == 0 and res.stdout + res.stderr == "", res.stdout + res.stderr
