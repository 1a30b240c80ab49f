"""The tree shows the architecture: pure decision code imports neither NATS nor vLLM (the
simulator runs it as it is), and nothing imports upward (shared never imports services
or cli; a service never imports cli)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PURE = [
    "services.bucketer.buffer",
    "services.router.policies",
    "services.engine_worker.grouping",
    "services.engine_worker.rebuild",
    "services.engine_worker.window",
    "services.engine_worker.feeder",
    "services.ingestor.plan",
    "shared.prefix.sharding",
    "shared.prefix.block_keys",
    "shared.wire.messages",
    "shared.wire.sampling",
    "services.ingestor.chat",
    "services.ingestor.row",
    "services.engine_worker.requests",
    "cli.openai_batch",
    "services.router.block_index",
    "services.engine_worker.kv_events",
]


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_nats_or_vllm(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('nats', 'vllm', 'torch')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]", f"{module} pulls in {out}"


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


@pytest.mark.parametrize(
    "package,forbidden", [("shared", ("services", "cli", "tests")), ("services", ("cli", "tests")), ("cli", ("tests",))]
)
def test_nothing_imports_upward(package, forbidden):
    bad = {
        str(p.relative_to(REPO)): sorted(i for i in imports_of(p) if i.split(".")[0] in forbidden)
        for p in (REPO / package).rglob("*.py")
    }
    assert {k: v for k, v in bad.items() if v} == {}
