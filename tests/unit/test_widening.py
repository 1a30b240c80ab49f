"""prefixflow.shared.widening: a job's schema grows, it never loses (issue 39, item 1).

The rules as properties: the widening lattice is a join (order and batching of rows do
not matter), every value of a widened column is its exact value or its canonical text,
the int -> float64 exactness check, the union of fields keeps every column."""

from __future__ import annotations

import json
import math

import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared import widening as w

pytestmark = pytest.mark.unit

TYPES = [pa.null(), pa.bool_(), pa.int8(), pa.int32(), pa.int64(), pa.uint8(), pa.uint32(), pa.uint64(), pa.float32(),
         pa.float64(), pa.string(), pa.large_string(), pa.binary(), pa.list_(pa.int64()), pa.list_(pa.float64()),
         pa.struct([("a", pa.int64())]), pa.timestamp("us"), pa.list_(pa.null()), pa.struct([("a", pa.null())]),
         pa.list_(pa.list_(pa.null()))]
kinds = st.builds(lambda t, wide: w.Kind(t, wide and pa.types.is_integer(t)), st.sampled_from(TYPES), st.booleans())
"""Only an integer column holds an integer past 2^53 (`kind_of_array`)."""

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-(2**54), 2**54), st.integers(-3, 3),
    st.floats(allow_nan=False), st.text(max_size=5), st.binary(max_size=3),
)
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from("abc"), inner, max_size=3)), max_leaves=3)


@given(kinds, kinds, kinds)
def test_join_is_a_join(a, b, c):
    assert w.join(a, b) == w.join(b, a)
    assert w.join(w.join(a, b), c) == w.join(a, w.join(b, c))
    assert w.join(a, a) == a
    assert w.join(w.NULL, a) == a
    top = w.join(a, w.STRING).type
    assert top in (pa.string(), pa.large_string())  # string is the top: every value has a text
    assert w.join(w.join(a, b), a) == w.join(a, b)  # a join never goes back down


def test_widening_table():
    int64, wide = w.Kind(pa.int64()), w.Kind(pa.int64(), True)
    assert w.join(int64, w.STRING).type == pa.string()
    assert w.join(int64, w.Kind(pa.float64())).type == pa.float64()
    assert w.join(wide, w.Kind(pa.float64())).type == pa.string()  # 2^53 + 1 is not exact in float64
    assert w.join(w.Kind(pa.list_(pa.int64())), int64).type == pa.string()
    assert w.join(w.Kind(pa.list_(pa.int64())), w.Kind(pa.list_(pa.float64()))).type == pa.string()
    assert w.join(w.Kind(pa.bool_()), int64).type == pa.string()
    assert w.join(w.Kind(pa.int8()), w.Kind(pa.int32())).type == pa.int64()


@given(st.integers(-w.SAFE_INT, w.SAFE_INT))
def test_a_safe_int_is_exact_in_float64_and_prints_back_as_itself(v):
    assert w.int_is_safe(v)
    assert int(float(v)) == v and w.float_text(float(v)) == str(v) == w.text(v)


@given(st.integers(w.SAFE_INT + 1, 2**63 - 1), st.booleans())
def test_an_int_past_2_53_is_not_safe_and_keeps_a_column_from_float64(v, negative):
    v = -v if negative else v
    assert not w.int_is_safe(v)
    assert w.kind_of_values([v, 1.5]).type == pa.string()
    assert w.column_of([v, 1.5]).to_pylist() == [str(v), "1.5"]


@given(st.floats())
def test_float_text_round_trips(x):
    back = float(w.float_text(x))
    assert (math.isnan(x) and math.isnan(back)) or (back == x and math.copysign(1, back) == math.copysign(1, x))


def exact(value, kind_type, got) -> bool:
    """`got` (the value as its widened column holds it) keeps `value` exactly."""
    if value is None:
        return got is None
    if pa.types.is_string(kind_type) or pa.types.is_large_string(kind_type):
        return got == w.text(value)
    if pa.types.is_floating(kind_type):
        return float(got) == value and (not isinstance(value, int) or int(got) == value)
    return json.dumps(got, default=str) == json.dumps(value, default=str)


@given(st.lists(values, max_size=6), st.lists(st.integers(1, 3), max_size=3))
def test_batches_widened_to_the_job_kind_equal_one_batch_and_keep_every_value(vals, cuts):
    """The ingestor types a batch (`column_of`); the sink joins parts (`kind_of_array`) and
    widens each to the job's kind: same column whatever the batching, every value exact."""
    batches, i = [], 0
    for n in cuts:
        batches.append(vals[i : i + n])
        i += n
    batches.append(vals[i:])
    arrays = [w.column_of(b) for b in batches]
    job = w.join_all(w.kind_of_array(a) for a in arrays)
    whole = w.column_of(vals)
    assert job.type == whole.type
    widened = pa.concat_arrays([w.widen_array(a, job.type) for a in arrays]) if arrays else whole
    assert widened.to_pylist() == whole.to_pylist()
    for v, got in zip(vals, whole.to_pylist()):
        assert exact(v, whole.type, got), (v, whole.type, got)


def test_nested_values_of_one_shape_stay_nested_and_others_become_json():
    assert w.column_of([[1, 2], [3]]).type == pa.list_(pa.int64())
    assert w.column_of([{"a": 1}, {"b": "x"}]).to_pylist() == ['{"a": 1}', '{"b": "x"}']  # no key invented
    assert w.column_of([[1], [1.5]]).to_pylist() == ["[1]", "[1.5]"]  # no int made a float
    assert w.column_of([5, "5", 5.5, True, None, [1]]).to_pylist() == ["5", "5", "5.5", "true", None, "[1]"]


@given(st.lists(st.dictionaries(st.sampled_from(["a", "b", "output", "c"]), scalars, max_size=3), min_size=1, max_size=4))
def test_schema_growth_is_the_union_and_conform_never_drops(rows):
    growth = w.SchemaGrowth(trailing=["output"])
    tables = [pa.table({k: w.column_of([v]) for k, v in r.items()}) if r else pa.table({}) for r in rows]
    for t in tables:
        growth.add_table(t)
    names = {k for r in rows for k in r}
    assert set(growth.schema().names) == names
    if "output" in names:
        assert growth.schema().names[-1] == "output"  # input columns stay ahead of generated ones
    for r, t in zip(rows, tables):
        if not t.num_columns:
            continue
        (row,) = growth.conform(t).to_pylist()
        for k in names:
            assert exact(r.get(k), growth.schema().field(k).type, row[k])


def test_conform_refuses_a_column_it_was_not_told_of():
    growth = w.SchemaGrowth()
    growth.add_table(pa.table({"a": [1]}))
    with pytest.raises(ValueError, match="not in the job's schema"):
        growth.conform(pa.table({"a": [1], "b": [2]}))
