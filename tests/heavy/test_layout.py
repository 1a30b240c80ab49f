"""The tree shows the architecture: pure decision code imports neither NATS nor vLLM (the
simulator runs it as it is), and nothing imports upward (shared never imports services
or cli; a service never imports cli)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "prefixflow"
PURE = [
    "prefixflow.services.bucketer.buffer",
    "prefixflow.services.bucketer.lanes",
    "prefixflow.services.bucketer.release",
    "prefixflow.services.router.policies",
    "prefixflow.services.router.fleet",
    "prefixflow.services.router.decision",
    "prefixflow.services.engine_worker.grouping",
    "prefixflow.services.engine_worker.rebuild",
    "prefixflow.services.engine_worker.window",
    "prefixflow.services.engine_worker.feeder",
    "prefixflow.services.ingestor.plan",
    "prefixflow.shared.prefix.sharding",
    "prefixflow.shared.prefix.block_keys",
    "prefixflow.shared.wire.messages",
    "prefixflow.shared.wire.sampling",
    "prefixflow.services.ingestor.chat",
    "prefixflow.services.ingestor.row",
    "prefixflow.services.engine_worker.requests",
    "prefixflow.client.openai_batch",
    "prefixflow.services.router.block_index",
    "prefixflow.services.engine_worker.kv_events",
    "prefixflow.services.engine_worker.isolate",
    "prefixflow.services.ingestor.takeover",
    "prefixflow.services.sink.binding",
    "prefixflow.services.sink.schema",
    "prefixflow.services.sink.summary",
    "prefixflow.services.sink.parts",
    "prefixflow.shared.wire.ids",
]


IMPORTS_IN_A_FRESH_PROCESS = """
import json, os, sys
FORBIDDEN = ("nats", "vllm", "torch")
import msgspec, numpy, pyarrow  # noqa: E401,F401 - loaded once here, shared by every forked child

def forbidden():
    return sorted(m for m in sys.modules if m.split(".")[0] in FORBIDDEN)

found = {"(preloaded)": forbidden()}
for module in sys.argv[1:]:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a child imports one module into the parent's clean interpreter
        os.close(r)
        try:
            __import__(module)
            got = forbidden()
        except BaseException as exc:
            got = f"import failed: {exc!r}"
        os.write(w, json.dumps(got).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        found[module] = json.loads(f.read())
    os.waitpid(pid, 0)
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def imported() -> dict[str, object]:
    """For each pure module: the NATS/vLLM/torch modules importing it loads, each in a
    fresh interpreter (a child forked from one that loaded only msgspec, numpy and pyarrow,
    which must load none of them themselves)."""
    out = subprocess.run([sys.executable, "-c", IMPORTS_IN_A_FRESH_PROCESS, *PURE], capture_output=True, text=True,
                         cwd=REPO, check=True).stdout
    found = json.loads(out)
    assert found.pop("(preloaded)") == [], "the shared preloads pull in NATS, vLLM or torch"
    return found


@pytest.mark.parametrize("module", PURE)
def test_pure_modules_import_no_nats_or_vllm(module, imported):
    assert imported[module] == [], f"{module} pulls in {imported[module]}"


LAYERS: dict[str, set[str]] = {
    "shared": set(),
    "services": {"shared"},
    "datagen": {"shared"},
    "report": {"shared"},
    "client": {"shared"},
    "batchapi": {"shared", "client"},
    "launch": {"shared", "services", "client", "datagen", "report"},
    "sim": {"shared", "services", "datagen"},
    "planner": {"shared", "services", "client", "launch", "datagen", "sim"},
    "torture": {"shared", "services", "client", "launch", "datagen"},
    "bench": {"shared", "services", "client", "launch", "datagen", "report", "torture"},
    "cli": {"shared", "services", "client", "launch", "datagen", "report", "sim", "bench", "batchapi", "torture",
            "planner"},
    "api": {"shared", "client", "launch", "report", "cli"},
}
"""Each package (under prefixflow/) and the packages it may import (function-level imports included): the
layers of docs/architecture.md's map. Nothing imports upward, and `tests` is imported by
no package."""
PACKAGES = sorted(LAYERS)


def layer(name: str) -> str:
    """The package a dotted module name belongs to: `prefixflow.shared.wire` -> `shared`,
    `tests.conftest` -> `tests` (any other top-level name is its own)."""
    parts = name.split(".")
    return parts[1] if parts[0] == "prefixflow" and len(parts) > 1 else parts[0]


def module_files() -> dict[str, Path]:
    """Every module of the product's packages by dotted name (prefixflow/bench/peers/ holds scripts
    that run in the peers' own virtualenv: not modules of the product)."""
    found = {}
    for pkg in PACKAGES:
        for path in (PKG / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            if parts[:3] == ("prefixflow", "bench", "peers"):
                continue
            name = ".".join(parts).removesuffix(".__init__")
            found[name] = path
    return found


def imports_of(path: Path) -> set[str]:
    """Absolute imports of a file, anywhere in it; `from a import b` gives `a` and `a.b`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_every_package_has_a_layer():
    on_disk = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert on_disk == set(LAYERS), "a new package in prefixflow/ needs its place in LAYERS and in docs/architecture.md"


@pytest.mark.parametrize("package", PACKAGES)
def test_nothing_imports_upward(package):
    allowed = LAYERS[package] | {package}
    bad = {}
    for path in (PKG / package).rglob("*.py"):
        wrong = sorted(i for i in imports_of(path) if layer(i) in (set(LAYERS) | {"tests"}) - allowed)
        if wrong:
            bad[str(path.relative_to(REPO))] = wrong
    assert bad == {}


def import_graph() -> dict[str, set[str]]:
    mods = module_files()

    def owner(name: str) -> str | None:  # the module an imported name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    return {
        name: {o for i in imports_of(path) if (o := owner(i)) and o != name and not mods[o].name == "__init__.py"}
        for name, path in mods.items()
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    """No module imports, even lazily, a module that imports it back (through any chain)."""
    assert cycles(import_graph()) == []


def test_cli_is_thin():
    """`prefixflow/cli/` defines the commands; what they do lives in the packages below it."""
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PKG / "cli").glob("*.py")}
    assert sum(sizes.values()) < 600, sizes
