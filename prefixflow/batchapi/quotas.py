"""Per-tenant quotas of the batch API: what each tenant may hold, and the accounting of
what it holds (a pure `Ledger`: no I/O, driven by the API and the store).

Four limits per tenant (`Limits`; 0: no limit):

- `stored_bytes`: bytes of the tenant's files: uploads and the output and error files of
  its batches. An upload is refused (507, `storage_quota_exceeded`) when it would pass
  it: at once for a `Content-Length` over what is left, as soon as a streamed body
  passes what is left otherwise. A batch's output is never refused (its requests ran):
  it counts, and the tenant's next upload waits for deletes.
- `open_batches`: batches not in a final state (`validating` .. `finalizing`).
- `queued_rows`: requests (input lines) in the tenant's open batches.
- `concurrent_jobs`: open batches whose job runs or is about to (every open batch but
  a `finalizing` one, whose job has ended).

The last three are checked at `batches.create` (429, `rate_limit_exceeded`). An upload
in flight holds a reservation of the bytes it may still write, so two uploads at once
cannot both take the last of the quota. Every check-and-take is one synchronous call,
so within the API's event loop no other request comes between (one API process per
fleet: README).

The limits come from a quota file (TOML, `--quotas-file`), per tenant, with defaults from
`--quota-*` (`PFX_QUOTA_*`) for tenants the file does not name:

    [defaults]              # optional: overrides the --quota-* defaults
    open_batches = 10

    [tenants.alice]
    stored_bytes = 10_000_000_000
    queued_rows = 200_000

The file is validated at start (unknown keys, negative or non-integer values, a bad
tenant name: the API does not start) and read again when it changes (a bad edit then
keeps the limits in force and logs why).
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from prefixflow.batchapi.batches import TERMINAL
from prefixflow.shared.wire.subjects import name_problem

Count = Annotated[int, msgspec.Meta(ge=0)]

QUOTAS = ("stored_bytes", "open_batches", "queued_rows", "concurrent_jobs")
"""The limits, in the order they are checked and listed."""


class Limits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A tenant's limits (0: none)."""

    stored_bytes: Count = 0
    """Bytes of its files (uploads, batch outputs and error files)."""
    open_batches: Count = 0
    """Batches not in a final state."""
    queued_rows: Count = 0
    """Requests (input lines) in its open batches."""
    concurrent_jobs: Count = 0
    """Open batches whose job runs or will (not yet `finalizing`)."""


class Overrides(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A quota file's section: the limits it sets (the others come from the defaults)."""

    stored_bytes: Count | None = None
    open_batches: Count | None = None
    queued_rows: Count | None = None
    concurrent_jobs: Count | None = None

    def over(self, base: Limits) -> Limits:
        given = {k: v for k in QUOTAS if (v := getattr(self, k)) is not None}
        return msgspec.structs.replace(base, **given)


class QuotaFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    defaults: Overrides = Overrides()
    tenants: dict[str, Overrides] = {}


class QuotaTable:
    """Each tenant's limits: the file's section for it over the defaults."""

    def __init__(self, defaults: Limits, text: str = "", name: str = "quota file") -> None:
        parsed = parse_quota_file(text, name) if text else QuotaFile()
        self.defaults = parsed.defaults.over(defaults)
        self.tenants = {t: o.over(self.defaults) for t, o in parsed.tenants.items()}

    def __call__(self, tenant: str) -> Limits:
        return self.tenants.get(tenant, self.defaults)


def parse_quota_file(text: str, name: str = "quota file") -> QuotaFile:
    """A quota file's text, validated (ValueError naming the file and the problem)."""
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{name}: not TOML: {exc}") from None
    try:
        parsed = msgspec.convert(raw, QuotaFile, strict=True)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{name}: {exc} (keys: {', '.join(QUOTAS)}; each a whole number >= 0, 0: no limit)") from None
    for tenant in parsed.tenants:
        if (problem := name_problem(tenant)) is not None:
            raise ValueError(f"{name}: tenant {tenant!r}: {problem} (letters, digits, '-' and '_')")
    return parsed


class Exceeded(Exception):
    """A request would take a tenant past one of its limits."""

    def __init__(self, quota: str, limit: int, used: int, asked: int) -> None:
        what = {"stored_bytes": "bytes stored", "open_batches": "open batches", "queued_rows":
                "requests in open batches", "concurrent_jobs": "concurrent jobs"}[quota]
        super().__init__(f"quota {quota} exceeded: {used} {what} in use, this request asks {asked} more, the "
                         f"tenant's limit is {limit} (docs/quotas.md)")
        self.quota, self.limit, self.used, self.asked = quota, limit, used, asked

    @property
    def storage(self) -> bool:
        return self.quota == "stored_bytes"


@dataclass
class Open:
    """An open batch as the ledger counts it."""

    rows: int
    status: str


@dataclass
class Usage:
    """What one tenant holds."""

    stored_bytes: int = 0
    reserved_bytes: int = 0
    """Bytes uploads in flight may still write."""
    open: dict[str, Open] = field(default_factory=dict)
    """Its open batches (bounded by `open_batches`; unbounded for a tenant without that limit)."""

    @property
    def queued_rows(self) -> int:
        return sum(b.rows for b in self.open.values())

    @property
    def jobs(self) -> int:
        return sum(b.status != "finalizing" for b in self.open.values())


def _check(quota: str, limit: int, used: int, asked: int) -> None:
    if limit and used + asked > limit:
        raise Exceeded(quota, limit, used, asked)


class Ledger:
    """Every tenant's usage, against `limits(tenant)`. Bytes stored change by
    `stored`/`freed` (each file once: the store calls them when a record is written
    or deleted); uploads take a reservation first (`reserve`/`release`); batches are
    admitted (`admit`) and followed (`observe`) until final."""

    def __init__(self, limits: Callable[[str], Limits]) -> None:
        self.limits = limits
        self.tenants: dict[str, Usage] = {}

    def usage(self, tenant: str) -> Usage:
        return self.tenants.setdefault(tenant, Usage())

    # --- bytes ---------------------------------------------------------------------

    def room(self, tenant: str) -> int | None:
        """Bytes the tenant may still upload (None: no limit)."""
        limit, u = self.limits(tenant).stored_bytes, self.usage(tenant)
        return max(limit - u.stored_bytes - u.reserved_bytes, 0) if limit else None

    def reserve(self, tenant: str, wanted: int, at_least: int = 1) -> int:
        """Reserve up to `wanted` bytes for an upload (`at_least`: what it surely needs,
        e.g. its `Content-Length`): the bytes reserved, which the upload may not pass.
        Raises Exceeded when fewer than `at_least` are left."""
        room = self.room(tenant)
        if room is not None:
            u = self.usage(tenant)
            _check("stored_bytes", self.limits(tenant).stored_bytes, u.stored_bytes + u.reserved_bytes, at_least)
            wanted = min(wanted, room)
        self.usage(tenant).reserved_bytes += wanted
        return wanted

    def release(self, tenant: str, reserved: int) -> None:
        u = self.usage(tenant)
        u.reserved_bytes = max(u.reserved_bytes - reserved, 0)

    def stored(self, tenant: str, size: int) -> None:
        self.usage(tenant).stored_bytes += size

    def freed(self, tenant: str, size: int) -> None:
        u = self.usage(tenant)
        u.stored_bytes = max(u.stored_bytes - size, 0)

    # --- batches -------------------------------------------------------------------

    def admit(self, tenant: str, bid: str, rows: int) -> None:
        """Take a new batch of `rows` requests (Exceeded: refused, nothing taken)."""
        limits, u = self.limits(tenant), self.usage(tenant)
        _check("open_batches", limits.open_batches, len(u.open), 1)
        _check("queued_rows", limits.queued_rows, u.queued_rows, rows)
        _check("concurrent_jobs", limits.concurrent_jobs, u.jobs, 1)
        u.open[bid] = Open(rows, "validating")

    def observe(self, tenant: str, bid: str, status: str, rows: int = 0) -> None:
        """A batch's record as it now stands (a final one leaves the ledger; an open one
        not yet counted, e.g. at start, is counted whatever the limits: it exists)."""
        u = self.usage(tenant)
        if status in TERMINAL:
            u.open.pop(bid, None)
        elif bid in u.open:
            u.open[bid].status = status
        else:
            u.open[bid] = Open(rows, status)

    def forget(self, tenant: str, bid: str) -> None:
        """A batch that was admitted but never written (its create failed)."""
        self.usage(tenant).open.pop(bid, None)

    def report(self, tenant: str) -> dict[str, dict[str, int]]:
        """{quota: {used, limit}} (limit 0: none), as `GET /v1/quota` answers."""
        limits, u = self.limits(tenant), self.usage(tenant)
        used = {"stored_bytes": u.stored_bytes, "open_batches": len(u.open), "queued_rows": u.queued_rows,
                "concurrent_jobs": u.jobs}
        return {q: {"used": used[q], "limit": getattr(limits, q)} for q in QUOTAS}
