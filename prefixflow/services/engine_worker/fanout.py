"""The engine-worker's side of dedupe (mixed into `service.EngineWorker`): which held
prompts go into the engine, and the fan-out of a request's completion to its followers.

The decisions are `dedupe.Deduper`'s; here they meet the worker's state:
- `admit`: a work batch's prompts as leaders (returned, to be run), followers (held,
  waiting for their leader: `Feeder.attach`) and copies (a recent completion: their
  result rows are queued at once);
- `leader_sampling`: a leader's sampling with its merge's `n` (the merge closes then);
- `settle`: a leader is done: each follower's result row is queued under its *own* work
  message's lease (so that message is acked only once its rows are published), with its
  own id and input columns (`src`, `row`: the sink joins them), or, when the leader failed
  (its own error, not a dead engine), the followers run on their own;
- after an engine death `recovery.py` takes every follower back (`abandon_all`) and
  re-publishes it untried with the rest of its work message; a worker process that dies
  leaves every message unacked, its followers' included, for JetStream to redeliver.
"""

from __future__ import annotations

import time

import msgspec
import structlog

from prefixflow.services.engine_worker.dedupe import (
    Copy, Deduper, Follow, Group, Kind, Lead, RequestKey, request_key, split_completion,
)
from prefixflow.services.engine_worker.engines import Completion
from prefixflow.services.engine_worker.feeder import Held
from prefixflow.services.engine_worker.requests import prompt_sampling
from prefixflow.shared.wire import messages as m

log = structlog.get_logger()


class Fanout:
    """Dedupe in the worker; `self` is the `EngineWorker` (its `dedupe`, `leading`,
    `feeder`, `finish`)."""

    dedupe: Deduper[Held]
    leading: dict[int, Group[Held]]
    """id(held) -> the group a held leader leads (keyed requests only)."""
    deduplicated: int
    """Rows given a copy (`EngineStatus.deduplicated`, `pfx_engine_deduplicated_rows`)."""
    merged: int
    """Rows that rode in a merged request (`EngineStatus.merged`)."""

    def request_of(self, held: Held) -> tuple[RequestKey | None, int]:
        """(the request `held` asks for, its n); (None, 1) when it is not shared: its job
        turned dedupe off, or its job or sampling is bad (its error row comes from the run)."""
        spec = held.lookup.spec
        if spec is None or not spec.dedupe:
            return None, 1
        try:
            sampling = prompt_sampling(held.prompt, spec.sampling)
        except msgspec.DecodeError:
            return None, 1
        p = held.prompt
        return request_key(p.job, p.tokens, p.lora, sampling, p.id, spec.task), sampling.n

    async def admit(self, held: list[Held], *, attach: bool) -> list[Held]:
        """The prompts of `held` to run (leaders and unshared ones); followers wait for
        their leader (`attach`: counted as held by the feeder), copies are done now."""
        run = []
        for h in held:
            key, n = self.request_of(h)
            match self.dedupe.admit(key, h, n):
                case Lead(group):
                    if group is not None:
                        self.leading[id(h)] = group
                    run.append(h)
                case Follow():
                    if attach:
                        self.feeder.attach(h)
                case Copy(completion):
                    await self.fan_out([h], [completion], Kind.COPY, bucket=h.bucket, started_at=time.time())
        return run

    def leader_sampling(self, held: Held, sampling: m.SamplingSpec) -> m.SamplingSpec:
        """`held` goes into the engine now: its sampling, with the merged `n` if it leads a
        sampled merge (which takes no more members from now on)."""
        group = self.leading.get(id(held))
        if group is None:
            return sampling
        self.dedupe.started(group)
        if group.n != sampling.n:
            return msgspec.structs.replace(sampling, n=group.n)
        return sampling

    async def settle(self, held: Held, completion: Completion | None, error: str | None = None, *, started_at: float,
                     fed: bool) -> Completion | None:
        """`held`'s request is done: `completion`, or None and `error` when it failed.
        Returns the leader's own completion (a merge's first share). Its followers get
        theirs now (their deadline ran from their leader's admission); if it failed they
        run on their own (`unshared`). `fed`: the feeder holds the followers (not a batch
        engine's worker)."""
        group = self.leading.pop(id(held), None)
        if group is None:
            return completion
        followers = self.dedupe.finish(group, completion)
        for f in followers:
            f.prompt.admitted_at = f.prompt.admitted_at or held.prompt.admitted_at
        if completion is None:
            await self.unshared(followers, error or "", fed=fed)
            return None
        if group.key.deterministic:
            shares = [completion] * (len(followers) + 1)
        else:
            try:
                shares = split_completion(completion, group.ns)
            except ValueError as exc:  # the engine gave fewer completions: the followers run on their own
                log.error("merged request came back short: its followers run on their own", error=str(exc))
                await self.unshared(followers, str(exc), fed=fed)
                return completion
        if followers:
            await self.fan_out(followers, shares[1:], group.kind, bucket=held.bucket, started_at=started_at, fed=fed)
        return shares[0]

    async def unshared(self, followers: list[Held], error: str, *, fed: bool) -> None:
        """Followers whose leader's request failed: back into the feeder's queue to run
        on their own (`fed`), or (a batch engine's failure, the whole batch's) its error."""
        if fed:
            if followers:
                self.feeder.requeue(followers)
            return
        for f in followers:
            await self.finish(f.lease, f.prompt, error=error, bucket=f.bucket)

    async def fan_out(self, rows: list[Held], completions: list[Completion], kind: Kind, *, bucket: str,
                      started_at: float, fed: bool = False) -> None:
        """Result rows for `rows` (each its own id, input columns and lease) from `completions`."""
        for h, c in zip(rows, completions, strict=True):
            if fed:
                self.feeder.finished(h.prompt, submitted=False)
            await self.finish(h.lease, h.prompt, c, bucket=bucket, started_at=started_at, dedupe=kind)
        if kind == Kind.COPY:
            self.deduplicated += len(rows)
        else:
            self.merged += len(rows)

    def abandon_followers(self) -> list[Held]:
        """The engine died: every follower waiting for a leader, to be re-published untried
        (no longer held by the feeder)."""
        followers = self.dedupe.abandon_all()
        self.leading.clear()
        if self.generate_batch is None:
            for f in followers:
                self.feeder.finished(f.prompt, submitted=False)
        if followers:
            log.warning("engine died with followers waiting: re-published with their work", followers=len(followers))
        return followers
