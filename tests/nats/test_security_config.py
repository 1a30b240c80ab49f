"""`prefixflow cluster config`'s server configs pass `nats-server -t` (the real binary
checks them; moved here from tests/unit/test_security.py: it starts a nats-server), for
one node (no cluster block, no route variables: nats-server refuses a variable nothing
uses) and for three (every node's config)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_security import run_config

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


def nats_server() -> str:
    binary = Path(sys.executable).parent / "nats-server"
    found = str(binary) if binary.exists() else shutil.which("nats-server")
    if not found:
        pytest.skip("no nats-server")
    return found


@pytest.mark.parametrize(("tls", "nodes"), [("generated", 1), ("none", 1), ("generated", 3), ("given", 3), ("none", 3)])
def test_nats_server_accepts_the_generated_config(tmp_path, tls, nodes):
    binary = nats_server()
    extra = ["--nodes", str(nodes), "--store-dir", str(tmp_path / "{node}"), "--etc-dir", str(tmp_path / "out" / "{node}")]
    if tls == "given":
        for name in ("c.pem", "k.pem", "ca.pem"):
            (tmp_path / name).write_text("")
        extra += ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"), "--tls-ca", str(tmp_path / "ca.pem")]
    if tls == "none":
        extra.append("--no-tls")
    run_config(tmp_path / "out", *extra)
    node = f"nats-{nodes}"
    conf = tmp_path / "out" / node / "nats-server.conf"
    env = (tmp_path / "out" / node / "env").read_text()
    users = (tmp_path / "out" / node / "users.conf").read_text()
    scheme = "nats" if tls == "none" else "tls"
    assert f"PFX_NATS_URL={scheme}://{node}:4222" + ("," if nodes > 1 else "\n") in env
    if tls == "none":
        assert "tls {" not in conf.read_text() and "TLS_CA" not in env
    else:
        # clients and, in a cluster, (verified) routes
        assert conf.read_text().count("verify: true") == (nodes > 1) and "tls {" in conf.read_text()
        assert "PFX_NATS_TLS_CA=" in env
    assert ("cluster {" in conf.read_text()) == (nodes > 1)
    assert ("ROUTE_PASSWORD" in users) == ("ROUTES" in users) == (nodes > 1)
    if tls == "given":
        return  # empty certificate files: nats-server -t would (rightly) refuse them
    for i in range(1, nodes + 1):
        conf = tmp_path / "out" / f"nats-{i}" / "nats-server.conf"
        res = subprocess.run([binary, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
        assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, res.stdout + res.stderr
