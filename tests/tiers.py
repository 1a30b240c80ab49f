"""Test tiers from directories, and the suite's hypothesis profiles.

A test's tier is the directory it lives in (`tests/unit/...` -> `unit`); the marker is
added here, so `make test-fast` (`-m unit`) cannot miss a file that forgot its
`pytestmark`. A test that declares another tier's marker than its directory's fails
collection (a usage error naming each one), so the tiers cannot drift apart from where
the files are.

Hypothesis runs under a profile instead of example counts hard-coded per test: `ci` (the
default, what `make test` and CI run: 200 examples) and `dev` (`make test-fast`,
`HYPOTHESIS_PROFILE=dev`: 40). A property whose examples each cost a simulation or a
subprocess uses `COSTLY`, a fixed fraction of the profile's count; the properties that ran
300-400 examples before the profiles (the decision cores' model checks: block and prefix
indexes, bucketing, isolation, KV events, the prefix-aware choice, the in-flight window)
use `THOROUGH`, twice the profile's count.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

TIERS = {
    "unit": "pure logic, in process: no server, no engine, no subprocess (seconds in all)",
    "heavy": "no server, but seconds each: vLLM imports, subprocesses, large simulations",
    "nats": "starts a real nats-server, and services on echo engines (seconds to a minute)",
    "e2e": "starts nats-server, every service and real vLLM engines (minutes)",
}
"""Tier (directory under tests/ and marker) -> what a test there may cost."""

TESTS = Path(__file__).resolve().parent

settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

COSTLY = settings(max_examples=max(settings.default.max_examples // 3, 5))
"""For properties whose every example runs a simulation, a dataset build or a subprocess."""

THOROUGH = settings(max_examples=settings.default.max_examples * 2)
"""For the model checks of the decision cores, which ran 300-400 examples before the profiles."""


def tier_of(path: Path, root: Path = TESTS) -> str | None:
    """The tier of a test file: the first directory under `root`, if it names a tier."""
    try:
        first = Path(path).resolve().relative_to(root).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in TIERS else None


def work_unit(nodeid: str) -> str:
    """With pytest-xdist (`make test`: two workers): the unit of work one worker takes
    whole. Every e2e test is in one, so one worker runs the vLLM engines' tests one after
    another (two at once only share the cores and slow the timing-sensitive tests) while
    the other runs the rest; every other test goes with its file, so a module's fixtures
    start once."""
    return "tests/e2e" if nodeid.startswith("tests/e2e/") else nodeid.split("::")[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Scheduling by `work_unit`, in collection order (the e2e tier first: the longest
    unit starts at once). NOTE: xdist's own `loadgroup` marks groups by rewriting
    `item._nodeid`, which pytest 9 no longer reads; a scheduler is xdist's documented
    hook and needs no marker."""
    from xdist.scheduler import LoadScopeScheduling

    class TierScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    config.option.loadscopereorder = False
    return TierScheduling(config, log)


def pytest_configure(config: pytest.Config) -> None:
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(str(config.rootpath)) / "tests" if (Path(str(config.rootpath)) / "tests").is_dir() else TESTS
    wrong = []
    for item in items:
        tier = tier_of(item.path, root)
        declared = {mark.name for mark in item.iter_markers() if mark.name in TIERS}
        if tier is None:
            if declared:
                wrong.append(f"{item.nodeid}: marked {sorted(declared)} outside any tier directory")
            continue
        if declared - {tier}:
            wrong.append(f"{item.nodeid}: marked {sorted(declared)} but lives in tests/{tier}/")
        item.add_marker(getattr(pytest.mark, tier))
    if wrong:
        raise pytest.UsageError("test tiers disagree with their directories:\n  " + "\n  ".join(wrong))
