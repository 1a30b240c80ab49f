"""A torture round's plan, drawn from (seed, round) alone, so that `--seed S --round R
--rounds 1` replays it (the draws; the processes' timing is the machine's), and its
result. Pure: no I/O."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from prefixflow.torture import batches, datasets, faults
from prefixflow.torture.checkers import Violation
from prefixflow.torture.entries import ENTRIES
from prefixflow.torture.known import known_for

CLUSTER_PROCESSES = ("nats", "ingestor", "bucketer", "router", "engine0", "sink")
"""What faults may hit: every process of a one-replica local cluster."""


@dataclass
class RoundPlan:
    seed: int
    round: int
    entry: str
    dataset: datasets.Dataset | batches.BatchSet
    faults: list[faults.Fault]
    second: str | None
    """After a first job done: `refuse` (another input into its --out: exit 2, output
    untouched) or `overwrite` (that, then the same with --overwrite: the new job's rows)."""
    second_dataset: datasets.Dataset | None
    rng: random.Random
    """What is left of the round's stream (publish order...)."""

    @property
    def job(self) -> str:
        return f"t{self.seed}-r{self.round}"

    def describe(self) -> str:
        what = ", ".join(self.dataset.features) or "plain"
        extra = f", then {self.second}" if self.second else ""
        return (f"{self.entry} {self.dataset.kind} {len(self.dataset.ids())} ids ({what}){extra}; faults: "
                + ("; ".join(map(str, self.faults)) or "none"))


def rng_for(seed: int, round_: int) -> random.Random:
    return random.Random(f"prefixflow-torture:{seed}:{round_}")


def plan_round(seed: int, round_: int, entries: tuple[str, ...], *, disk: bool, max_rows: int = 200) -> RoundPlan:
    rng = rng_for(seed, round_)
    entry = rng.choice(entries)
    if entry == "batch":  # the API chooses where the output goes: no full disk, no second input
        ds = batches.draw(rng, max_rows=max_rows)
        return RoundPlan(seed, round_, entry, ds, faults.plan(rng, list(CLUSTER_PROCESSES), disk=False, api=True),
                         None, None, rng)
    kind = "raw" if entry == "raw" else rng.choice(("parquet", "jsonl"))
    ds = datasets.draw(rng, kind, max_rows=max_rows)
    plan = faults.plan(rng, list(CLUSTER_PROCESSES), disk=disk)
    second = rng.choice((None, None, "refuse", "overwrite")) if entry != "raw" else None
    ds2 = datasets.draw(rng, kind, max_rows=max_rows) if second else None
    return RoundPlan(seed, round_, entry, ds, plan, second, ds2, rng)


def replay_command(seed: int, round_: int, entries: tuple[str, ...]) -> str:
    extra = "" if set(entries) == set(ENTRIES) else f" --entries {','.join(entries)}"
    return f"prefixflow torture --seed {seed} --round {round_} --rounds 1{extra}"


@dataclass
class RoundResult:
    seed: int
    round: int
    entry: str
    description: str
    faults_done: list[str] = field(default_factory=list)
    checks: dict[str, int] = field(default_factory=dict)
    """Invariant checks passed, by invariant."""
    violations: list[Violation] = field(default_factory=list)
    seconds: float = 0.0
    paused: int | None = None
    """The job paused for its full disk (exit 75): the exit code of the same command run
    again once the space was back (0: it completed the job)."""

    def passed(self, invariant: str) -> None:
        self.checks[invariant] = self.checks.get(invariant, 0) + 1

    def record(self, invariant: str, found: list[Violation]) -> None:
        """One invariant's check: passed, or its violations kept."""
        if found:
            self.violations.extend(found)
        else:
            self.passed(invariant)

    @property
    def unknown(self) -> list[Violation]:
        return [v for v in self.violations if known_for(str(v)) is None]

    @property
    def verdict(self) -> str:
        if not self.violations:
            return "ok"
        return "FAILED" if self.unknown else "known"


def summarize(seed: int, results: list[RoundResult], entries: tuple[str, ...], fault_counts: Counter, disk: bool,
              seconds: float) -> dict[str, Any]:
    """A run's report (`WORKDIR/torture.json`): rounds, entries, faults and checks passed
    by kind, verdicts, and every round with a violation (its replay command)."""
    checks: Counter = Counter()
    for res in results:
        checks.update(res.checks)
    failures = [{"seed": res.seed, "round": res.round, "entry": res.entry, "verdict": res.verdict,
                 "plan": res.description, "faults": res.faults_done, "violations": [str(v) for v in res.violations],
                 "replay": replay_command(res.seed, res.round, entries)}
                for res in results if res.violations]
    return {"seed": seed, "rounds": len(results), "seconds": round(seconds, 1),
            "entries": dict(Counter(res.entry for res in results)),
            "faults": dict(fault_counts), "disk_faults": disk,
            "disk_pauses": {"paused": sum(res.paused is not None for res in results),
                            "completed_again": sum(res.paused == 0 for res in results)},
            "checks_passed": dict(checks), "checks_passed_total": sum(checks.values()),
            "ok": sum(res.verdict == "ok" for res in results),
            "known": sum(res.verdict == "known" for res in results),
            "failed": sum(res.verdict == "FAILED" for res in results), "failures": failures}
