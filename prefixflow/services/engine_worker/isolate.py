"""Find the prompt that kills the engine, spare the rest: which prompts of a work batch to
retry how after an engine death. Pure logic (no NATS, no vLLM).

When an engine dies, only the prompts then in flight can have killed it; prompts held but
not yet submitted are untouched. The worker re-publishes a batch's unfinished prompts:

- the untried ones as they were (an ordinary batch stays ordinary, a suspect one suspect);
- the ones that died in flight as *suspect* batches (`WorkBatch.strikes` set), which run
  alone in the engine: two halves when several died together (bisection), one prompt
  when one did;
- a prompt that died alone in the engine gets a strike; at `STRIKES` strikes it is the
  culprit and becomes an error row.

So a prompt that kills the engine by itself ends as the only error row after about
log2(window) + `STRIKES` deaths, and a healthy prompt becomes an error row only if the
engine died `STRIKES` times while it ran alone: an unrelated death (OOM, a GPU fault, a
kill) strikes at most the one prompt then alone in the engine, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

STRIKES = 3
"""Deaths of the engine while a prompt ran alone in it after which that prompt is the
culprit (an error row). NOTE: more than one, so one unrelated death never condemns a
prompt; small, since each strike costs an engine rebuild."""


class Part(NamedTuple):
    """A work batch to re-publish: positions in the original batch, and their strikes
    (`WorkBatch.strikes`; empty: an ordinary batch)."""

    indices: list[int]
    strikes: list[int]


class Split(NamedTuple):
    parts: list[Part]
    culprits: list[int]
    """Positions of prompts that killed the engine alone `STRIKES` times: error rows."""


def split(
    strikes: Sequence[int], died: Sequence[int], untried: Sequence[int], *, suspect: bool, alone: bool,
    limit: int = STRIKES,
) -> Split:
    """How to retry the unfinished prompts of one work batch after its engine died.

    `strikes`: per prompt of the batch (`WorkBatch.strikes`, or zeros for an ordinary
    batch); `died`: positions that were in flight when the engine died; `untried`:
    positions held but not submitted; `suspect`: the batch is a suspect batch; `alone`:
    the one prompt in `died` was the only prompt in the engine."""
    parts: list[Part] = []
    culprits: list[int] = []
    if untried:
        # NOTE: these never ran in the dead engine: same batch kind, same strikes.
        parts.append(Part(list(untried), [strikes[i] for i in untried] if suspect else []))
    if len(died) == 1:
        i = died[0]
        s = strikes[i] + (1 if alone else 0)
        if s >= limit:
            culprits.append(i)
        else:
            parts.append(Part([i], [s]))
    elif died:
        half = (len(died) + 1) // 2
        for group in (died[:half], died[half:]):
            parts.append(Part(list(group), [strikes[i] for i in group]))
    return Split(parts, culprits)


def charged(died_suspect: Sequence[bool]) -> bool:
    """Whether an engine death counts against the rebuild budget (`rebuild.py`).

    `died_suspect`: for each prompt in flight at the death, whether it came from a suspect
    batch. NOTE: a death while the engine ran only suspects is the isolation at work (it
    splits a group or strikes a prompt, so it cannot go on for ever) and is not charged; a
    death with ordinary work in flight, or with nothing in flight, is."""
    return not died_suspect or not all(died_suspect)
