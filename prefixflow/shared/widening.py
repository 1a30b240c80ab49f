"""A job's schema grows, it never loses: the rules, as pure functions (no I/O).

Rows published raw (`pfx.ingest.<job>`) carry whatever fields their publisher gave; a
job's output columns are the union of them, each typed to hold every value the job's rows
gave it exactly. The same rules type a batch of Python values (the ingestor, `column_of`)
and join the parts of a job (the sink, `SchemaGrowth`), so the result does not depend on
how rows were batched.

The widening lattice (`join`), on a column's `Kind` (its Arrow type, and whether it holds
an integer outside +-2^53):
- null joins to anything (a field absent or null so far): the column is nullable;
- the same type stays; two integer types -> int64 (two unsigned ones -> the wider; uint64
  with anything but an unsigned integer -> string: its values may be past int64); two
  float types -> float64;
- integer + float -> float64 while every integer is within +-2^53 (`SAFE_INT`: every such
  integer is exact in float64, and so is its text after, see `text`), else string;
- two nested types of one shape, one with a null type where the other has a type (an
  empty list, a null field) -> the other;
- anything else (bool + int, a nested value + anything not of its exact type, two
  different nested types, timestamps + strings ...) -> string (large_string if either
  side is large_string).
String is the top: every value has a text (`text`), so a value is never dropped or nulled.

The canonical text of a value (what a widened string column holds): a string is itself;
an integer `str(v)`; a bool `true`/`false`; a float Python's `repr` (shortest round trip:
`1.5`, `1e+20`, `nan`), except that an integral float within +-2^53 prints as the integer
(`5.0` -> `5`), so an integer that went through a float64 column reads as it was given;
bytes base64; a nested value (list, map, struct) its JSON as Python's `json.dumps` writes
it; any other scalar (timestamp, decimal) `str(v)`.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

SAFE_INT = 1 << 53
"""Integers within +-SAFE_INT widen to float64 (each is exact there, and prints back as
itself); one outside makes an int + float column string."""
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class Kind:
    """What a column holds, as far as widening cares."""

    type: pa.DataType
    wide_ints: bool = False
    """It holds an integer outside +-SAFE_INT (so it cannot become float64)."""


NULL = Kind(pa.null())
STRING = Kind(pa.string())


def int_is_safe(v: int) -> bool:
    """An integer float64 holds exactly, whose text survives the trip (`SAFE_INT`)."""
    return -SAFE_INT <= v <= SAFE_INT


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t)


def _fill_nulls(a: pa.DataType, b: pa.DataType) -> pa.DataType | None:
    """Two nested types of one shape whose only difference is a null type in one where the
    other has a type (`[]` and `[true]`, `{"a": null}` and `{"a": 1}`): that other type;
    else None."""
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b) or a == b:
        return a
    if pa.types.is_list(a) and pa.types.is_list(b):
        inner = _fill_nulls(a.value_type, b.value_type)
        return None if inner is None else pa.list_(inner)
    if pa.types.is_struct(a) and pa.types.is_struct(b) and [f.name for f in a] == [f.name for f in b]:
        fields = [_fill_nulls(fa.type, fb.type) for fa, fb in zip(a, b)]
        return None if None in fields else pa.struct([(f.name, t) for f, t in zip(a, fields)])
    return None


def join_types(a: pa.DataType, b: pa.DataType, wide_ints: bool) -> pa.DataType:
    """The narrowest type holding both (`wide_ints`: either holds an unsafe integer)."""
    if pa.types.is_null(a):
        return b
    if pa.types.is_null(b) or a == b:
        return a
    if pa.uint64() in (a, b) and not (pa.types.is_unsigned_integer(a) and pa.types.is_unsigned_integer(b)):
        return pa.large_string() if pa.large_string() in (a, b) else pa.string()  # NOTE: past int64 and float64
    ints = pa.types.is_integer(a), pa.types.is_integer(b)
    floats = pa.types.is_floating(a), pa.types.is_floating(b)
    if all(ints):
        if pa.types.is_unsigned_integer(a) and pa.types.is_unsigned_integer(b):
            return max(a, b, key=lambda t: t.bit_width)
        return pa.int64()
    if all(floats):
        return pa.float64()
    if any(ints) and any(floats):
        return pa.string() if wide_ints else pa.float64()
    if (filled := _fill_nulls(a, b)) is not None:
        return filled
    return pa.large_string() if pa.large_string() in (a, b) else pa.string()


def join(a: Kind, b: Kind) -> Kind:
    """The least kind above both (commutative, associative, idempotent)."""
    wide = a.wide_ints or b.wide_ints
    return Kind(join_types(a.type, b.type, wide), wide)


def join_all(kinds: Iterable[Kind]) -> Kind:
    out = NULL
    for k in kinds:
        out = join(out, k)
    return out


def type_text(t: pa.DataType) -> str:
    """A type as text, without the names Arrow and Parquet give list items (`item`,
    `element`): the same type reads the same however it was made."""
    if pa.types.is_fixed_size_list(t):
        return f"fixed_size_list<{type_text(t.value_type)}>[{t.list_size}]"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"{'large_' if pa.types.is_large_list(t) else ''}list<{type_text(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(f"{f.name}: {type_text(f.type)}" for f in t) + ">"
    return str(t)


# --- canonical text ----------------------------------------------------------------------


def float_text(x: float) -> str:
    """A float's canonical text: `repr`, an integral value within +-SAFE_INT as the integer."""
    if math.isfinite(x) and x.is_integer() and abs(x) <= SAFE_INT and not (x == 0 and math.copysign(1.0, x) < 0):
        return str(int(x))
    return repr(x)


def _json_default(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):
        return base64.b64encode(v).decode()
    return str(v)


def text(v: Any) -> str | None:
    """The canonical text of one value (None stays None)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return float_text(v)
    if isinstance(v, bytes | bytearray):
        return base64.b64encode(v).decode()
    if isinstance(v, list | tuple | dict):
        return json.dumps(v, default=_json_default)
    return str(v)


# --- Python values (a batch of raw rows' field) ------------------------------------------


def _scalar_kind(v: Any) -> Kind | None:
    """The kind of a scalar value (None: a nested one)."""
    if v is None:
        return NULL
    if isinstance(v, bool):
        return Kind(pa.bool_())
    if isinstance(v, int):
        if not INT64_MIN <= v <= INT64_MAX:
            return STRING  # no integer type holds it: its text does
        return Kind(pa.int64(), not int_is_safe(v))
    if isinstance(v, float):
        return Kind(pa.float64())
    if isinstance(v, str):
        return STRING
    if isinstance(v, bytes | bytearray):
        return Kind(pa.binary())
    if isinstance(v, list | tuple | dict):
        return None
    return STRING


def _strict_default(v: Any) -> Any:
    if isinstance(v, bytes | bytearray):  # never equal to a text value (b"" is not "")
        return {"bytes": base64.b64encode(v).decode()}
    return _json_default(v)


def _strict(v: Any) -> str:
    """A value's JSON with its types kept (1 and 1.0 differ, bytes and text differ): what an
    exact trip keeps."""
    return json.dumps(v, default=_strict_default, sort_keys=False)


def _nested_kind(values: list[Any]) -> Kind:
    """One Arrow type holding every nested value exactly (Arrow's inference, checked value
    by value: no key added to a map, no integer turned float), else string."""
    try:
        arr = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError, ValueError, TypeError):
        return STRING
    try:
        back = arr.to_pylist()
    except ValueError:  # bytes Arrow took into a text column (UnicodeDecodeError): not exact
        return STRING
    # NOTE: one JSON text of the whole list, not one per value (the same test: each value's
    # JSON is self-delimiting), so a 4,096-row batch costs two encodes, not 8,192.
    if pa.types.is_null(arr.type) or _strict(back) != _strict(values):
        return STRING
    return Kind(arr.type)


_SCALAR_KINDS = {type(None): NULL, bool: Kind(pa.bool_()), float: Kind(pa.float64()), str: STRING,
                 bytes: Kind(pa.binary()), bytearray: Kind(pa.binary())}
"""Kinds by a value's exact type (`_scalar_kind`'s, without a call per value)."""
_NESTED = (list, tuple, dict)


def _int_kind(ints: list[int]) -> Kind:
    """`_scalar_kind` joined over integers, from their range alone."""
    lo, hi = min(ints), max(ints)
    if lo < INT64_MIN or hi > INT64_MAX:
        return STRING
    return Kind(pa.int64(), not (int_is_safe(lo) and int_is_safe(hi)))


def kind_of_values(values: list[Any]) -> Kind:
    """The kind of a field over a batch of rows' Python values (JSON/msgpack types): the
    join of each scalar's kind and the kind of the nested values together. (Grouped by
    each value's type first: a batch of one type costs one pass, not a join per value.)"""
    kinds: list[Kind] = []
    for t in set(map(type, values)):
        if t in _SCALAR_KINDS:
            kinds.append(_SCALAR_KINDS[t])
        elif t is int:
            kinds.append(_int_kind([v for v in values if type(v) is int]))
        elif t not in _NESTED:  # a subclass (an IntEnum, a str subclass ...): value by value
            kinds.extend(k for v in values if type(v) is t and (k := _scalar_kind(v)) is not None)
    nested = [v for v in values if isinstance(v, _NESTED)]
    if nested:
        kinds.append(_nested_kind(nested))
    return join_all(kinds)


def column_of(values: list[Any], kind: Kind | None = None) -> pa.Array:
    """A batch of Python values as one Arrow array of their kind, each value exact."""
    kind = kind or kind_of_values(values)
    t = kind.type
    if pa.types.is_null(t):
        return pa.nulls(len(values))
    if _is_text(t):
        return pa.array([text(v) for v in values], t)
    if pa.types.is_floating(t):
        return pa.array([None if v is None else float(v) for v in values], t)
    return pa.array(values, t)


# --- Arrow columns (the parts of a job) --------------------------------------------------


def kind_of_array(arr: pa.Array | pa.ChunkedArray) -> Kind:
    """The kind of an Arrow column (an integer column's range decides `wide_ints`)."""
    t = arr.type
    if not pa.types.is_integer(t) or len(arr) == arr.null_count:
        return Kind(t)
    bounds = pc.min_max(arr).as_py()
    return Kind(t, not (int_is_safe(bounds["min"]) and int_is_safe(bounds["max"])))


def widen_array(arr: pa.Array | pa.ChunkedArray, to: pa.DataType) -> pa.Array | pa.ChunkedArray:
    """A column as the wider type `to` (a type `join` gave it), every value kept: numbers
    cast exactly (Arrow's safe cast refuses any loss), anything to text by `text`."""
    if arr.type == to:
        return arr
    if isinstance(arr, pa.ChunkedArray):
        return pa.chunked_array([widen_array(c, to) for c in arr.chunks], to)
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), to)
    if _is_text(to):
        if _is_text(arr.type) or pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type):
            return arr.cast(to)  # Arrow's text of these is `text`'s
        return pa.array([text(v) for v in arr.to_pylist()], to)
    numbers = pa.types.is_integer(to) or pa.types.is_floating(to)
    if (numbers and (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type))) or _fill_nulls(arr.type, to) == to:
        return arr.cast(to, safe=True)
    raise TypeError(f"{arr.type} does not widen to {to}")


class SchemaGrowth:
    """A job's columns: the union of every part's, each of the join of its kinds.

    Columns keep the order they were first seen in; a new column whose name is not in
    `trailing` (the generated columns) goes before the first trailing one, so input
    columns stay ahead of what the sink generates. A trailing column of the type it had
    is taken as it is (the writer types them: no value of theirs widens anything)."""

    def __init__(self, trailing: Iterable[str] = ()) -> None:
        self.trailing = frozenset(trailing)
        self.kinds: dict[str, Kind] = {}

    def __bool__(self) -> bool:
        return bool(self.kinds)

    def add(self, kinds: Mapping[str, Kind]) -> bool:
        """Join these columns in; whether the schema changed (a column added or widened)."""
        changed = False
        for name, kind in kinds.items():
            have = self.kinds.get(name)
            if have is None:
                self._insert(name, kind)
                changed = True
                continue
            joined = join(have, kind)
            if joined != have:
                changed = changed or joined.type != have.type
                self.kinds[name] = joined
        return changed

    def add_table(self, table: pa.Table) -> bool:
        kinds = {}
        for name, col in zip(table.column_names, table.columns):
            have = self.kinds.get(name)
            if have is not None and have.type == col.type and (
                have.wide_ints or name in self.trailing or not pa.types.is_integer(col.type)
            ):
                continue  # NOTE: nothing it holds can change the column (the common case: a part like the last)
            kinds[name] = kind_of_array(col)
        return self.add(kinds)

    def _insert(self, name: str, kind: Kind) -> None:
        names = list(self.kinds)
        at = len(names)
        if name not in self.trailing:
            at = next((i for i, n in enumerate(names) if n in self.trailing), len(names))
        items = list(self.kinds.items())
        items.insert(at, (name, kind))
        self.kinds = dict(items)

    def schema(self) -> pa.Schema:
        return pa.schema([(name, kind.type) for name, kind in self.kinds.items()])

    def conform(self, table: pa.Table) -> pa.Table:
        """`table` under the grown schema (`conform`)."""
        return conform(table, self.schema())


def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """`table` under `schema`, a schema grown from it: its columns widened, the ones it
    lacks null. A column `schema` lacks is an error: nothing is ever dropped."""
    if table.schema.equals(schema):
        return table
    extra = set(table.column_names) - set(schema.names)
    if extra:
        raise ValueError(f"columns not in the job's schema: {sorted(extra)} (add them first)")
    arrays = [
        widen_array(table.column(f.name), f.type) if f.name in table.column_names else pa.nulls(table.num_rows, f.type)
        for f in schema
    ]
    return pa.Table.from_arrays(arrays, schema=schema)
