"""No rule lives in `prefixflow/sim/` (issue 42, must-show 3): the simulator imports the
services' decision code, it does not copy it. A static scan (AST) of both trees:

- a module-level UPPER_CASE constant in `sim/` may not have the name of one in
  `services/`, nor its value under a name sharing a word with it (`DISPATCH_TICK = 0.2`
  beside the bucketer's `DISPATCH_WAIT = 0.2` is a copy by another name);
- a function or method in `sim/` may not be named like a public method of the services'
  decision classes (the bucketer's release, the router's decision and what they call:
  lanes, buffer, fleet, policies; the engine-worker's admission, window, grouping,
  feeder): a `decide`, `route_request` or `eligible` in `sim/` is a second copy of a rule;
- the simulator's bucketers and router hold the very classes the services hold.

The checker is tested on the copy `sim/services.py` held before the cores existed: it
must find every one of its copies.
"""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest

from prefixflow.services.bucketer import release as bucketer_release
from prefixflow.services.bucketer import service as bucketer_service
from prefixflow.services.router import decision as router_decision
from prefixflow.services.router import service as router_service

pytestmark = pytest.mark.unit

PKG = Path(__file__).resolve().parents[2] / "prefixflow"

DECISION_MODULES = (
    "services/bucketer/release.py",
    "services/bucketer/lanes.py",
    "services/bucketer/buffer.py",
    "services/router/decision.py",
    "services/router/fleet.py",
    "services/router/policies.py",
    "services/router/assignments.py",
    "services/router/hot.py",
    "services/router/adapters.py",
    "services/engine_worker/admission.py",
    "services/engine_worker/window.py",
    "services/engine_worker/grouping.py",
    "services/engine_worker/feeder.py",
)
"""The services' pure decision code (no NATS, no asyncio) that the simulator drives."""

SAME_NAME_OK = {
    "TICK": "sim/cpuwatch.py: the kernel's clock ticks per second (os.sysconf), not the ingestor mover's poll",
}
SAME_VALUE_OK = {
    ("WORK_BATCH", "MOVE_BATCH"): "the bench's 16-prompt work messages of the direct methods, not the mover's batch",
}
SAME_FUNCTION_OK = {
    "add": "sim/engine.Engine.add is vLLM's add_request on the engine model (the services' add: a cost sample, "
           "a history entry, a hot group's work)",
}


def constants(tree: ast.Module) -> dict[str, object]:
    """Module-level UPPER_CASE names and their literal values (None: not a literal)."""
    out: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = [t for t in node.targets if isinstance(t, ast.Name)], node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if t.id.isupper():
                try:
                    out[t.id] = ast.literal_eval(value)
                except ValueError:
                    out[t.id] = None
    return out


def functions(tree: ast.Module) -> set[str]:
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def same_value(a: object, b: object) -> bool:
    return a is not None and not isinstance(a, bool) and type(a) is type(b) and a == b


@functools.cache
def service_side() -> tuple[dict[str, list[tuple[str, object]]], dict[str, str]]:
    """The services' constants (name -> [(module, value)]) and public decision names
    (name -> module)."""
    service_constants: dict[str, list[tuple[str, object]]] = {}
    for path in sorted((PKG / "services").rglob("*.py")):
        for name, value in constants(ast.parse(path.read_text())).items():
            service_constants.setdefault(name, []).append((str(path.relative_to(PKG)), value))
    decision_names: dict[str, str] = {}
    for rel in DECISION_MODULES:
        for name in functions(ast.parse((PKG / rel).read_text())):
            if not name.startswith("_"):
                decision_names.setdefault(name, rel)
    return service_constants, decision_names


def copies(sim_sources: dict[str, str]) -> list[str]:
    """What `sim_sources` (path -> source) copies from the services' tree."""
    service_constants, decision_names = service_side()
    found = []
    for path, source in sorted(sim_sources.items()):
        tree = ast.parse(source)
        for name, value in constants(tree).items():
            if name in service_constants and name not in SAME_NAME_OK:
                found.append(f"{path}: constant {name} (services: {service_constants[name][0][0]})")
            words = set(name.split("_"))
            for other, places in service_constants.items():
                for where, theirs in places:
                    if other != name and words & set(other.split("_")) and same_value(value, theirs) \
                            and (name, other) not in SAME_VALUE_OK:
                        found.append(f"{path}: constant {name} = {value!r} copies {where}'s {other}")
        for name in sorted(functions(tree)):
            if name in decision_names and name not in SAME_FUNCTION_OK:
                found.append(f"{path}: function {name} (a decision of {decision_names[name]})")
    return found


def test_sim_copies_no_rule_or_constant_of_the_services():
    sources = {str(p.relative_to(PKG)): p.read_text() for p in sorted((PKG / "sim").rglob("*.py"))}
    assert copies(sources) == []


OLD_COPY = '''
EAGER_MIN_WAIT = 0.1
SEND_CONCURRENCY = 32
INTAKE_MESSAGES = 4
DISPATCH_TICK = 0.2
INTAKE_POLL = 0.05
STATUS_MIN_GAP = 0.02


class RouterSim:
    def room(self, now): ...
    def decide(self, now, prompts, tokens, key, parts, output=-1, lora=""): ...


class BucketerSim:
    def route_request(self, bucket): ...
    def dispatch(self, now, tick=False): ...
'''


def test_the_checker_finds_the_copies_sim_services_once_held():
    found = copies({"sim/services.py": OLD_COPY})
    for what in ("constant EAGER_MIN_WAIT", "constant SEND_CONCURRENCY", "constant STATUS_MIN_GAP",
                 "constant INTAKE_MESSAGES = 4 copies services/bucketer/release.py's FETCH_MESSAGES",
                 "constant DISPATCH_TICK = 0.2 copies services/bucketer/release.py's DISPATCH_WAIT",
                 "constant INTAKE_POLL = 0.05 copies services/bucketer/release.py's INTAKE_WAIT",
                 "function room", "function decide", "function route_request"):
        assert any(what in f for f in found), (what, found)
    assert not any("function dispatch" in f for f in found)  # an I/O loop's name, not a decision's


def test_the_simulator_and_the_services_hold_the_same_decision_classes():
    from prefixflow.sim import services as sim_services

    assert sim_services.Release is bucketer_release.Release is bucketer_service.Release
    assert sim_services.Decider is router_decision.Decider is router_service.Decider
    # The services' loops call the cores, they do not hold rules of their own.
    for name in ("eligible", "settled", "route_request", "reference_rules"):
        assert not hasattr(bucketer_service.Bucketer, name), name
    assert "policy.route" not in inspect.getsource(router_service.Router)


def test_the_simulated_worker_feeds_through_the_services_feeder():
    """The product's engine-worker in the simulator is the service's `Feeder` on the
    simulation's clock: every prompt of a run passes through it (held, submitted in its
    order, finished), and none is left in it at the end."""
    from prefixflow.services.engine_worker import feeder as worker_feeder
    from prefixflow.services.engine_worker import service as worker_service
    from prefixflow.sim import cluster, worker
    from prefixflow.sim.cost import load_profile
    from prefixflow.sim.workload import prefix_repetition

    assert worker.Feeder is worker_feeder.Feeder is worker_service.Feeder
    wl = prefix_repetition(num_prompts=400, prefix_len=64, suffix_len=32, num_prefixes=8, output_len=16, seed=1)
    fed: list[int] = []
    original = worker_feeder.Feeder.feed

    def counting_feed(self):
        before = self.inflight
        original(self)
        fed.append(self.inflight - before)

    for probe in (False, True):
        fed.clear()
        worker_feeder.Feeder.feed = counting_feed
        try:
            res = cluster.simulate(wl, load_profile("l4-8b"), 2, "prefix-aware", cluster.Options(window_probe=probe))
        finally:
            worker_feeder.Feeder.feed = original
        assert res.prompts == len(wl) and (res.finish_times >= res.start_times).all()
        assert sum(fed) == len(wl), "every prompt went into an engine through the feeder, once"
