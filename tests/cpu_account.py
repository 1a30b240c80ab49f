"""Where the suite's CPU goes: with `PFX_TEST_CPU=FILE`, each test's CPU seconds (setup,
call and teardown) are appended to FILE as JSON lines, counted over the test process and
every process under it (each live one with what it has reaped; ended ones through their
reaper's counters; only a process orphaned to init escapes), so a cluster a test starts or a shared one it drives is charged to
it. The suite is CPU-bound on 2 cores: its wall time is about its CPU over two, so this,
not each test's wall time, says what to cut. Off by default.

    PFX_TEST_CPU=/tmp/cpu.jsonl make test
    python -m tests.cpu_account /tmp/cpu.jsonl        # the 40 costliest tests and the tiers
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter

import pytest

FILE = os.environ.get("PFX_TEST_CPU")


def tree_cpu() -> float:
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in me.children(recursive=True):
        try:
            c = child.cpu_times()
        except psutil.Error:
            continue
        total += c.user + c.system + c.children_user + c.children_system  # and what it has reaped (counted once:
        # a process is live, or in its reaper's children_*; only orphans reaped by init escape)
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if not FILE:
        yield
        return
    cpu0, wall0 = tree_cpu(), time.monotonic()
    yield
    with open(FILE, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu": round(tree_cpu() - cpu0, 2),
                            "wall": round(time.monotonic() - wall0, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER")}) + "\n")


def main(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    tiers, files = Counter(), Counter()
    for r in rows:
        tiers[r["test"].split("/")[1]] += r["cpu"]
        files[r["test"].split("::")[0]] += r["cpu"]
    print(f"{len(rows)} tests, {sum(r['cpu'] for r in rows):,.0f} CPU-s, {sum(r['wall'] for r in rows):,.0f} wall-s")
    print("tiers:", {k: round(v) for k, v in tiers.most_common()})
    for f, cpu in files.most_common(40):
        print(f"{cpu:8.1f} {f}")


if __name__ == "__main__":
    main(sys.argv[1])
