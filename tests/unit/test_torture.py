"""prefixflow.torture's pure parts: the draws are the seed's alone, and the checkers
catch what they are for (a dropped id, a doubled id, an id never sent, a changed byte,
a nulled value, a bad row without an error, an exit code that lies), and pass a faithful
output (as the sink writes it: typed columns kept, widened columns as canonical text)."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.shared.widening import text
from prefixflow.torture import checkers, datasets, faults
from prefixflow.torture.checkers import Outcome, Output
from prefixflow.torture.datasets import Dataset, id_key
from prefixflow.torture.rounds import plan_round, replay_command
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit

seeds = st.integers(0, 2**32)
kinds = st.sampled_from(datasets.KINDS)


def faithful(ds: Dataset) -> Output:
    """What a correct cluster writes for `ds`: every id once, the bad ones as error rows,
    each column its declared type (files) or widened to text where its values differ in type."""
    declared = {f.name: f.type for f in ds.schema} if ds.schema is not None else {}
    names = {k for r in ds.rows for k in r if k != "id"}
    types: dict[str, pa.DataType] = {"id": pa.string(), "error": pa.string()}
    for name in names:
        values = [r[name] for r in ds.rows if r.get(name) is not None]
        kinds_of = {type(v) for v in values}
        types[name] = declared.get(name) or (pa.string() if len(kinds_of) > 1 or dict in kinds_of or list in kinds_of
                                             else pa.null() if not values else pa.scalar(values[0]).type)
    rows = []
    for r in ds.rows:
        row = {"id": r["id"], "error": "bad row" if id_key(r["id"]) in ds.bad else None}
        for name in names:
            v = r.get(name)
            if name in declared:
                row[name] = checkers.typed_value(v, declared[name])
            elif v is not None and pa.types.is_string(types[name]) and not isinstance(v, str):
                row[name] = text(v)
            else:
                row[name] = v
        rows.append(row)
    rows += [{"id": i, "error": "malformed message"} for i, _ in ds.malformed]
    return Output(rows, types)


def drawn(seed: int, kind: str) -> Dataset:
    import random

    return datasets.draw(random.Random(seed), kind, max_rows=40)


@settings(COSTLY)
@given(seeds, kinds)
def test_a_draw_is_the_seeds_alone(seed, kind):
    a, b = drawn(seed, kind), drawn(seed, kind)
    assert a.ids() == b.ids() and a.features == b.features and a.bad == b.bad
    assert len(set(a.ids())) == len(a.ids())  # distinct ids (5 and "5" are two)
    assert a.bad <= set(a.ids())


@settings(COSTLY)
@given(seeds, kinds)
def test_a_faithful_output_passes(seed, kind):
    ds = drawn(seed, kind)
    out = faithful(ds)
    assert checkers.check_ids(ds, out) == []
    assert checkers.check_columns(ds, out) == []


@settings(COSTLY)
@given(seeds, kinds, st.data())
def test_a_dropped_or_doubled_or_foreign_id_is_caught(seed, kind, data):
    ds = drawn(seed, kind)
    out = faithful(ds)
    i = data.draw(st.integers(0, len(out.rows) - 1))
    victim = out.rows[i]
    dropped = Output(out.rows[:i] + out.rows[i + 1 :], out.types)
    assert any("never came out" in v.detail for v in checkers.check_ids(ds, dropped))
    doubled = Output(out.rows + [dict(victim)], out.types)
    assert any("more than once" in v.detail for v in checkers.check_ids(ds, doubled))
    foreign = Output(out.rows + [{**victim, "id": "never-sent-\u2603"}], out.types)
    assert any("never sent" in v.detail for v in checkers.check_ids(ds, foreign))


def test_five_and_text_five_are_two_ids():
    ds = Dataset("raw", [{"id": 5, "prompt": "a"}, {"id": "5", "prompt": "b"}])
    one = Output([{"id": 5, "prompt": "a", "error": None}], {"prompt": pa.string()})
    assert any("never came out: '5'" in v.detail for v in checkers.check_ids(ds, one))


@settings(COSTLY)
@given(seeds, kinds, st.data())
def test_a_changed_byte_or_a_nulled_value_is_caught(seed, kind, data):
    ds = drawn(seed, kind)
    out = faithful(ds)
    cells = [(i, k) for i, r in enumerate(ds.rows) for k, v in r.items() if k != "id" and v is not None]
    if not cells:
        return
    i, name = data.draw(st.sampled_from(cells))
    row = out.rows[i]
    got = row[name]
    changed = dict(row)
    if isinstance(got, str):
        changed[name] = got[:-1] + chr(ord(got[-1]) ^ 1) if got else "x"
    elif isinstance(got, bytes):
        changed[name] = got[:-1] + bytes([got[-1] ^ 1]) if got else b"x"
    elif isinstance(got, bool):
        changed[name] = not got
    elif isinstance(got, float):
        changed[name] = 1.0 if math.isnan(got) else -got if got != 0 else (0.0 if math.copysign(1, got) < 0 else -0.0)
    elif isinstance(got, int):
        changed[name] = got ^ 1
    else:
        changed[name] = None
    for variant in (changed, {**row, name: None}):
        rows = out.rows[:i] + [variant] + out.rows[i + 1 :]
        assert checkers.check_columns(ds, Output(rows, out.types)), (name, got, variant[name])


def test_a_bad_row_without_its_error_is_caught():
    ds = Dataset("raw", [{"id": 0, "prompt": ""}, {"id": 1, "prompt": "ok"}], bad={("i", 0)})
    out = Output([{"id": 0, "prompt": "", "error": None}, {"id": 1, "prompt": "ok", "error": "boom"}],
                 {"prompt": pa.string()})
    found = " ".join(v.detail for v in checkers.check_ids(ds, out))
    assert "bad rows came out without an error: 0" in found and "good rows came out as error rows" in found


def test_widened_columns_compare_by_canonical_text():
    assert checkers.same_value(5, "5", pa.string(), None)
    assert checkers.same_value({"x": [1, 2]}, '{"x": [1, 2]}', pa.string(), None)
    assert checkers.same_value(3, 3.0, pa.float64(), None)
    assert not checkers.same_value(5, "05", pa.string(), None)
    assert not checkers.same_value(-0.0, 0.0, pa.float64(), pa.float64())  # byte-exact: the sign bit counts
    assert checkers.same_value(math.nan, math.nan, pa.float64(), pa.float64())
    assert not checkers.same_value(1, 1, pa.int32(), pa.int64())  # a declared type is kept


@pytest.mark.parametrize("outcome, verdict", [
    (Outcome(0, done=True, rows=3), True),
    (Outcome(0, done=True, rows=2), False),  # exit 0 with a row short
    (Outcome(0, done=False, rows=3), False),
    (Outcome(1, failed=True), True),
    (Outcome(1, "TimeoutError"), False),  # exit 1 of a job that is not failed: a hang
    (Outcome(75, "error: job j paused: no space left"), True),
    (Outcome(75, "error"), False),
    (Outcome(-9, "killed"), False),
])
def test_exit_codes_must_tell_the_truth(outcome, verdict):
    assert (checkers.check_exit(outcome, 3) == []) is verdict


def test_another_input_must_be_refused():
    assert checkers.check_exit(Outcome(2, "error: ... asked something else"), 0, refused=True) == []
    assert checkers.check_exit(Outcome(0, done=True), 0, refused=True)


@settings(COSTLY)
@given(seeds, st.integers(0, 10**6))
def test_a_round_is_its_seed_and_number_alone(seed, r):
    a, b = (plan_round(seed, r, ("run", "submit", "raw"), disk=True, max_rows=20) for _ in range(2))
    assert a.describe() == b.describe() and a.dataset.ids() == b.dataset.ids()
    assert a.entry in ("run", "submit", "raw")
    assert all(f.kind in faults.KINDS for f in a.faults)
    no_disk = plan_round(seed, r, ("raw",), disk=False, max_rows=20)
    assert no_disk.entry == "raw" and all(f.kind != "disk_full" for f in no_disk.faults)
    assert replay_command(seed, r, ("raw",)) == f"prefixflow torture --seed {seed} --round {r} --rounds 1 --entries raw"


def test_a_fifth_of_full_disks_last_until_the_job_pauses_and_the_pauses_are_counted():
    import random
    from collections import Counter

    from prefixflow.torture.rounds import RoundResult, summarize

    disks = [f for i in range(2000) for f in faults.plan(random.Random(i), ["sink"], disk=True) if f.kind == "disk_full"]
    held = [f for f in disks if f.target == faults.UNTIL_PAUSED]
    assert 0.12 < len(held) / len(disks) < 0.28, (len(held), len(disks))
    assert all(f.at > 5.0 for f in held) and all(f.at <= 5.0 for f in disks if f not in held)
    assert str(held[0]) == "disk_full until the job pauses"
    results = [RoundResult(1, i, "run", "") for i in range(4)]
    results[1].paused, results[2].paused = 0, 1  # completed again; paused again (a violation elsewhere)
    assert summarize(1, results, ("run",), Counter(), True, 1.0)["disk_pauses"] == {"paused": 2, "completed_again": 1}
