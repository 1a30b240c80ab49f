"""One job-id grammar on every path (issue 39, item 5): `subjects.job_id_error` is the rule
the CLI refuses with, and every service that reads a job id from a subject or a body
checks it there: an invalid one is dead-lettered with that reason, never looked up (the
key-value bucket would raise), never a crash."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.kv import VALID_KEY_RE

from prefixflow.services.bucketer.service import Bucketer
from prefixflow.services.engine_worker.service import EngineWorker
from prefixflow.services.ingestor.plan import Incoming, Model, plan_batch, poison_rows
from prefixflow.services.sink import queries
from prefixflow.services.sink.lifecycle import Reconciler
from prefixflow.shared.bus.jobs import JobCache
from prefixflow.shared.bus.ledger import AckLedger
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects
from prefixflow.shared.wire.permissions import matches
from tests.unit import fakes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
names = st.from_regex(NAME, fullmatch=True)
valid_ids = names | st.tuples(names.filter(lambda t: t != "dir"), names).map(".".join)
invalid_ids = st.one_of(
    st.tuples(names, st.sampled_from(":/=*>#\u00e9"), names).map("".join),  # a character outside the alphabet
    st.tuples(names, names, names).map(".".join),  # more than one '.'
    names.map("dir.".__add__),  # the reserved tenant
    st.from_regex(r"[a-z]{65,80}", fullmatch=True),  # too long
)
any_ids = valid_ids | invalid_ids | st.text(alphabet="ab-_.:*> \t/=\u00e9", max_size=70) | st.text(max_size=80)

BAD = "bad:job"
WHY = f"invalid job id 'bad:job': it contains ':'; use letters, digits, '-' and '_' ({subjects.JOB_ID_RULE})"


def in_grammar(job: str) -> bool:
    """The grammar, written out again: NAME, or TENANT.NAME with a tenant other than `dir`."""
    parts = job.split(".")
    return (len(parts) == 1 or (len(parts) == 2 and parts[0] != "dir")) and all(NAME.fullmatch(p) for p in parts)


@given(any_ids)
def test_one_grammar_and_every_valid_id_is_a_key_and_round_trips_through_its_subjects(job):
    why = subjects.job_id_error(job)
    assert (why is None) == in_grammar(job), (job, why)
    if why is not None:
        assert why.startswith(f"invalid job id {job!r}: ") and why.endswith(f"({subjects.JOB_ID_RULE})")
        return
    assert VALID_KEY_RE.match(job), "a valid id is a valid key-value key (never InvalidKeyError)"
    assert subjects.job_from_subject(subjects.ingest(job)) == subjects.origin_and_job(subjects.results("r0", job))[1] == job
    assert subjects.job_of_done_query(subjects.done_query(job)) == job
    assert subjects.job_of_cancel(subjects.job_cancelled(job)) == job
    assert matches(subjects.ALL_JOB_CANCELLED, subjects.job_cancelled(job))
    assert subjects.bucket_parts(subjects.bucket("n1", job)) == ("n1", job)


def test_the_cli_refuses_with_the_same_words(capsys):
    from prefixflow.client.lifecycle import cmd_cancel

    with pytest.raises(SystemExit) as exc:  # before connecting to anything
        cmd_cancel(SimpleNamespace(job=BAD, nats="nats://127.0.0.1:1", no_wait=False, timeout=1.0))
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {WHY}"


# --- the ingestor ---------------------------------------------------------------------

MODEL = Model(encode_batch=lambda texts: [[ord(c) % 100 for c in t] for t in texts], vocab_size=100,
              max_model_len=64, hash_block_size=4)


@given(invalid_ids)
def test_the_ingest_plan_dead_letters_a_raw_message_of_an_invalid_job_id(job):
    spec = m.JobSpec(job="ok", out_dir="/tmp/x", sampling=m.SamplingSpec(max_tokens=4))
    batch = [Incoming(f"pfx.ingest.{job}", json.dumps({"id": 1, "prompt": "hi"}).encode()),
             Incoming("pfx.ingest.ok", json.dumps({"id": 1, "prompt": "hi"}).encode())]
    # Only valid ids are looked up (the service skips the others): the plan needs no lookup.
    plan = plan_batch(batch, {"ok": m.JobLookup(spec)}, MODEL, lambda key: "n0")
    assert plan.dead == {0: subjects.job_id_error(job)}
    assert not plan.failed_jobs and not plan.errors and [p.job for p in plan.prompts["n0"]] == ["ok"]
    assert poison_rows(batch[0], "poison") == [], "no error rows for a job that cannot exist"


def test_the_job_cache_never_looks_up_an_invalid_id():
    class KV:
        async def get(self, key):
            raise AssertionError(f"looked up {key!r}")

    lookup = asyncio.run(JobCache(KV()).get(BAD))
    assert lookup.spec is None and not lookup.exists and lookup.error == WHY


# --- the bucketer and the engine-worker -----------------------------------------------


def test_the_bucketer_dead_letters_a_bucket_message_of_an_invalid_job_id():
    js = fakes.FakeJS()
    msg = fakes.FakeMsg(b"anything", subject=subjects.bucket("n1", BAD), stream="PFX_BUCKET")
    asyncio.run(Bucketer.take(SimpleNamespace(js=js), msg, 0.0))
    assert msg.calls == ["term"]
    [(subject, _, headers)] = js.published
    assert subject == subjects.dead(msg.subject) and headers["Pfx-Error"] == WHY


def test_the_bucketer_dead_letters_prompts_of_another_job_than_their_subject():
    js, ledger = fakes.FakeJS(), AckLedger()
    p = m.Prompt("other", 1, b"", b"", 4)
    msg = fakes.FakeMsg(m.encode(m.PromptBatch([p])), subject=subjects.bucket("n1", "mine"), stream="PFX_BUCKET")
    asyncio.run(Bucketer.take(SimpleNamespace(js=js, ledger=ledger, poisoned=None), msg, 0.0))
    assert msg.calls == ["term"] and 1 not in ledger
    assert "prompts of job 'other' on 'pfx.bucket.n1.mine'" in js.published[0][2]["Pfx-Error"]


def test_the_engine_worker_runs_none_of_a_work_batch_s_invalid_job_ids_and_dead_letters_them():
    js, ledger = fakes.FakeJS(), AckLedger()
    work = m.WorkBatch("b1", [m.Prompt("ok", 1, b"", b"", 4), m.Prompt(BAD, 2, b"", b"", 4),
                              m.Prompt("ok", 3, b"", b"", 4)], strikes=[0, 1, 2])
    msg = fakes.FakeMsg(m.encode(work))
    lease = ledger.hold(1, msg, 3)
    worker = SimpleNamespace(js=js, ledger=ledger)
    left = asyncio.run(EngineWorker.refuse_invalid_jobs(worker, work, lease))
    assert [p.id for p in left.prompts] == [1, 3] and left.strikes == [0, 2]
    assert lease.remaining == 2 and msg.calls == [], "the rest of the batch still runs"
    [(subject, data, headers)] = js.published
    assert subject == subjects.dead(msg.subject) and headers["Pfx-Error"] == WHY
    assert [p.id for p in m.work_batch_decoder.decode(data).prompts] == [2]
    only_bad = m.WorkBatch("b2", [m.Prompt(BAD, 2, b"", b"", 4)])
    lease2 = ledger.hold(2, fakes.FakeMsg(m.encode(only_bad), seq=2), 1)
    assert asyncio.run(EngineWorker.refuse_invalid_jobs(worker, only_bad, lease2)) is None
    assert lease2.msg.calls == ["ack"], "settled: nothing of it runs"


# --- the sink -------------------------------------------------------------------------


def test_a_done_query_for_an_invalid_job_id_gets_an_error_reply():
    reply = asyncio.run(queries.reply_for(SimpleNamespace(), BAD, m.encode(m.DoneQuery([1]))))
    assert reply.error == WHY and reply.done == []


def test_the_sink_dead_letters_results_of_an_invalid_job_id():
    from prefixflow.services.sink.service import Sink

    js = fakes.FakeJS()
    msg = fakes.FakeMsg(m.encode(m.ResultBatch(BAD, [m.Result(1)])), subject=subjects.results("r0", BAD), stream="PFX_RESULTS")
    asyncio.run(Sink.take(SimpleNamespace(js=js), msg))
    assert msg.calls == ["term"]
    [(subject, _, headers)] = js.published
    assert subject == subjects.dead(msg.subject) and headers["Pfx-Error"] == WHY


def test_the_sink_s_jobs_watch_skips_a_key_outside_the_grammar():
    rec = Reconciler()
    spec = msgspec.json.encode(m.JobSpec(job="a=b", out_dir="/x", total=1))
    assert rec.note("a=b", spec, None) is None and "a=b" not in rec
    assert rec.note("ok", msgspec.json.encode(m.JobSpec(job="ok", out_dir="/x", total=1)), None) == "ok"


def test_a_spec_lookup_waiting_for_nats_ends_when_the_service_stops():
    """NATS away: the lookup waits for it (never an unknown job, never fatal) until the
    service is told to stop; then it ends at once with NATS's own error (a transport
    fault: nothing acked), so a SIGTERM with NATS gone does not hold the shutdown for good
    (two sinks were seen waiting 45 minutes)."""
    import nats.errors

    from prefixflow.shared.bus.connection import SHUTDOWN

    class Away:
        calls = 0

        async def get(self, key):
            Away.calls += 1
            raise nats.errors.TimeoutError

    async def main():
        stop = asyncio.Event()
        SHUTDOWN.set(stop)
        lookup = asyncio.ensure_future(JobCache(Away()).get("job-1"))
        await asyncio.sleep(0.5)
        assert not lookup.done() and Away.calls >= 3, "it waits while the service runs"
        stop.set()
        with pytest.raises(nats.errors.TimeoutError):
            await asyncio.wait_for(lookup, 3.0)

    asyncio.run(main())
