"""The prompts an engine-worker holds, and when each goes into the engine.

A work message carries up to `--max-batch` prompts; they are held here and submitted
while the engine's window (`window.Window`) has room, so the window (one prompt during
a probe, then what the engine can run) is kept per prompt, not per message. Everything
held counts as this replica's load (the router's view), submitted or not.

A prompt goes in only while the engine's KV cache has room for it as well
(`admission.KvAdmission`: its prompt blocks no prompt in the engine holds yet, and its
expected output), so vLLM rarely has to preempt.

With LoRA adapters, a prompt goes in only while the engine has a slot for its adapter
(`--max-loras`: at most that many adapters among the prompts in the engine): vLLM would
hold a prompt of one more adapter back anyway, with its KV reservation and its place in
the window taken; here the prompts behind it (other adapters, the base model) go first.

A suspect batch (`WorkBatch.strikes` set: prompts in flight when an engine died,
`isolate.py`) runs alone: it goes in only when the engine is empty, and nothing else goes
in until it is done, so a further death points at it alone.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from prefixflow.services.engine_worker.admission import KvAdmission, Ticket
from prefixflow.services.engine_worker.requests import prompt_sampling
from prefixflow.services.engine_worker.window import Window
from prefixflow.shared.wire import messages as m

if TYPE_CHECKING:  # the ledger's module talks to NATS; this one stays pure
    from prefixflow.shared.bus.ledger import Lease


LORA_SCAN = 256
"""Held prompts the feeder looks past for one whose adapter has a slot."""


class Held(NamedTuple):
    """A prompt of a held work batch."""

    lease: "Lease"
    prompt: m.Prompt
    lookup: m.JobLookup
    bucket: str
    work: m.WorkBatch | None = None
    """The work batch it came in (None: tests of the window only)."""
    index: int = 0
    """Its position in `work.prompts`."""

    @property
    def suspect(self) -> bool:
        """From a suspect batch: runs alone in the engine."""
        return self.work is not None and bool(self.work.strikes)


def max_tokens(held: Held) -> int:
    """The prompt's token budget: max_tokens for each of its `n` completions (vLLM keeps
    a sequence, and its own KV blocks, for each); 0 if its job or sampling is bad (it
    fails at once)."""
    if held.lookup.spec is None:
        return 0
    try:
        sampling = prompt_sampling(held.prompt, held.lookup.spec.sampling)
        return sampling.max_tokens * sampling.n
    except Exception:  # noqa: BLE001 - the worker turns it into an error row
        return 0


class Feeder:
    def __init__(
        self, window: Window, submit: Callable[[Held], None], generated: Callable[[], int], *,
        admission: KvAdmission | None = None, steps: Callable[[], int] | None = None, lora_slots: int = 0,
        clock: Callable[[], float] = time.monotonic, budget: Callable[[Held], int] = max_tokens,
    ) -> None:
        self.window = window
        self.clock = clock
        """Monotonic seconds (the simulator passes its own clock)."""
        self.budget = budget
        """A held prompt's token budget (`max_tokens`: from its job's sampling and its own)."""
        self.lora_slots = lora_slots
        """Adapters the engine runs at once (0: no limit)."""
        self.engine_loras: Counter[str] = Counter()
        """Prompts in the engine per adapter."""
        self.admission = admission or KvAdmission(enabled=False)
        """KV memory the prompts in the engine have reserved (`admission.py`)."""
        self.tickets: dict[int, Ticket] = {}
        """id(prompt) -> what it reserved, for the prompts in the engine."""
        self.submit = submit
        """Starts one prompt in the engine (the worker's task per prompt)."""
        self.generated = generated
        """The engine's generated-token count (the probe measures its rate)."""
        self.steps = steps
        """The engine's step count (admission reads each prompt's progress from it)."""
        self.pending: deque[Held] = deque()
        """Held, not yet submitted (at most one work batch past the window)."""
        self.inflight = 0
        """Submitted to the engine and not finished."""
        self.alone: object | None = None
        """The lease of the suspect batch running alone in the engine (None: none)."""
        self.held_tokens = 0
        """Load (`Prompt.load`) of everything held (submitted or pending): the replica's."""
        self.jobs: Counter[str] = Counter()
        """Prompts held per job (the status shows them: progress before any row is done)."""
        self.loras: Counter[str] = Counter()
        """Prompts held per LoRA adapter (the router keeps an adapter's work together)."""
        self.open = True
        """False while the engine is dead or the worker stops: nothing more is submitted."""

    def room(self) -> int:
        """Prompts the worker may still take (pull more work while positive)."""
        return self.window.limit - self.inflight - len(self.pending)

    def hold(self, prompts: list[Held]) -> None:
        for held in prompts:
            self.attach(held)
            self.pending.append(held)
        self.feed()

    def attach(self, held: Held) -> None:
        """Count `held` as held here without queueing it: a follower that waits for its
        leader's completion (`dedupe.py`). It leaves by `finished(submitted=False)`, or
        `requeue` when it has to run on its own after all."""
        self.held_tokens += held.prompt.load
        self.jobs[held.prompt.job] += 1
        if held.prompt.lora:
            self.loras[held.prompt.lora] += 1

    def requeue(self, followers: list[Held]) -> None:
        """Attached followers whose leader failed: they run on their own, first in line."""
        self.pending.extendleft(reversed(followers))
        self.feed()

    def may_submit(self, held: Held) -> bool:
        """Isolation: a suspect batch goes in only into an empty engine, and nothing else
        goes in while it runs."""
        if self.inflight == 0:
            return True
        if self.alone is not None:
            return held.lease is self.alone
        return not held.suspect

    def has_slot(self, lora: str) -> bool:
        """The engine can run a prompt of adapter `lora` now (the base model: always)."""
        return not lora or not self.lora_slots or lora in self.engine_loras or len(self.engine_loras) < self.lora_slots

    def ticket(self, held: Held) -> Ticket:
        return self.admission.ticket(held.prompt.tokens, self.budget(held), held.prompt.lora)

    def feed(self) -> None:
        """Submit pending prompts while the window and the KV cache have room."""
        admission = self.admission
        if self.steps is not None:
            admission.clock = self.steps()
        i = 0  # prompts passed over: of adapters with no slot now
        while i < len(self.pending) and self.open and self.inflight < self.window.limit:
            held = self.pending[i]
            if not self.may_submit(held):
                break
            lora = held.prompt.lora
            if not self.has_slot(lora):
                i += 1
                if i >= LORA_SCAN:
                    break
                continue
            if admission.active:
                ticket = self.ticket(held)
                if not admission.admits(ticket):
                    break  # in order: it goes in when earlier prompts leave room
                admission.admit(ticket)
                self.tickets[id(held.prompt)] = ticket
            del self.pending[i]
            if lora:
                self.engine_loras[lora] += 1
            if self.inflight == 0:
                self.window.work_arrives(self.clock(), 0, self.budget(held), self.generated())
            self.alone = held.lease if held.suspect else None
            self.inflight += 1
            self.submit(held)

    def finished(self, prompt: m.Prompt, submitted: bool = True, output_tokens: int | None = None) -> None:
        """A prompt is done (or, not submitted, handed back): it is no longer held.
        `output_tokens`: what it generated, if it finished (the expected output learns)."""
        ticket = self.tickets.pop(id(prompt), None)
        if ticket is not None:
            self.admission.release(ticket, output_tokens)
        if submitted:
            self.inflight -= 1
            if prompt.lora:
                self.engine_loras[prompt.lora] -= 1
                if self.engine_loras[prompt.lora] <= 0:
                    del self.engine_loras[prompt.lora]
            self.window.completed(self.clock())
            if self.inflight == 0:
                self.alone = None
        self.held_tokens -= prompt.load
        self.jobs[prompt.job] -= 1
        if self.jobs[prompt.job] <= 0:
            del self.jobs[prompt.job]
        if prompt.lora:
            self.loras[prompt.lora] -= 1
            if self.loras[prompt.lora] <= 0:
                del self.loras[prompt.lora]

    def drop_pending(self) -> list[Held]:
        """The engine died: pending prompts are no longer held here (the worker
        re-publishes them, untried). Returns them."""
        dropped = list(self.pending)
        for held in dropped:
            self.finished(held.prompt, submitted=False)
        self.pending.clear()
        return dropped
