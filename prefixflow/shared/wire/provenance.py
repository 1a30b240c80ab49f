"""Result provenance: who may answer which prompt (pure logic, no I/O).

A result travels on `pfx.results.<origin>.<job>` (`subjects.results`). Its origin is the
replica that computed it, or one of the services that write error rows (`SERVICE_ORIGINS`:
the ingestor's invalid rows, the bucketer's quarantined prompts). On a fleet every
process has its own NATS user, and the grants (`permissions.py`) let each publish results
under its own origin only: a replica cannot pose as another one, nor as a service.

That alone would still let a replica answer prompts of any job, its own origin named
truthfully. So each prompt carries a grant: an HMAC of (job, id, replica) under a key
that only the stages that assign work hold (the bucketer, which routes a prompt to a
replica, and the router, which moves a dead replica's work to another) and the sink,
which checks it (`PFX_RESULT_KEY`; `prefixflow cluster config` writes it into those
three users' env files only). The replica copies the grant into its result, and the sink
writes a replica's result only when its grant matches (job, id, the subject's origin):
the replica held that prompt's assignment. Reassignments carry their own grant (the router
signs the moved prompts for their new replica), and a replica's re-publish of its own
suspect work keeps the grant it has, for the same replica. A refused result is not
written and counts nothing; the row stays open for the replica that holds its
assignment.

Without a key (a local cluster: `prefixflow run` makes one per run, `honcho start`
takes `PFX_RESULT_KEY` from `.env` or runs without) grants are neither made nor checked;
the origin still must match the row's `replica`.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac

import msgspec

from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.subjects import ORIGIN_BUCKETER, ORIGIN_INGESTOR, SERVICE_ORIGINS

__all__ = ["ORIGIN_BUCKETER", "ORIGIN_INGESTOR", "grant", "parse_key", "refusal", "sign"]

GRANT_BYTES = 12
"""An HMAC-SHA256 cut to 96 bits: a forgery is one guess in 2^96 per try."""

KEY_MIN_BYTES = 16


def parse_key(text: str) -> bytes | None:
    """`PFX_RESULT_KEY` (hex, at least 16 bytes) -> the key; '' -> None (no grants)."""
    text = text.strip()
    if not text:
        return None
    try:
        key = binascii.unhexlify(text)
    except (binascii.Error, ValueError):
        raise ValueError("result_key must be hex (e.g. `python -c 'import secrets; print(secrets.token_hex(32))'`)") from None
    if len(key) < KEY_MIN_BYTES:
        raise ValueError(f"result_key is {len(key)} bytes: at least {KEY_MIN_BYTES} (32 hex digits)")
    return key


def grant(key: bytes, job: str, id: m.PromptId, replica: str) -> bytes:
    """The proof that `replica` was assigned prompt `id` of `job`."""
    message = msgspec.msgpack.encode((job, id, replica))  # unambiguous: no separator to forge
    return hmac.new(key, message, hashlib.sha256).digest()[:GRANT_BYTES]


def sign(key: bytes | None, prompts: list[m.Prompt], replica: str) -> None:
    """Set each prompt's grant for `replica` (in place; nothing without a key)."""
    if key is None:
        return
    for p in prompts:
        p.grant = grant(key, p.job, p.id, replica)


def refusal(key: bytes | None, job: str, origin: str, result: m.Result) -> str | None:
    """Why the sink must not write `result` of `job`, published under `origin`; None: it may."""
    if origin in SERVICE_ORIGINS:
        return None  # only that service's user may publish under its origin
    if result.replica != origin:
        return f"result of {job}/{result.id} names replica {result.replica!r} but came from {origin!r}"
    if key is not None and not hmac.compare_digest(result.grant, grant(key, job, result.id, origin)):
        why = f"result of {job}/{result.id} from replica {origin!r}, which holds no assignment of it"
        if not result.grant:  # forged, or a stage that assigns work lacks the key: say which to check
            why += " (no grant: is PFX_RESULT_KEY set for every bucketer and the router?)"
        return why
    return None
