"""The Procfile (honcho, `make up`) and `cli.local_cluster.processes()` (`prefixflow run`,
the tests) describe the same local cluster: same processes, arguments and environment."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from cli import local_cluster as cluster

PROCFILE = Path(__file__).resolve().parents[1] / "Procfile"


def procfile_entries() -> dict[str, tuple[dict[str, str], list[str]]]:
    """name -> (environment assignments, arguments after `prefixflow`), with
    `${VAR:-default}` expanded to its default."""
    entries = {}
    for line in PROCFILE.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, command = line.split(":", 1)
        command = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", command)
        words = shlex.split(command)
        env = {}
        while "=" in words[0]:
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[0] == "prefixflow", line
        entries[name.strip()] = (env, words[1:])
    return entries


def test_procfile_matches_processes(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 64)  # engine i pinned to core i
    entries = procfile_entries()
    procs = cluster.processes(2)
    assert list(entries) == [p.name for p in procs]
    for p in procs:
        env, args = entries[p.name]
        assert args == p.args, p.name
        assert env == p.env, p.name
