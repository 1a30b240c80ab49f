"""Generate identical requests once: which prompts an engine-worker runs, which ride along.
Pure logic (no NATS, no engine); the worker drives it (`service.py`, `recovery.py`).

Two prompts of one job are the same *request* when their model input (packed token ids,
LoRA adapter) and their sampling (structured output included) are the same
(`request_key`). Then:

- **deterministic** (temperature 0, an embedding, or a seed whose per-row seed is the same:
  `request_seed`): the first one (the *leader*) is generated; every other (a *follower*)
  gets a copy of its completion (`Kind.COPY`, `deduplicated_rows`);
- **sampled** (temperature > 0, no seed): the prompts are merged into one request whose
  `n` is the sum of theirs (one prefill), and each prompt takes its own completions from
  it in order (`Kind.MERGED`, `merged_rows`; `split_completion`). A merge grows only
  while its leader waits to go into the engine (`started` closes it) and up to `MAX_N`.
  A sampled row with `logprobs` is never merged (only the first completion has them).

What is bounded, and what happens past the bound (a duplicate is then generated again):
- followers held at once (`max_followers`): past it, a duplicate leads its own request;
- the recent completions of deterministic leaders kept for later duplicates (`Recent`:
  entries and bytes, least recently used first out).

Scoped to one job: the key holds the job id, so no completion ever crosses jobs (or
tenants, whose job ids differ): a shared result would be a side channel.

Exactly once: every prompt admitted is a leader, a follower or a copy (`admit`), and every
follower leaves its group exactly once: with its leader's completion (`finish`), or back
to the caller to run on its own (`finish` without a completion, `abandon_all` after an
engine death): it is never lost with its leader.
"""

from __future__ import annotations

import enum
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, NamedTuple, TypeVar

import msgspec

from prefixflow.services.engine_worker.engines.base import Completion, request_seed
from prefixflow.shared.wire.messages import PromptId, SamplingSpec

T = TypeVar("T")

MAX_N = 64
"""Most completions one merged request asks for (`SamplingSpec.n`'s own bound)."""
MAX_FOLLOWERS = 4096
"""Followers an engine-worker holds at once (their prompts wait for their leader)."""
RECENT_ENTRIES = 4096
"""Completions of deterministic leaders kept for duplicates that come later."""
RECENT_BYTES = 64 * 1024 * 1024
"""... and at most about this many bytes of them."""


class Kind(enum.IntEnum):
    """How a row got its completion (`Result.dedupe`)."""

    OWN = 0
    """Its own request (or it led one)."""
    COPY = 1
    """A copy of an identical deterministic request's completion."""
    MERGED = 2
    """Its own completion(s) of a request merged with identical sampled ones (`n`)."""


class RequestKey(NamedTuple):
    job: str
    digest: bytes
    """blake2b-128 of adapter, canonical sampling and token ids."""
    deterministic: bool


_encode = msgspec.msgpack.Encoder().encode


def request_key(job: str, tokens: bytes, lora: str, sampling: SamplingSpec, prompt_id: PromptId,
                task: str = "generate") -> RequestKey | None:
    """The request a prompt asks for; None when it is never shared (a sampled row with
    logprobs). Deterministic: an embedding, temperature 0 (its seed does not matter), or
    a seed (the row's own seed, `request_seed`, is part of the key: rows of one job rarely
    share one). Sampled: the key leaves `n` out (a merge sums it)."""
    if task == "embed":
        canon, deterministic = b"embed", True
    elif sampling.temperature == 0:
        canon, deterministic = _encode(msgspec.structs.replace(sampling, seed=None)), True
    elif sampling.seed is not None:
        canon, deterministic = _encode(msgspec.structs.replace(sampling, seed=request_seed(sampling, prompt_id))), True
    elif sampling.logprobs is not None:
        return None
    else:
        canon, deterministic = _encode(msgspec.structs.replace(sampling, n=1)), False
    h = hashlib.blake2b(digest_size=16)
    for part in (lora.encode(), canon, tokens):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return RequestKey(job, h.digest(), deterministic)


@dataclass(eq=False)
class Group(Generic[T]):
    """A leader and the followers that get their completions from its request."""

    key: RequestKey
    leader: T
    ns: list[int]
    """Completions each member asks for (`SamplingSpec.n`), the leader's first."""
    followers: list[T] = field(default_factory=list)
    open: bool = True
    """Followers may still join (a sampled merge closes once its leader is in the engine;
    any request once it is done)."""

    @property
    def n(self) -> int:
        """Completions the request asks for: the leader's own, or the merge's sum."""
        return sum(self.ns) if not self.key.deterministic else self.ns[0]

    @property
    def kind(self) -> Kind:
        return Kind.COPY if self.key.deterministic else Kind.MERGED


class Lead(NamedTuple):
    group: Group | None
    """The prompt leads this request: run it (with `group.n`); None: a request never shared."""


class Follow(NamedTuple):
    group: Group
    """The prompt waits for its leader's completion."""


class Copy(NamedTuple):
    completion: Completion
    """An identical deterministic request finished recently: this is its completion."""


Admission = Lead | Follow | Copy


def completion_bytes(c: Completion) -> int:
    """About what a kept completion holds in memory."""
    return 200 + len(c.output) + sum(len(o) for o in c.outputs) + 100 * len(c.logprobs) + 8 * len(c.embedding)


class Recent:
    """Completions of deterministic requests, least recently used first out (bounded)."""

    def __init__(self, entries: int = RECENT_ENTRIES, max_bytes: int = RECENT_BYTES,
                 size: Callable[[Completion], int] = completion_bytes) -> None:
        self.entries, self.max_bytes, self.size = entries, max_bytes, size
        self.items: OrderedDict[RequestKey, tuple[Completion, int]] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: RequestKey) -> Completion | None:
        got = self.items.get(key)
        if got is None:
            return None
        self.items.move_to_end(key)
        return got[0]

    def put(self, key: RequestKey, c: Completion) -> None:
        size = self.size(c)
        if self.entries <= 0 or size > self.max_bytes:
            return
        if (old := self.items.pop(key, None)) is not None:
            self.nbytes -= old[1]
        self.items[key] = (c, size)
        self.nbytes += size
        while len(self.items) > self.entries or self.nbytes > self.max_bytes:
            _, (_, gone) = self.items.popitem(last=False)
            self.nbytes -= gone


class Deduper(Generic[T]):
    """The open requests of one engine-worker and the recent deterministic completions.
    Members are the caller's objects (the worker's `Held`); groups are told apart by
    identity."""

    def __init__(self, *, max_followers: int = MAX_FOLLOWERS, recent: Recent | None = None) -> None:
        self.max_followers = max_followers
        self.recent = recent if recent is not None else Recent()
        self.open: dict[RequestKey, Group[T]] = {}
        """Requests that followers may still join, by key."""
        self.waiting: dict[int, Group[T]] = {}
        """id(group) -> group, for every group with followers not yet settled."""
        self.followers = 0
        """Followers held in all groups (at most `max_followers`)."""

    def admit(self, key: RequestKey | None, item: T, n: int = 1) -> Admission:
        """Where `item` (asking `n` completions of request `key`; None: never shared) gets
        its completion: it leads a request (run it, then `finish` its group), follows one
        (its leader's `finish` hands it back), or takes a recent completion now."""
        if key is None:
            return Lead(None)
        if key.deterministic and (done := self.recent.get(key)) is not None:
            return Copy(done)
        group = self.open.get(key)
        if (group is not None and self.followers < self.max_followers
                and (key.deterministic or group.n + n <= MAX_N)):
            group.followers.append(item)
            group.ns.append(n)
            self.followers += 1
            self.waiting[id(group)] = group
            return Follow(group)
        group = Group(key, item, [n])
        self.open[key] = group  # a newer request of the key takes over (the older keeps its followers)
        return Lead(group)

    def started(self, group: Group[T]) -> None:
        """Its leader goes into the engine: a sampled merge takes no more members (its `n`
        is now fixed); a deterministic request still does until it finishes."""
        if not group.key.deterministic and self.open.get(group.key) is group:
            del self.open[group.key]
        group.open = group.key.deterministic

    def finish(self, group: Group[T], completion: Completion | None) -> list[T]:
        """Its leader's request is done: its completion (None: it failed; the followers
        then run on their own) is kept for later duplicates if deterministic. Returns the
        followers, which the caller now settles (they are no longer held here)."""
        if self.open.get(group.key) is group:
            del self.open[group.key]
        group.open = False
        if group.key.deterministic and completion is not None:
            self.recent.put(group.key, completion)
        if self.waiting.pop(id(group), None) is not None:
            self.followers -= len(group.followers)
        return group.followers

    def abandon_all(self) -> list[T]:
        """The engine died: every open request is off; their followers go back to the
        caller (never started, they run again as they were). Recent completions stay."""
        out = [f for g in self.waiting.values() for f in g.followers]
        for g in self.open.values():
            g.open = False
        self.open.clear()
        self.waiting.clear()
        self.followers = 0
        return out


def split_completion(c: Completion, ns: list[int]) -> list[Completion]:
    """A merged request's completion shared out: member i takes the next `ns[i]`
    completions (its `output` the first of them, `outputs` all of them when it asked for
    more than one), their output tokens and the first one's finish reason. Every member
    counts the whole prompt and its cached part, as a copy does (each row's own prompt;
    `merged_rows` says how many rode along). Raises ValueError when the engine
    gave fewer completions than asked."""
    texts = c.outputs or [c.output]
    if len(texts) < sum(ns):
        raise ValueError(f"merged request of n={sum(ns)} returned {len(texts)} completions")
    counts = c.output_counts or [c.output_tokens // max(len(texts), 1)] * len(texts)
    reasons = c.finish_reasons or [c.finish_reason] * len(texts)
    out = []
    start = 0
    for i, n in enumerate(ns):
        mine = slice(start, start + n)
        start += n
        out.append(Completion(
            texts[mine][0], reasons[mine][0], c.prompt_tokens, c.cached_tokens, sum(counts[mine]),
            outputs=texts[mine] if n > 1 else [], output_counts=counts[mine] if n > 1 else [],
            finish_reasons=reasons[mine] if n > 1 else [],
        ))
    return out
