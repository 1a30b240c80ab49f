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


KNOWN: tuple[Known, ...] = (
    # A batch's output bodies name the cluster's model as the API is configured (a local
    # path here), not the served name the request asked for, as vLLM's server and OpenAI
    # answer: OpenAI conformance of the batch output (the openai-conformance work).
    Known(r"^batch-model: bodies name the model", "openai-conformance: the response body's model", 523, 0),
    # The API stopped (SIGTERM) a second after its runner submitted a batch's job, while
    # the cluster's ingestor and sink were being killed: the job completed on the cluster
    # (sealed, every row written) 40 s later, but the restarted API never moved the batch
    # past `in_progress` until the API was restarted once more (then `completed` at once).
    # The API's restart races (issue 40).
    Known(r"^batch-status: batch \S+ still in_progress after \d+ s .*; its job is done on the cluster",
          "issue 40: the batch API's restart races (a resumed batch not finalized)", 523, 0),
)
"""Filled from the long runs (docs/torture.md, "Known failures")."""


def known_for(text: str) -> Known | None:
    return next((k for k in KNOWN if k.matches(text)), None)
