"""`prefixflow cluster config`'s server configs pass `nats-server -t` (the real binary
checks them; moved here from tests/unit/test_security.py: it starts a nats-server)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_security import run_config

pytestmark = [pytest.mark.nats, pytest.mark.timeout(60)]


@pytest.mark.parametrize("tls", ["generated", "given", "none"])
def test_nats_server_accepts_the_generated_config(tmp_path, tls):
    binary = Path(sys.executable).parent / "nats-server"
    if not binary.exists():
        binary = shutil.which("nats-server")
    if not binary:
        pytest.skip("no nats-server")
    extra = ["--store-dir", str(tmp_path / "{node}"), "--etc-dir", str(tmp_path / "out" / "{node}")]
    if tls == "given":
        for name in ("c.pem", "k.pem", "ca.pem"):
            (tmp_path / name).write_text("")
        extra += ["--tls-cert", str(tmp_path / "c.pem"), "--tls-key", str(tmp_path / "k.pem"), "--tls-ca", str(tmp_path / "ca.pem")]
    if tls == "none":
        extra.append("--no-tls")
    run_config(tmp_path / "out", *extra)
    conf = tmp_path / "out" / "nats-2" / "nats-server.conf"
    env = (tmp_path / "out" / "nats-2" / "env").read_text()
    if tls == "none":
        assert "tls {" not in conf.read_text() and "nats://nats-2:4222," in env and "TLS_CA" not in env
    else:
        assert conf.read_text().count("verify: true") == 1 and "tls {" in conf.read_text()  # clients and (verified) routes
        assert "PFX_NATS_TLS_CA=" in env and "tls://nats-2:4222," in env
    if tls == "given":
        return  # empty certificate files: nats-server -t would (rightly) refuse them
    res = subprocess.run([str(binary), "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "is valid" in res.stdout + res.stderr, res.stdout + res.stderr
