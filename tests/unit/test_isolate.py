"""prefixflow.services.engine_worker.isolate: after an engine death, only a prompt that kills the
engine by itself becomes an error row; the feeder runs suspect batches alone; deaths while
isolating are not charged to the rebuild budget."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.feeder import Feeder, Held
from prefixflow.services.engine_worker.isolate import STRIKES, Part, charged, split
from prefixflow.services.engine_worker.rebuild import RebuildBudget
from prefixflow.services.engine_worker.window import Window
from prefixflow.shared.wire import messages as m
from tests.tiers import THOROUGH

pytestmark = pytest.mark.unit


@st.composite
def deaths(draw):
    """A batch's strikes, and which of its positions died in flight / were untried."""
    n = draw(st.integers(1, 40))
    strikes = draw(st.lists(st.integers(0, STRIKES - 1), min_size=n, max_size=n))
    kinds = draw(st.lists(st.sampled_from(["died", "untried", "done"]), min_size=n, max_size=n))
    died = [i for i, k in enumerate(kinds) if k == "died"]
    untried = [i for i, k in enumerate(kinds) if k == "untried"]
    return strikes, died, untried, draw(st.booleans()), draw(st.booleans())


@THOROUGH
@given(deaths())
def test_every_unfinished_prompt_is_retried_or_a_culprit_exactly_once(case):
    strikes, died, untried, suspect, alone = case
    plan = split(strikes, died, untried, suspect=suspect, alone=alone)
    out = [i for part in plan.parts for i in part.indices] + plan.culprits
    assert sorted(out) == sorted(died + untried), "nothing lost, nothing doubled"
    for part in plan.parts:
        assert part.indices, "no empty batch"
        assert not part.strikes or len(part.strikes) == len(part.indices)
        if set(part.indices) <= set(died):
            assert part.strikes, "what died in flight runs as a suspect batch (alone)"
            assert len(part.indices) < len(died) or len(died) == 1, "bisected"
        else:
            assert set(part.indices) == set(untried)
            assert bool(part.strikes) == suspect, "untried prompts keep their batch's kind"
        for i, s in zip(part.indices, part.strikes or [strikes[i] for i in part.indices], strict=True):
            gained = s - strikes[i]
            assert gained == (1 if alone and died == [i] else 0), "a strike only for dying alone in the engine"
    # A culprit: it alone was in flight, and this was its STRIKES-th such death.
    assert plan.culprits == ([died[0]] if alone and len(died) == 1 and strikes[died[0]] + 1 >= STRIKES else [])


def test_examples():
    assert split([0] * 8, [2, 3, 4, 5], [6, 7], suspect=False, alone=False).parts == [
        Part([6, 7], []), Part([2, 3], [0, 0]), Part([4, 5], [0, 0])
    ]
    assert split([0, 1], [1], [0], suspect=True, alone=True).parts == [Part([0], [0]), Part([1], [2])]
    assert split([0, 2], [1], [], suspect=True, alone=True).culprits == [1]
    assert split([0, 2], [1], [], suspect=True, alone=False).parts == [Part([1], [2])], "not alone: no strike"


def simulate(n: int, window: int, killers: set[int], unrelated_at: set[int] = frozenset()) -> tuple[set[int], set[int], int]:
    """The worker's loop in miniature: work batches in a FIFO (the worker's own subject);
    each runs alone, `window` prompts at a time; the engine dies when a killer is in flight
    and at the given steps (unrelated deaths). Returns (finished, culprits, deaths)."""
    queue: deque[tuple[list[int], list[int]]] = deque([(list(range(n)), [])])  # (prompt ids, strikes)
    finished: set[int] = set()
    culprits: set[int] = set()
    deaths = step = 0
    while queue:
        ids, strikes = queue.popleft()
        pos = 0
        while pos < len(ids):
            step += 1
            chunk = list(range(pos, min(pos + window, len(ids))))
            if killers & {ids[i] for i in chunk} or step in unrelated_at:
                deaths += 1
                plan = split(strikes or [0] * len(ids), chunk, list(range(chunk[-1] + 1, len(ids))),
                             suspect=bool(strikes), alone=len(chunk) == 1)
                queue.extend(([ids[i] for i in p.indices], p.strikes) for p in plan.parts)
                culprits |= {ids[i] for i in plan.culprits}
                break
            finished |= {ids[i] for i in chunk}
            pos += window
    return finished, culprits, deaths


@pytest.mark.parametrize("window", [1, 2, 8, 64])
@pytest.mark.parametrize("killer", [0, 17, 63])
def test_one_killer_in_a_batch_of_64_is_the_only_error_row(window, killer):
    finished, culprits, deaths = simulate(64, window, {killer})
    assert culprits == {killer} and finished == set(range(64)) - {killer}
    assert deaths <= 1 + (window - 1).bit_length() + STRIKES, "bisection, then strikes"


@given(st.sets(st.integers(1, 200), max_size=6), st.integers(1, 16), st.integers(0, 63))
def test_unrelated_deaths_never_make_healthy_prompts_error_rows(unrelated, window, killer):
    """Deaths at arbitrary moments besides the killer's: fewer than STRIKES of them can
    strike one healthy prompt, so only the killer becomes an error row."""
    unrelated = set(sorted(unrelated)[: STRIKES - 1])
    finished, culprits, _ = simulate(64, window, {killer}, unrelated)
    assert culprits == {killer} and finished == set(range(64)) - {killer}


def test_only_deaths_with_ordinary_work_in_flight_are_charged():
    assert charged([]) and charged([False]) and charged([True, False])
    assert not charged([True]) and not charged([True, True])
    budget = RebuildBudget(1, 600.0, 1.0)
    assert budget.next_delay(0.0, charge=False) == 0.0 and budget.next_delay(1.0, charge=False) == 0.0
    assert budget.next_delay(2.0) == 1.0 and budget.next_delay(3.0) is None, "uncharged deaths spend nothing"


def test_the_feeder_runs_a_suspect_batch_alone():
    submitted: list[Held] = []
    feeder = Feeder(Window(8, adaptive=False), submitted.append, lambda: 0)
    spec = m.JobSpec(job="j", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=4))
    prompts = [m.Prompt("j", i, bytes(4 * 4), max_tokens=4) for i in range(6)]
    ordinary = m.WorkBatch("b", prompts[:2])
    suspect = m.WorkBatch("b", prompts[2:4], strikes=[0, 1])
    later = m.WorkBatch("c", prompts[4:])
    lease_a, lease_s, lease_c = object(), object(), object()
    feeder.hold([Held(lease_a, p, m.JobLookup(spec), "b", ordinary, i) for i, p in enumerate(ordinary.prompts)])
    feeder.hold([Held(lease_s, p, m.JobLookup(spec), "b", suspect, i) for i, p in enumerate(suspect.prompts)])
    feeder.hold([Held(lease_c, p, m.JobLookup(spec), "c", later, i) for i, p in enumerate(later.prompts)])
    assert [h.prompt.id for h in submitted] == [0, 1], "the suspect batch waits for an empty engine"
    for p in prompts[:2]:
        feeder.finished(p)
    feeder.feed()
    assert [h.prompt.id for h in submitted] == [0, 1, 2, 3], "then runs alone: nothing else goes in"
    feeder.finished(prompts[2])
    feeder.feed()
    assert len(submitted) == 4
    feeder.finished(prompts[3])
    feeder.feed()
    assert [h.prompt.id for h in submitted] == [0, 1, 2, 3, 4, 5]
