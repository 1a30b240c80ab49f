"""prefixflow.services.engine_worker.dedupe: identical requests of a job are generated once.

A model engine-worker drives the decision class through drawn interleavings of prompts
arriving, leaders going into the engine, finishing (or failing) and engine deaths, and
checks the contract: every prompt gets exactly one completion (or error) of its own job;
a deterministic follower gets its leader's completion; a sampled merge asks for n = the
sum of its members' and each member gets its own; the bound on followers holds; nothing
is ever shared across jobs."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.services.engine_worker.dedupe import (
    MAX_N, Copy, Deduper, Follow, Kind, Lead, Recent, request_key, split_completion,
)
from prefixflow.services.engine_worker.engines import Completion
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.messages import FinishReason

pytestmark = pytest.mark.unit


@dataclass(eq=False)
class Row:
    job: str
    id: int
    tokens: bytes
    sampling: m.SamplingSpec

    @property
    def key(self):
        return request_key(self.job, self.tokens, "", self.sampling, self.id)


SAMPLINGS = [
    m.SamplingSpec(temperature=0.0),
    m.SamplingSpec(temperature=0.0, n=2),
    m.SamplingSpec(temperature=0.8),
    m.SamplingSpec(temperature=0.8, n=3),
    m.SamplingSpec(temperature=0.8, seed=7),
    m.SamplingSpec(temperature=0.8, logprobs=1),
]


def engine(job: str, leader: int, n: int) -> Completion:
    """The model engine: distinct, traceable completions."""
    texts = [f"{job}/{leader}/{i}" for i in range(n)]
    return Completion(texts[0], FinishReason.LENGTH, 3, 1, 2 * n, outputs=texts if n > 1 else [],
                      output_counts=[2] * n if n > 1 else [], finish_reasons=[FinishReason.LENGTH] * n if n > 1 else [])


@st.composite
def runs(draw):
    rows = []
    for i in range(draw(st.integers(1, 30))):
        rows.append(Row(draw(st.sampled_from(["a", "b"])), i, tk.pack([draw(st.integers(0, 2)), 9]),
                        draw(st.sampled_from(SAMPLINGS))))
    ops = draw(st.lists(st.sampled_from(["admit", "admit", "admit", "start", "finish", "fail", "die"]), max_size=80))
    return rows, ops, draw(st.integers(0, 8)), draw(st.integers(0, 5))


@given(runs())
def test_every_row_gets_exactly_one_completion_of_its_own_job(case):
    rows, ops, max_followers, recent_entries = case
    d: Deduper[Row] = Deduper(max_followers=max_followers, recent=Recent(entries=recent_entries))
    todo = list(rows)
    waiting: list[Row] = []  # leaders not yet in the engine
    running: list[tuple[Row, object, int]] = []  # (leader, group, n asked)
    leading: dict[int, object] = {}
    got: dict[int, list[tuple[Completion, Kind]]] = {}
    origin: dict[int, Row] = {}  # id(completion) -> the leader whose request made it

    def step(op: str) -> None:
        if op == "admit" and todo:
            row = todo.pop(0)
            match d.admit(row.key, row, row.sampling.n):
                case Lead(group):
                    if group is not None:
                        leading[id(row)] = group
                        assert group.leader is row
                    waiting.append(row)
                case Follow(group):
                    assert group.leader.job == row.job, "never across jobs"
                    assert group.key == row.key
                case Copy(c):
                    assert origin[id(c)].job == row.job, "never across jobs"
                    assert origin[id(c)].key == row.key and row.key.deterministic
                    got.setdefault(row.id, []).append((c, Kind.COPY))
        elif op == "start" and waiting:
            row = waiting.pop(0)
            group = leading.get(id(row))
            n = row.sampling.n
            if group is not None:
                d.started(group)
                n = group.n
                if not group.key.deterministic:
                    assert n == sum(group.ns) <= MAX_N and len(group.ns) == len(group.followers) + 1
            running.append((row, group, n))
        elif op in ("finish", "fail") and running:
            row, group, n = running.pop(0)
            c = engine(row.job, row.id, n) if op == "finish" else None
            if c is not None:
                origin[id(c)] = row
            shares = [c]
            if group is not None:
                assert n == group.n, "a started merge takes no more members"
                followers = d.finish(group, c)
                leading.pop(id(row))
                if c is None:
                    todo[:0] = followers  # they run on their own
                else:
                    shares = [c] * (len(followers) + 1) if group.key.deterministic else split_completion(c, group.ns)
                    for f, share in zip(followers, shares[1:], strict=True):
                        if group.key.deterministic:
                            assert share is c, "a deterministic follower gets its leader's completion"
                        origin[id(share)] = row
                        got.setdefault(f.id, []).append((share, group.kind))
            if c is not None:
                origin[id(shares[0])] = row
                got.setdefault(row.id, []).append((shares[0], Kind.OWN))
            else:
                todo.insert(0, row)  # an error: retried (as the worker requeues or re-publishes)
        elif op == "die":
            back = d.abandon_all() + [r for r, _, _ in running] + waiting
            running.clear()
            waiting.clear()
            leading.clear()
            todo[:0] = back
        assert d.followers <= max_followers, "the bound on followers holds"
        assert d.followers == sum(len(g.followers) for g in d.waiting.values())

    for op in ops:
        step(op)
    # Drain: run everything to the end.
    while todo or waiting or running:
        for op in ("admit", "start", "finish"):
            step(op)
    assert sorted(got) == [r.id for r in rows], "every row once"
    for row in rows:
        ((c, kind),) = got[row.id]
        leader = origin[id(c)]
        assert leader.job == row.job and leader.key == row.key, "a completion of its own request, job included"
        texts = c.outputs or [c.output]
        assert len(texts) == row.sampling.n, "as many completions as it asked for"
        if kind == Kind.MERGED:
            assert not row.key.deterministic
    # Each sampled completion text went to one row only (merged rows each get their own).
    sampled = [t for r in rows if r.key is not None and not r.key.deterministic
               for t in (got[r.id][0][0].outputs or [got[r.id][0][0].output])]
    assert len(sampled) == len(set(sampled))
    assert len(d.recent) <= recent_entries


def test_keys_tell_requests_apart():
    t = tk.pack([1, 2, 3])
    greedy = m.SamplingSpec(temperature=0)
    assert request_key("j", t, "", greedy, 1) == request_key("j", t, "", greedy, 2)
    assert request_key("j", t, "", greedy, 1).deterministic
    assert request_key("j", t, "", greedy, 1) != request_key("k", t, "", greedy, 1), "never across jobs"
    assert request_key("j", t, "", greedy, 1) != request_key("j", t, "lora1", greedy, 1), "adapter"
    assert request_key("j", t, "", greedy, 1) != request_key("j", tk.pack([1, 2]), "", greedy, 1), "tokens"
    json_out = m.SamplingSpec(temperature=0, structured=m.StructuredSpec(json_object=True))
    assert request_key("j", t, "", greedy, 1) != request_key("j", t, "", json_out, 1), "structured output"
    # Greedy: the seed does not matter. Seeded: each row's own seed (seed + id) is its request.
    assert request_key("j", t, "", m.SamplingSpec(temperature=0, seed=3), 1) == request_key("j", t, "", greedy, 1)
    seeded = m.SamplingSpec(seed=3)
    assert request_key("j", t, "", seeded, 1) != request_key("j", t, "", seeded, 2)
    assert request_key("j", t, "", seeded, 1).deterministic
    # Sampled: n is left out (a merge sums it); logprobs are never merged.
    sampled = request_key("j", t, "", m.SamplingSpec(), 1)
    assert not sampled.deterministic and sampled == request_key("j", t, "", m.SamplingSpec(n=4), 9)
    assert request_key("j", t, "", m.SamplingSpec(logprobs=2), 1) is None
    assert request_key("j", t, "", m.SamplingSpec(), 1, task="embed").deterministic


def test_a_merge_is_bounded_by_max_n_and_closes_when_started():
    d: Deduper[int] = Deduper()
    key = request_key("j", tk.pack([1]), "", m.SamplingSpec(n=60), 0)
    first = d.admit(key, 0, 60)
    assert isinstance(first, Lead)
    assert isinstance(d.admit(key, 1, 4), Follow) and first.group.n == 64
    assert isinstance(over := d.admit(key, 2, 1), Lead) and over.group is not first.group
    d.started(over.group)
    assert isinstance(d.admit(key, 3, 1), Lead), "a merge in the engine takes no more members"


def test_recent_completions_are_bounded_by_entries_and_bytes():
    r = Recent(entries=3, max_bytes=10_000, size=lambda c: len(c.output))
    keys = [request_key("j", tk.pack([i]), "", m.SamplingSpec(temperature=0), 0) for i in range(5)]
    for i, k in enumerate(keys):
        r.put(k, Completion("x" * 4000, FinishReason.STOP, 1, 0, 1))
        assert len(r) <= 3 and r.nbytes <= 10_000
    assert r.get(keys[0]) is None and r.get(keys[4]) is not None
    r.put(keys[0], Completion("x" * 20_000, FinishReason.STOP, 1, 0, 1))
    assert r.get(keys[0]) is None, "one past the byte bound alone is not kept"


def test_split_refuses_a_short_merge():
    with pytest.raises(ValueError):
        split_completion(engine("j", 0, 2), [1, 2])


def test_the_echo_engine_gives_n_distinct_sampled_completions():
    from prefixflow.services.engine_worker.engines.echo import echo_completion

    sampled = echo_completion([5, 6, 7, 8], m.SamplingSpec(max_tokens=3, n=3))
    assert len(set(sampled.outputs)) == 3 and sampled.output == sampled.outputs[0]
    assert sampled.output_counts == [3, 3, 3] and sampled.output_tokens == 9 and len(sampled.finish_reasons) == 3
    greedy = echo_completion([5, 6, 7, 8], m.SamplingSpec(max_tokens=3, n=3, temperature=0))
    assert len(set(greedy.outputs)) == 1
    rows = split_completion(sampled, [1, 2])
    assert [r.output for r in rows] == sampled.outputs[:2] and rows[1].outputs == sampled.outputs[1:]
    assert [r.output_tokens for r in rows] == [3, 6]


def test_a_batch_engine_worker_generates_each_request_once():
    """The worker's batch path (`run_batch`, the instant echo engine) with dedupe: one
    engine request per distinct request; copies and merged rows under their own leases."""
    import asyncio

    from prefixflow.services.engine_worker.engines.echo import InstantEchoEngine
    from prefixflow.services.engine_worker.feeder import Held
    from prefixflow.services.engine_worker.service import EngineWorker

    class Worker(EngineWorker):
        def __init__(self) -> None:  # no NATS: what run_batch and the fan-out read
            self.engine = InstantEchoEngine()
            self.generate_batch = self.engine.generate_batch
            self.dedupe, self.leading, self.in_engine = Deduper(), {}, {}
            self.deduplicated = self.merged = 0
            self.rows: dict = {}
            self.asked: list[int] = []

        async def finish(self, lease, prompt, c=None, error=None, *, bucket="", started_at=0.0, dedupe=Kind.OWN):
            assert prompt.id not in self.rows and lease == f"lease-{prompt.id}"
            self.rows[prompt.id] = (c, error, dedupe)

    worker = Worker()
    real = worker.generate_batch

    async def counted(prompts):
        worker.asked += [s.n for _, s in prompts]
        return await real(prompts)

    worker.generate_batch = counted
    spec = m.JobSpec(job="j", out_dir="o", sampling=m.SamplingSpec(max_tokens=3))
    greedy = m.encode(m.SamplingSpec(max_tokens=3, temperature=0))
    texts = [[1, 2, 3], [1, 2, 3], [4, 5, 6], [1, 2, 3], [4, 5, 6], [7, 8, 9]]
    prompts = [m.Prompt("j", i, tk.pack(t), sampling=greedy if i < 3 else b"") for i, t in enumerate(texts)]
    held = [Held(f"lease-{p.id}", p, m.JobLookup(spec), "b") for p in prompts]
    asyncio.run(worker.run_batch(asyncio.run(worker.admit(held, attach=False))))
    assert sorted(worker.rows) == list(range(6)) and all(e is None for _, e, _ in worker.rows.values())
    # greedy [1,2,3] x2 (one copy), greedy [4,5,6]; sampled [1,2,3] alone, [4,5,6] alone, [7,8,9] alone
    assert [k for _, _, k in worker.rows.values()].count(Kind.COPY) == 1 and worker.deduplicated == 1
    assert worker.rows[1][0].output == worker.rows[0][0].output
    assert len(worker.asked) == 5

    again = [Held(f"lease-{i}", m.Prompt("j", i, tk.pack(t)), m.JobLookup(spec), "b")
             for i, t in [(14, [1, 2, 3]), (15, [4, 5, 6]), (20, [4, 5, 6]), (21, [4, 5, 6])]]
    asyncio.run(worker.run_batch(asyncio.run(worker.admit(again, attach=False))))
    # sampled [1,2,3] alone; sampled [4,5,6] x3 merged into one request of n=3
    assert worker.asked[5:] == [1, 3] and worker.merged == 2
    outs = {worker.rows[i][0].output for i in (15, 20, 21)}
    assert len(outs) == 3, "each merged row has its own completion"

