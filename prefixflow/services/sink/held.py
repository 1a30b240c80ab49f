"""Messages the sink holds: their rows are queued for their job's next part, and each
is settled (acked, or terminated if dead-lettered already) once those rows are on disk
or its job failed."""

from __future__ import annotations

from typing import NamedTuple

from nats.aio.msg import Msg


class Held(NamedTuple):
    """A message whose rows are queued, settled once its job's part is on disk."""

    msg: Msg
    poison: bool
    """Dead-lettered already: terminated, not acked (and still nak'd if the write fails)."""

    def settle(self):
        """End the message: its rows are on disk, or its job failed (the coroutine to await)."""
        return self.msg.term() if self.poison else self.msg.ack()
