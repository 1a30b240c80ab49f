"""JSONL inputs whose field types change between lines widen in the client by the job's
rules (`prefixflow/shared/widening.py`, docs/schema-growth.md), as raw rows do at the
ingestor and the sink: never a failure, never a lost value, and the column does not
depend on where the reader cuts the file into batches."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from unittest import mock

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixflow.client import columns, readers
from prefixflow.shared import widening
from tests.tiers import COSTLY
from tests.unit.test_widening import exact

pytestmark = pytest.mark.unit

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-(2**54), 2**54),
                         st.integers(-3, 3), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=5))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=3)), max_leaves=3)
"""What a JSON line's field may hold (test_widening's values, less bytes and non-finite floats)."""
ABSENT = object()
"""A line without the field."""


def kept_column(lines: list[dict], batch_rows: int, name: str = "f") -> tuple[list[pa.DataType], list]:
    """Write `lines` as a JSONL file and read it back as `prefixflow submit` does, in
    batches of `batch_rows`: (each batch's type of column `name`, its values in order)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "in.jsonl"
        path.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with mock.patch.object(readers, "CHUNK_ROWS", batch_rows):
            tables = [columns.read_ipc(c.kept) for c in columns.chunks(path)]
    return [t.schema.field(name).type for t in tables], [v for t in tables for v in t.column(name).to_pylist()]


@settings(COSTLY)  # each example writes a file and reads it through the client
@given(st.lists(st.one_of(st.just(ABSENT), json_values), min_size=1, max_size=8), st.integers(1, 4))
def test_a_field_whose_type_changes_between_lines_widens_as_the_raw_path_does(field_values, batch_rows):
    lines = [{"prompt": f"p{i}"} | ({} if v is ABSENT else {"f": v}) for i, v in enumerate(field_values)]
    given_values = [None if v is ABSENT else v for v in field_values]
    if all(v is None for v in given_values):
        return  # no value: the field is a text column of nulls (below)
    # The raw path's type for the same values in one batch (the ingestor's `column_of`).
    want = widening.kind_of_values(given_values).type
    types, got = kept_column(lines, batch_rows)
    assert all(t == want for t in types), (types, want)  # one schema, whatever the batching
    for v, g in zip(given_values, got, strict=True):
        assert exact(v, want, g), (v, want, g)


def test_int_then_string_and_nested_beside_scalar_come_out_as_canonical_text():
    lines = [{"prompt": "a", "n": 1, "x": {"k": [1, 2]}, "f": 3.0},
             {"prompt": "b", "n": "two", "x": 5, "f": "s"},
             {"prompt": "c", "n": 2**60, "x": None, "f": 2.5}]
    for batch_rows in (1, 3):
        assert kept_column(lines, batch_rows, "n")[1] == ["1", "two", str(2**60)]
        assert kept_column(lines, batch_rows, "x")[1] == ['{"k": [1, 2]}', "5", None]
        assert kept_column(lines, batch_rows, "f")[1] == ["3", "s", "2.5"]  # 3.0's canonical text is "3"


def test_an_int_past_2_53_beside_a_float_is_text_not_a_rounded_float():
    lines = [{"prompt": "a", "f": 2**53 + 1}] + [{"prompt": "b", "f": 0.5}]
    for batch_rows in (1, 2):  # in one batch or across two (Arrow's promotion would round it)
        types, got = kept_column(lines, batch_rows)
        assert set(types) == {pa.string()} and got == [str(2**53 + 1), "0.5"]
    types, got = kept_column([{"prompt": "a", "f": 2**53}, {"prompt": "b", "f": 0.5}], 1)
    assert set(types) == {pa.float64()} and got == [float(2**53), 0.5]


def test_a_field_never_given_a_value_is_a_text_column_of_nulls():
    types, got = kept_column([{"prompt": "a", "f": None}, {"prompt": "b"}], 1)
    assert set(types) == {pa.string()} and got == [None, None]
