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

from cli.main import build_parser
from services.registry import SERVICES
from shared.process import config as cfgmod
from tests.fleet import INSTALL_BIN, UNITS, VENV_BIN, exec_argv, parse_unit, unit_env, values

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

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


def test_engine_unit_is_one_instance_per_gpu():
    path = UNITS / "prefixflow-engine@.service"
    unit = parse_unit(path)
    assert values(unit, "Service", "Environment") == ["CUDA_VISIBLE_DEVICES=%i"]
    argv = exec_argv(path, instance="3", host=HOST)
    args = build_parser().parse_args(argv[1:])
    assert args.replica == f"{HOST}-gpu3", "each GPU's worker is its own replica"


@pytest.fixture(scope="module")
def etc(tmp_path_factory) -> Path:
    """A node's /etc/prefixflow as `prefixflow cluster config` writes it."""
    out = tmp_path_factory.mktemp("cluster-config")
    args = build_parser().parse_args(["cluster", "config", "--out", str(out), "--nodes", "3", "--model", "/models/m"])
    args.fn(args)
    return out / "nats-1"


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
    assert files == ["/etc/prefixflow/env", f"/etc/prefixflow/{service}.env"]
    env = unit_env(path, etc, instance="0", host=HOST)
    cfg = cfgmod.load(CONFIGS[service], args, environ=env)
    assert cfg.nats_user == service and cfg.nats_password
    assert cfg.nats_url.startswith("nats://nats-1:4222,"), "this node's server first"
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
