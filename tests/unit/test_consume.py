"""prefixflow.shared.bus.consume: the one consume protocol (decode → quarantine → ledger → hold → poison)."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.shared.bus import consume
from prefixflow.shared.bus.ledger import AckLedger
from prefixflow.shared.bus.poison import POISON_AFTER
from prefixflow.shared.wire import messages as m
from tests.unit.fakes import FakeMsg

pytestmark = pytest.mark.unit


def work(n: int) -> bytes:
    return m.encode(m.WorkBatch("b", [m.Prompt("j", i, b"\x00\x00\x00\x01", max_tokens=1) for i in range(n)], [1]))


def run(msg, ledger, poisoned, monkeypatch):
    quarantined: list[str] = []

    async def quarantine(js, msg, reason, rows=()):
        quarantined.append(reason)
        await msg.term()

    monkeypatch.setattr(consume, "quarantine", quarantine)

    async def on_poison(body, lease):
        poisoned.append((len(body.prompts), lease))

    got = asyncio.run(consume.receive(None, msg, m.work_batch_decoder, "work batch", ledger=ledger,
                                      count=lambda w: len(w.prompts), on_poison=on_poison))
    return got, quarantined


@pytest.mark.parametrize("payload", [b"\xff\x00garbage", m.encode(m.PromptBatch([]))[:1], b""])
def test_an_undecodable_message_is_quarantined_never_held(payload, monkeypatch):
    ledger, poisoned = AckLedger(), []
    msg = FakeMsg(payload)
    got, quarantined = run(msg, ledger, poisoned, monkeypatch)
    assert got is None and msg.calls == ["term"] and len(ledger) == 0 and not poisoned
    assert quarantined and quarantined[0].startswith("undecodable work batch")


def test_a_fresh_message_is_held_until_its_outputs_are_done(monkeypatch):
    ledger, poisoned = AckLedger(), []
    msg = FakeMsg(work(3), seq=9)
    got, _ = run(msg, ledger, poisoned, monkeypatch)
    assert got is not None and len(got.body.prompts) == 3 and 9 in ledger and msg.calls == []
    assert not asyncio.run(ledger.done(got.lease, 2)) and asyncio.run(ledger.done(got.lease, 1))
    assert msg.calls == ["ack"] and len(ledger) == 0


def test_a_redelivered_copy_of_a_held_message_is_skipped(monkeypatch):
    ledger, poisoned = AckLedger(), []
    first, again = FakeMsg(work(2), seq=4), FakeMsg(work(2), seq=4, delivered=2)
    assert run(first, ledger, poisoned, monkeypatch)[0] is not None
    assert run(again, ledger, poisoned, monkeypatch)[0] is None
    assert again.calls == [] and len(ledger) == 1, "the first copy still holds it; the copy is left alone"


def test_an_empty_message_is_acked_at_once(monkeypatch):
    ledger, poisoned = AckLedger(), []
    msg = FakeMsg(work(0))
    assert run(msg, ledger, poisoned, monkeypatch)[0] is None
    assert msg.calls == ["ack"] and len(ledger) == 0


@pytest.mark.parametrize("delivered", [POISON_AFTER, POISON_AFTER + 1, POISON_AFTER + 4])
def test_only_a_message_past_the_limit_goes_to_the_poison_path(delivered, monkeypatch):
    ledger, poisoned = AckLedger(), []
    msg = FakeMsg(work(2), delivered=delivered)
    got, _ = run(msg, ledger, poisoned, monkeypatch)
    if delivered > POISON_AFTER:
        assert got is None and len(poisoned) == 1 and poisoned[0][0] == 2
        assert ledger.active(poisoned[0][1]), "the poison path ends the lease itself"
    else:
        assert got is not None and not poisoned


def test_quarantine_held_releases_the_lease_even_when_the_quarantine_fails(monkeypatch):
    ledger = AckLedger()
    msg = FakeMsg(work(1))
    lease = ledger.hold(1, msg, 1)

    async def broken(js, msg, reason, rows=(), *, origin=""):
        raise RuntimeError("no stream")

    monkeypatch.setattr(consume, "quarantine", broken)
    with pytest.raises(RuntimeError):
        asyncio.run(consume.quarantine_held(None, ledger, lease, "why"))
    assert len(ledger) == 0 and msg.calls == []
