"""Per-tenant quotas of the batch API (issue 40, item 4), the pure parts: the ledger's
accounting against a model, the quota file, reloading files (keys, quotas) and cursor
pages."""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.batchapi.quotas import QUOTAS, Exceeded, Ledger, Limits, QuotaTable, parse_quota_file
from prefixflow.batchapi.store import new_id, page_of
from prefixflow.shared.api_keys import KeyRing
from prefixflow.shared.process.watched import Watched

pytestmark = pytest.mark.timeout(60)

STATUSES = ("validating", "in_progress", "cancelling", "finalizing", "completed", "failed", "cancelled", "expired")
OPS = st.one_of(
    st.tuples(st.just("upload"), st.sampled_from("ab"), st.integers(0, 60), st.integers(0, 60)),
    st.tuples(st.just("output"), st.sampled_from("ab"), st.integers(0, 30)),
    st.tuples(st.just("delete"), st.sampled_from("ab"), st.integers(0, 20)),
    st.tuples(st.just("create"), st.sampled_from("ab"), st.integers(0, 40)),
    st.tuples(st.just("step"), st.sampled_from("ab"), st.integers(0, 20), st.sampled_from(STATUSES)),
    st.tuples(st.just("reserve"), st.sampled_from("ab"), st.integers(1, 80)),
)


@given(limits=st.tuples(*[st.integers(0, 5 if q != "stored_bytes" and q != "queued_rows" else 150) for q in QUOTAS]),
       ops=st.lists(OPS, max_size=60))
def test_the_ledger_counts_what_each_tenant_holds_and_refuses_exactly_past_a_limit(limits, ops):
    """Against a model of each tenant's files and batches: every refusal is one the
    limits call for and takes nothing; every admission keeps the limits (bytes the API
    was not asked about, batch outputs, may pass them); tenant b's work never depends
    on tenant a's."""
    lim = Limits(*limits)
    ledger = Ledger(lambda t: lim if t == "a" else Limits())  # b: no limits at all
    files: dict[str, list[int]] = {"a": [], "b": []}
    batches: dict[str, dict[str, tuple[int, str]]] = {"a": {}, "b": {}}
    reserved: dict[str, list[int]] = {"a": [], "b": []}
    n = 0
    for op in ops:
        kind, t = op[0], op[1]
        used = sum(files[t]) + sum(reserved[t])
        open_ = batches[t]
        if kind == "upload":  # reserve, write `size` (at most what was reserved), release
            _, _, wanted, size = op
            room = lim.stored_bytes - used if t == "a" and lim.stored_bytes else None
            try:
                got = ledger.reserve(t, wanted, at_least=1)
            except Exceeded as exc:
                assert room is not None and room < 1 and exc.storage
                continue
            assert got == (wanted if room is None else min(wanted, room))
            if size <= got:
                ledger.stored(t, size)
                files[t].append(size)
            ledger.release(t, got)
        elif kind == "output":  # never refused
            ledger.stored(t, op[2])
            files[t].append(op[2])
        elif kind == "delete" and files[t]:
            ledger.freed(t, files[t].pop(op[2] % len(files[t])))
        elif kind == "create":
            rows, bid = op[2], f"batch_{n}"
            n += 1
            jobs = sum(s != "finalizing" for _, s in open_.values())
            over = t == "a" and ((lim.open_batches and len(open_) + 1 > lim.open_batches)
                                 or (lim.queued_rows and sum(r for r, _ in open_.values()) + rows > lim.queued_rows)
                                 or (lim.concurrent_jobs and jobs + 1 > lim.concurrent_jobs))
            try:
                ledger.admit(t, bid, rows)
            except Exceeded as exc:
                assert over and not exc.storage, (exc, open_)
                continue
            assert not over
            open_[bid] = (rows, "validating")
        elif kind == "step" and open_:
            bid = sorted(open_)[op[2] % len(open_)]
            ledger.observe(t, bid, op[3])
            if op[3] in ("completed", "failed", "cancelled", "expired"):
                del open_[bid]
            else:
                open_[bid] = (open_[bid][0], op[3])
        elif kind == "reserve":  # an upload in flight: its reservation stays
            try:
                reserved[t].append(ledger.reserve(t, op[2]))
            except Exceeded:
                assert t == "a" and lim.stored_bytes and lim.stored_bytes - used < 1
        for who in "ab":
            report = ledger.report(who)
            assert report["stored_bytes"]["used"] == sum(files[who])
            assert ledger.usage(who).reserved_bytes == sum(reserved[who])
            assert report["open_batches"]["used"] == len(batches[who])
            assert report["queued_rows"]["used"] == sum(r for r, _ in batches[who].values())
            assert report["concurrent_jobs"]["used"] == sum(s != "finalizing" for _, s in batches[who].values())
        if lim.open_batches:
            assert len(batches["a"]) <= lim.open_batches
        if lim.queued_rows:
            assert sum(r for r, _ in batches["a"].values()) <= lim.queued_rows
        if lim.stored_bytes and not any(o[0] == "output" for o in ops):
            assert sum(files["a"]) + sum(reserved["a"]) <= lim.stored_bytes


def test_a_refusal_says_which_quota_and_how_much():
    ledger = Ledger(lambda t: Limits(stored_bytes=100, queued_rows=10, open_batches=2))
    ledger.admit("a", "b1", 6)
    with pytest.raises(Exceeded, match=r"quota queued_rows exceeded: 6 requests in open batches in use, this request "
                                       r"asks 5 more, the tenant's limit is 10") as exc:
        ledger.admit("a", "b2", 5)
    assert exc.value.quota == "queued_rows" and not exc.value.storage
    ledger.admit("a", "b2", 4)
    with pytest.raises(Exceeded, match="open_batches"):
        ledger.admit("a", "b3", 0)
    ledger.observe("a", "b1", "completed")  # a final batch frees its share
    ledger.admit("a", "b3", 0)
    assert ledger.reserve("a", 500) == 100, "an upload may write at most the room left"
    with pytest.raises(Exceeded, match="stored_bytes") as exc:
        ledger.reserve("a", 10)
    assert exc.value.storage


def test_the_quota_file_is_typed_and_checked_with_clear_errors():
    table = QuotaTable(Limits(open_batches=5), """
        [defaults]
        queued_rows = 1_000

        [tenants.alice]
        stored_bytes = 10_000_000
        open_batches = 0
    """)
    assert table("alice") == Limits(stored_bytes=10_000_000, open_batches=0, queued_rows=1000)
    assert table("bob") == Limits(open_batches=5, queued_rows=1000), "others: the file's defaults over the env's"
    bad = {
        "[tenants.alice]\nopen_batchs = 3\n": "unknown field `open_batchs`",
        "[tenants.alice]\nopen_batches = -1\n": "Expected `int` >= 0",
        "[tenants.alice]\nopen_batches = '3'\n": "Expected `int | null`, got `str`",
        "[tenants.alice]\nopen_batches = 1.5\n": "Expected `int | null`, got `float`",
        '[tenants."al ice"]\nopen_batches = 1\n': "tenant 'al ice'",
        "[tenants.alice\n": "not TOML",
        "[defaults]\nqueued_rows = 1\n[other]\n": "unknown field `other`",
    }
    for text, words in bad.items():
        with pytest.raises(ValueError, match="quotas.toml") as exc:
            parse_quota_file(text, "quotas.toml")
        assert words in str(exc.value), (text, str(exc.value))


def touch(path, text: str) -> None:
    """Write `path` and move its mtime on (a change within one clock tick must still show)."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))


def test_a_watched_file_is_read_again_when_it_changes_and_a_bad_edit_keeps_the_last(tmp_path):
    path = tmp_path / "quotas.toml"
    path.write_text("[tenants.alice]\nopen_batches = 1\n")
    watched = Watched(path, lambda text: QuotaTable(Limits(), text, str(path)), "quotas")
    assert watched.get()("alice").open_batches == 1
    touch(path, "[tenants.alice]\nopen_batches = 2\n")
    assert watched.get()("alice").open_batches == 2
    touch(path, "[tenants.alice]\nopen_batches = two\n")  # a bad edit: the last good one stays
    assert watched.get()("alice").open_batches == 2 and watched.reloads == 1
    path.unlink()  # removed: read as empty
    assert watched.get()("alice").open_batches == 0
    with pytest.raises(OSError):
        Watched(tmp_path / "none.toml", str, "quotas")  # at start: an error


def test_keys_added_rotated_and_revoked_in_the_keys_file_take_effect_at_the_next_request(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alice ka#1\nbob kb\n")
    ring = KeyRing("carol:kc", str(path))
    assert [ring.tenant(f"Bearer {k}") for k in ("ka#1", "kb", "kc", "kd")] == ["alice", "bob", "carol", None]
    touch(path, "alice ka#1\nalice ka#2\ndave kd\n")  # alice rotates (two keys a while), bob revoked, dave added
    assert [ring.tenant(f"Bearer {k}") for k in ("ka#1", "ka#2", "kb", "kd")] == ["alice", "alice", None, "dave"]
    touch(path, "alice ka#2\nbob ka#2\n")  # a key given to two tenants: refused, the keys in force stay
    assert ring.tenant("Bearer kd") == "dave"
    touch(path, "")  # every file key revoked: never open, the inline key stays
    assert ring.tenant("Bearer ka#2") is None and ring.tenant(None) is None and ring.tenant("Bearer kc") == "carol"
    open_ring = KeyRing("", "")
    assert open_ring.tenant(None) == "default"


@given(ids=st.lists(st.integers(0, 500), unique=True, max_size=60), limit=st.integers(1, 12),
       order=st.sampled_from(["asc", "desc"]), churn=st.lists(st.tuples(st.booleans(), st.integers(0, 500)),
                                                                max_size=20))
def test_cursor_pages_return_each_item_once_in_order_while_items_come_and_go(ids, limit, order, churn):
    """Walking the pages (`after` = the last id of a page) returns every id there from
    start to end exactly once, in order, even if ids are deleted or added between pages
    (a deleted one may be missed; none twice)."""
    names = {f"id_{i:04d}" for i in ids}
    never_gone = set(names)
    seen, after, steps = [], None, 0
    while True:
        page, more = page_of(sorted(names), after, limit, order)
        assert len(page) == limit if more else len(page) <= limit
        seen += page
        if not more:
            break
        after = page[-1]
        if steps < len(churn):  # a change between pages
            add, i = churn[steps]
            (names.add if add else names.discard)(f"id_{i:04d}")
            if not add:
                never_gone.discard(f"id_{i:04d}")
        steps += 1
    assert len(seen) == len(set(seen)), "no id twice"
    assert seen == sorted(seen, reverse=order == "desc")
    assert never_gone <= set(seen), "every id there from start to end is listed"


def test_new_ids_sort_by_creation_time():
    first = new_id("file")
    time.sleep(0.002)
    assert first < new_id("file") and len(first) <= 128


def test_the_api_does_not_start_with_a_bad_quota_file_and_says_why(tmp_path):
    from prefixflow.batchapi.service import Api
    from prefixflow.shared.outcomes import CommandError
    from prefixflow.shared.process import config as cfgmod

    path = tmp_path / "quotas.toml"
    path.write_text("[tenants.alice]\nqueued_rows = -5\n")
    cfg = cfgmod.load(cfgmod.ApiConfig, environ={"PFX_QUOTAS_FILE": str(path), "PFX_QUOTA_OPEN_BATCHES": "3"})
    with pytest.raises(CommandError, match=r"prefixflow serve api: quotas: .*quotas.toml: Expected `int` >= 0"):
        Api(cfg)
    path.write_text("[tenants.alice]\nqueued_rows = 5\n")
    api = Api(cfg)
    assert api.ledger.limits("alice") == Limits(open_batches=3, queued_rows=5)
    assert api.ledger.limits("bob") == Limits(open_batches=3), "the env's defaults for a tenant the file does not name"
