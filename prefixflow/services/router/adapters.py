"""Which replicas a LoRA adapter's work may go to. Pure logic, no I/O.

An engine runs at most `--max-loras` adapters at once (its slots); a request of one more
adapter waits in vLLM until a slot frees, and its prefix cache is the adapter's own. So
an adapter's work stays on the replicas that already hold work of it ("warm"), and goes
to a replica with a free slot only when none of those can take it, or to keep a replica
that is short of work busy: an adapter is loaded on as few replicas as its work needs
and adapters do not take turns in a replica's slots while another replica has room.

A replica's adapter state comes from its status (the adapters it serves, its slots, the
prompts it holds per adapter) and from what the router routed there since.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar


@dataclass(slots=True)
class Adapters:
    """One replica's adapters."""

    served: frozenset[str] = frozenset()
    """Adapters it serves (empty: unknown, or none)."""
    slots: int = 0
    """Adapters its engine runs at once (0: no LoRA)."""
    held: dict[str, int] = field(default_factory=dict)
    """Prompts it holds per adapter: its last report, plus what was routed there since."""

    def observe(self, served: Sequence[str], slots: int, held: dict[str, int]) -> None:
        self.served = frozenset(served)
        self.slots = slots
        self.held = {a: n for a, n in held.items() if n > 0}

    def assign(self, lora: str, prompts: int) -> None:
        if lora and prompts > 0:
            self.held[lora] = self.held.get(lora, 0) + prompts


class HasAdapters(Protocol):
    adapters: Adapters


R = TypeVar("R", bound=HasAdapters)


def spare_slots(replicas: Sequence[HasAdapters]) -> int:
    """Adapter slots of `replicas` beyond one per adapter they serve: how many adapters
    could run on a second replica without another waiting for a slot (<= 0: none)."""
    served: set[str] = set()
    slots = 0
    for r in replicas:
        served |= r.adapters.served
        slots += r.adapters.slots
    return slots - len(served)


def adapter_candidates(candidates: list[R], lora: str, hungry: Callable[[R], bool], spare: int = 0) -> list[R]:
    """Of `candidates` (replicas with room), those an adapter's bucket should go to:
    the ones serving it (all, if none says it does: the engines' error rows tell), of
    those the warm ones (plus, while the fleet has `spare` slots, any hungry one with a
    free slot); with no warm one, those with a free slot; else all that serve it. The
    base model (`lora` empty): all. A cold adapter's bucket goes to one replica when the
    fleet has no slot to spare (`spread_cold`)."""
    if not lora or not candidates:
        return candidates
    serving = [r for r in candidates if lora in r.adapters.served] or candidates
    warm = [r for r in serving if lora in r.adapters.held]
    free = [r for r in serving if lora not in r.adapters.held and len(r.adapters.held) < r.adapters.slots]
    if warm:
        return warm + [r for r in free if hungry(r)] if spare > 0 else warm
    return free or serving


def spread_cold(candidates: Sequence[HasAdapters], lora: str, spare: int) -> bool:
    """Whether an adapter's bucket may be split over several of `candidates` (its
    `adapter_candidates`): always for the base model or an adapter already running on
    them, else only while the fleet has slots to spare."""
    return not lora or spare > 0 or any(lora in r.adapters.held for r in candidates)
