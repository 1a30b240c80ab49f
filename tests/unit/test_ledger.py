"""prefixflow.shared.bus.ledger: inputs acked once all their outputs are done, handed back otherwise."""

from __future__ import annotations

import asyncio

import pytest

from prefixflow.shared.bus.ledger import AckLedger

pytestmark = pytest.mark.unit


class FakeMsg:
    def __init__(self, fail: bool = False) -> None:
        self.acks = 0
        self.naks: list[float | None] = []
        self.in_progress_calls = 0
        self.fail = fail

    async def ack(self) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.acks += 1

    async def nak(self, delay: float | None = None) -> None:
        if self.fail:
            raise ConnectionError("gone")
        self.naks.append(delay)


def run(coro):
    return asyncio.run(coro)


def test_acked_once_every_output_is_done():
    ledger, msg = AckLedger(), FakeMsg()
    lease = ledger.hold(7, msg, 3)
    assert lease is not None and 7 in ledger and len(ledger) == 1
    assert run(ledger.done(lease)) is False
    assert run(ledger.done(lease, 2)) is True
    assert msg.acks == 1 and 7 not in ledger and len(ledger) == 0
    assert run(ledger.done(lease)) is False and msg.acks == 1, "done after the ack is a no-op"


def test_zero_outputs_ack_at_once():
    ledger, msg = AckLedger(), FakeMsg()
    assert run(ledger.done(ledger.hold(1, msg, 0), 0)) is True and msg.acks == 1


def test_a_redelivery_of_a_held_message_is_not_held_twice():
    ledger = AckLedger()
    assert ledger.hold(7, FakeMsg(), 2) is not None
    assert ledger.hold(7, FakeMsg(), 2) is None
    assert len(ledger) == 1


def test_hand_back_naks_held_messages_only():
    ledger = AckLedger()
    a, b, c = FakeMsg(), FakeMsg(), FakeMsg()
    la, lb = ledger.hold(1, a, 1), ledger.hold(2, b, 1)
    ledger.hold(3, c, 1)
    run(ledger.done(la))
    assert run(ledger.hand_back([la, lb], delay=1.0)) == 1
    assert a.naks == [] and b.naks == [1.0] and c.naks == []
    assert run(ledger.hand_back()) == 1 and c.naks == [None]
    assert len(ledger) == 0


def test_outputs_of_a_handed_back_delivery_cannot_ack_its_redelivery():
    """After a hand-back the message comes back and is held again; late outputs of the
    first delivery count against the released lease, not the new one."""
    ledger = AckLedger()
    first, again = FakeMsg(), FakeMsg()
    old = ledger.hold(5, first, 2)
    run(ledger.hand_back([old]))
    new = ledger.hold(5, again, 2)
    assert new is not None
    assert run(ledger.done(old, 2)) is False
    assert again.acks == 0 and 5 in ledger
    run(ledger.done(new, 2))
    assert again.acks == 1 and first.acks == 0


def test_messages_are_those_held():
    ledger = AckLedger()
    a, b = FakeMsg(), FakeMsg()
    la = ledger.hold(1, a, 1)
    ledger.hold(2, b, 1)
    assert ledger.messages() == [a, b]
    run(ledger.done(la))
    assert ledger.messages() == [b]


def test_failed_acks_and_naks_are_logged_not_raised():
    ledger = AckLedger()
    lease = ledger.hold(1, FakeMsg(fail=True), 1)
    assert run(ledger.done(lease)) is True and len(ledger) == 0
    ledger.hold(2, FakeMsg(fail=True), 1)
    assert run(ledger.hand_back()) == 1 and len(ledger) == 0
