"""Failures the torture harness has found that belong to other open work: recorded with
the seed that shows them, reported as known (not as new failures), not fixed here.

Each entry: a regular expression on a violation's text (`Violation.__str__`), where it
belongs, and the seed/round that first showed it (`prefixflow torture --seed S --round R
--rounds 1` replays it). A round whose every violation matches an entry is `known`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    pattern: str
    belongs_to: str
    seed: int
    round: int

    def matches(self, text: str) -> bool:
        return re.search(self.pattern, text) is not None


KNOWN: tuple[Known, ...] = ()
"""Filled from the long runs (docs/torture.md, "Known failures")."""


def known_for(text: str) -> Known | None:
    return next((k for k in KNOWN if k.matches(text)), None)
