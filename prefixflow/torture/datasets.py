"""The torture harness's datasets: drawn from a `random.Random`, pure (no I/O but
`write`), so a seed gives the same rows on every machine.

A `Dataset` is the rows a round sends (Python values, each with its `id`), the ids that
must come out as error rows (`bad`), and how it travels:

- `parquet`: a random Arrow schema (int64, float64, string, large_string, bool, binary,
  list<int64>, struct, timestamp, nullable everywhere) and values (nulls, empty
  strings, a huge value now and then, NaN and infinities), an `id` column of int64 or
  string (or none: the client numbers the rows 0..N-1);
- `jsonl`: JSON lines whose fields change type between rows (widened by the client's
  first pass), ids of mixed types (`5` and `"5"` two ids), bad chat, sampling and
  structured rows;
- `raw`: the same kind of rows published one message each on `pfx.ingest.<job>`, plus
  malformed messages (their `Pfx-Id` header makes each an error row) and rows published
  twice (a publisher's retry: one row out).

Bad rows, each an error row by the README's contract: an empty prompt, a prompt longer
than the model allows, per-row sampling out of range, a regex that does not compile,
`messages` that is not a list.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

HUGE_BYTES = 256 * 1024
"""A huge value in a file's column (kept byte-exact; never a model input)."""
RAW_HUGE_BYTES = 64 * 1024
"""A huge value in a raw message (one message must fit the server's max_payload)."""
LONG_PROMPT_WORDS = 6000
"""Words of a prompt longer than the local model's 4,096 positions: an error row."""
WORDS = ("alpha", "beta", "gamma", "delta", "kappa", "omega", "nats", "vllm", "prefix", "bucket", "über", "日本")

KINDS = ("parquet", "jsonl", "raw")
BAD_KINDS = ("empty_prompt", "long_prompt", "bad_sampling", "bad_regex", "bad_messages")


def id_key(value: Any) -> tuple[str, Any]:
    """An id as the contract counts it: `5` and `"5"` are two ids."""
    if isinstance(value, bool):  # NOTE: not an id type; kept apart from 1 and "true"
        return ("b", value)
    return ("i", value) if isinstance(value, int) else ("s", value)


@dataclass
class Dataset:
    kind: str
    """`parquet`, `jsonl` or `raw`."""
    rows: list[dict[str, Any]]
    """Every row sent, with its `id` (for a file without an `id` column: its row number)."""
    bad: set[tuple[str, Any]] = field(default_factory=set)
    """Ids (`id_key`) that must come out as error rows."""
    schema: pa.Schema | None = None
    """A Parquet input's schema (its columns keep these types exactly)."""
    has_id_column: bool = True
    malformed: list[tuple[Any, bytes]] = field(default_factory=list)
    """Raw only: (id, message body that does not decode): each an error row of that id."""
    twice: list[int] = field(default_factory=list)
    """Raw only: indexes of `rows` published a second time (a publisher's retry)."""
    features: list[str] = field(default_factory=list)
    """What this draw holds, for the round's line and the report."""

    def ids(self) -> list[tuple[str, Any]]:
        """Every id that must come out exactly once."""
        return [id_key(r["id"]) for r in self.rows] + [id_key(i) for i, _ in self.malformed]

    def suffix(self) -> str:
        return {"parquet": ".parquet", "jsonl": ".jsonl"}.get(self.kind, "")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choices(WORDS, k=n))


def huge_text(rng: random.Random, size: int) -> str:
    """`size` characters of random hex (no repeated block that could hide a cut)."""
    return rng.randbytes(size // 2 + 1).hex()[:size]


# -- ids ---------------------------------------------------------------------------------


def draw_ids(rng: random.Random, n: int, mode: str) -> list[Any]:
    """`n` distinct ids (by `id_key`) of one `mode`: `int`, `str` or `mixed` (ints and
    strings, with an int and its own text both present when n allows)."""
    ints = rng.sample(range(-(2**40), 2**40), n) if rng.random() < 0.3 else list(range(n))
    if mode == "int":
        return ints
    texts = [rng.choice(["", "id-", "é", " ", "x" * 200]) + str(v) for v in ints]
    if mode == "str":
        return texts
    out = [v if rng.random() < 0.5 else str(v) for v in ints]
    if n >= 2:  # 5 and "5": two ids, two rows
        out[-1] = str(out[0]) if isinstance(out[0], int) else int(out[0])
        if id_key(out[-1]) in {id_key(v) for v in out[:-1]}:
            out[-1] = "tail"
    return out


# -- bad rows ----------------------------------------------------------------------------


def make_bad(rng: random.Random, row: dict[str, Any], kind: str, file_kind: str) -> dict[str, Any]:
    """`row` made into a bad row of `kind` (its id kept)."""
    row = dict(row)
    if kind == "empty_prompt":
        row["prompt"] = ""
    elif kind == "long_prompt":
        row["prompt"] = words(rng, LONG_PROMPT_WORDS)
    elif kind == "bad_sampling":
        row["sampling"] = {"temperature": -1.0 - rng.random()}
    elif kind == "bad_regex":
        row["regex"] = rng.choice(["(", "[a-", "a{2,1}"])
    elif kind == "bad_messages":
        row.pop("prompt", None)
        row["messages"] = rng.choice(["not a list", 5, {"role": "user"}]) if file_kind != "parquet" else "not a list"
    return row


# -- raw and JSON values -------------------------------------------------------------------


def json_value(rng: random.Random, huge: int) -> Any:
    """A JSON value of a random type (what a raw field or a JSONL field holds)."""
    pick = rng.random()
    if pick < 0.2:
        return rng.randrange(-(2**62), 2**62) if rng.random() < 0.2 else rng.randrange(-1000, 1000)
    if pick < 0.35:
        return rng.choice([0.5, -2.25, 1e20, 3.0, rng.random()])
    if pick < 0.6:
        return rng.choice(["", "n/a", words(rng, 3), "ünïcödé \u2028", "5"])
    if pick < 0.67:
        return rng.random() < 0.5
    if pick < 0.75:
        return None
    if pick < 0.85:
        return [rng.randrange(10) for _ in range(rng.randrange(4))]
    if pick < 0.97:
        return {"x": rng.randrange(10), "tags": [words(rng, 1)]}
    return huge_text(rng, huge)


def json_rows(rng: random.Random, n: int, huge: int) -> list[dict[str, Any]]:
    """Rows with a prompt and a few extra fields; a field's type may change row to row
    and a field may be absent from some rows."""
    fields = [f"f{i}" for i in range(rng.randrange(0, 5))]
    stable = {f: rng.random() < 0.5 for f in fields}  # half keep one type, half change
    first: dict[str, Any] = {}
    rows = []
    for _ in range(n):
        row: dict[str, Any] = {"prompt": words(rng, rng.randrange(1, 30))}
        for f in fields:
            if rng.random() < 0.15:
                continue  # absent here: null in this row
            if stable[f] and f in first:
                v = first[f]
                row[f] = (v + 1 if isinstance(v, int) and not isinstance(v, bool) else v)
            else:
                row[f] = json_value(rng, huge)
                first.setdefault(f, row[f])
        rows.append(row)
    return rows


# -- Parquet ---------------------------------------------------------------------------------

ARROW_TYPES = ("int64", "float64", "string", "large_string", "bool", "binary", "list", "struct", "timestamp")


def arrow_value(rng: random.Random, kind: str, huge: bool) -> Any:
    if rng.random() < 0.1:
        return None
    if kind == "int64":
        return rng.choice([0, -1, 2**63 - 1, -(2**63), rng.randrange(-(2**40), 2**40)])
    if kind == "float64":
        return rng.choice([0.0, -0.0, math.inf, -math.inf, math.nan, 1e-300, rng.uniform(-1e9, 1e9)])
    if kind in ("string", "large_string"):
        return huge_text(rng, HUGE_BYTES) if huge else rng.choice(["", words(rng, 4), "\x00nul", "😀 emoji"])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "binary":
        return rng.randbytes(HUGE_BYTES if huge else rng.randrange(0, 40))
    if kind == "list":
        return [rng.randrange(-5, 5) for _ in range(rng.randrange(0, 5))]
    if kind == "struct":
        return {"a": rng.randrange(100), "b": rng.choice(["", "s", None])}
    if kind == "timestamp":
        return rng.randrange(0, 2**50)
    raise ValueError(kind)


def arrow_type(kind: str) -> pa.DataType:
    return {"int64": pa.int64(), "float64": pa.float64(), "string": pa.string(), "large_string": pa.large_string(),
            "bool": pa.bool_(), "binary": pa.binary(), "list": pa.list_(pa.int64()),
            "struct": pa.struct([("a", pa.int64()), ("b", pa.string())]),
            "timestamp": pa.timestamp("us")}[kind]


# -- the draw --------------------------------------------------------------------------------


def draw(rng: random.Random, kind: str, *, max_rows: int = 200) -> Dataset:
    """A dataset of `kind` (`KINDS`) drawn from `rng`."""
    pick = rng.random()
    n = rng.randrange(1, 3) if pick < 0.1 else rng.randrange(3, 30) if pick < 0.5 else rng.randrange(30, max(31, max_rows + 1))
    features: list[str] = []
    huge = rng.random() < 0.25
    if huge:
        features.append("huge values")
    if kind == "parquet":
        id_mode = rng.choice(["int", "str", "none"])
        ids = list(range(n)) if id_mode == "none" else draw_ids(rng, n, id_mode)
        rows = [{"id": i, "prompt": words(rng, rng.randrange(1, 30))} for i in ids]
        columns = [(f"c{i}_{k}", k) for i, k in enumerate(rng.sample(ARROW_TYPES, rng.randrange(0, 5)))]
        huge_row = rng.randrange(n) if huge else -1
        for j, row in enumerate(rows):
            for name, k in columns:
                row[name] = arrow_value(rng, k, huge and j == huge_row and k in ("string", "large_string", "binary"))
        schema = pa.schema([("id", pa.int64() if id_mode != "str" else pa.string()), ("prompt", pa.string()),
                            *[(name, arrow_type(k)) for name, k in columns]])
        features.append(f"ids {id_mode}, {len(columns)} typed columns")
        bad_kinds = ("empty_prompt", "long_prompt", "bad_regex")
    else:
        id_mode = rng.choice(["int", "str", "mixed", "mixed"])
        ids = draw_ids(rng, n, id_mode)
        rows = [{"id": i, **row} for i, row in zip(ids, json_rows(rng, n, RAW_HUGE_BYTES if huge else 16))]
        schema, features = None, [*features, f"ids {id_mode}"]
        bad_kinds = BAD_KINDS
    ds = Dataset(kind, rows, schema=schema, has_id_column=kind != "parquet" or id_mode != "none", features=features)
    if rng.random() < 0.5 and n > 2:  # some bad rows
        for j in rng.sample(range(n), rng.randrange(1, min(n, 6))):
            bad = rng.choice(bad_kinds)
            rows[j] = make_bad(rng, rows[j], bad, kind)
            ds.bad.add(id_key(rows[j]["id"]))
            features.append(bad)
        if kind == "parquet":  # columns the bad rows brought: the rows without them hold null
            extra = [c for c in ("regex",) if any(c in r for r in rows)]
            ds.schema = schema.append(pa.field("regex", pa.string())) if extra else schema
    if kind == "raw":
        used = {id_key(i) for i in ids}
        if rng.random() < 0.4:
            for k in range(rng.randrange(1, 4)):
                mid = f"broken-{k}" if rng.random() < 0.5 else 10**9 + k
                if id_key(mid) not in used:
                    ds.malformed.append((mid, rng.choice([b'{"id": 1, "prompt": "cut', b"\xff\xfe", b"[1, 2", b"null"])))
            features.append(f"{len(ds.malformed)} malformed")
            if ds.malformed and rng.random() < 0.5:  # the first message malformed
                features.append("malformed first")
        if rng.random() < 0.3:
            ds.twice = rng.sample(range(n), min(n, rng.randrange(1, 4)))
            features.append(f"{len(ds.twice)} published twice")
    return ds


def write(ds: Dataset, path: Path) -> None:
    """The dataset as the input file `path` (Parquet or JSONL)."""
    if ds.kind == "parquet":
        assert ds.schema is not None
        cols = {f.name: [r.get(f.name) for r in ds.rows] for f in ds.schema}
        if not ds.has_id_column:
            cols.pop("id")
        schema = ds.schema if ds.has_id_column else pa.schema([f for f in ds.schema if f.name != "id"])
        import pyarrow.parquet as pq

        pq.write_table(pa.table(cols, schema=schema), path, row_group_size=max(1, len(ds.rows) // 3 or 1))
    elif ds.kind == "jsonl":
        with open(path, "w") as f:
            for row in ds.rows:
                f.write(json.dumps(row) + "\n")
    else:
        raise ValueError(f"{ds.kind} rows are published, not written")
