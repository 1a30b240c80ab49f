"""Inputs as files, directories and globs (`prefixflow/client/sources.py`), read shard by
shard (`prefixflow/client/readers.py`, `columns.chunks`): which files, in which order, and
row ids that number across the shards, so a resume of a directory skips exactly what is
done."""

from __future__ import annotations

import json
import posixpath
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.client import columns, readers
from prefixflow.client.fingerprint import of_input, of_job, of_source, sampled
from prefixflow.client.sources import InputError, format_of, glob_regex, order, parse_options, resolve, stem_of
from prefixflow.client.submit import count_rows
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.fingerprint import difference
from tests.tiers import COSTLY

names = st.text(alphabet="ab_.-0", min_size=1, max_size=4).filter(lambda n: n not in (".", ".."))
suffixes = st.sampled_from([".parquet", ".jsonl", ".csv", ".csv.gz", ".txt", ".crc", ""])
paths = st.lists(st.tuples(st.lists(names, max_size=2), names, suffixes), max_size=12)


def visible_data(rel: str) -> bool:
    return (all(not p.startswith((".", "_")) for p in rel.split("/"))
            and format_of(posixpath.basename(rel)) is not None)


def materialise(root: Path, tree: list[tuple[list[str], str, str]]) -> set[str]:
    """Write the files of `tree` under `root`; their relative paths."""
    made = set()
    for folders, name, suffix in tree:
        rel = "/".join([*folders, name + suffix])
        target = root / rel
        if any(p.is_file() for p in [root.joinpath(*folders[: i + 1]) for i in range(len(folders))]) or target.is_dir():
            continue  # a folder name taken by a file (or the reverse)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(b"x")
        made.add(rel)
    return made


@COSTLY
@given(paths)
def test_a_directory_is_its_visible_data_files_in_name_order(tree):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "in"
        root.mkdir()
        made = materialise(root, tree)
        want = sorted(r for r in made if visible_data(r))
        if not want:
            with pytest.raises(InputError, match="no data files"):
                resolve(root)
            return
        source = resolve(root)
        assert [s.name for s in source.shards] == want
        assert not source.single and [s.path for s in source.shards] == [str(root / r) for r in want]
        assert [s.name for s in resolve(f"file://{root}/").shards] == want
        flat = sorted(r for r in want if "/" not in r and r.endswith(".parquet"))
        if flat:
            assert [s.name for s in resolve(f"{root}/*.parquet").shards] == flat
        assert [s.name for s in resolve(f"{root}/**").shards] == want


@given(st.lists(st.sampled_from(["a", "b", "_c", ".d", "e.parquet", "f.jsonl", "_g.csv", "x/h.csv", ".y/i.csv"]),
                unique=True))
def test_order_keeps_visible_data_files_sorted(rels):
    assert order(rels) == sorted(r for r in rels if visible_data(r))


@pytest.mark.parametrize("pattern, name, hit", [
    ("*.parquet", "a.parquet", True), ("*.parquet", "x/a.parquet", False), ("**/*.parquet", "x/y/a.parquet", True),
    ("**/*.parquet", "a.parquet", True), ("day=?/p-*.jsonl", "day=1/p-0.jsonl", True),
    ("day=?/p-*.jsonl", "day=12/p-0.jsonl", False), ("[ab].csv", "b.csv", True), ("[!ab].csv", "b.csv", False),
    ("a+b.csv", "a+b.csv", True), ("a+b.csv", "aab.csv", False),
])
def test_glob_patterns(pattern, name, hit):
    assert bool(glob_regex(pattern).match(name)) is hit


def test_bad_inputs_say_what_is_wrong(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match="no such file or directory"):
        resolve(tmp_path / "missing")
    with pytest.raises(InputError, match="want a Parquet"):
        resolve(tmp_path / "notes.txt")
    with pytest.raises(InputError, match="no data file matches"):
        resolve(f"{tmp_path}/*.parquet")
    with pytest.raises(InputError, match="no such file"):
        resolve(f"{tmp_path}/nothere/*.parquet")
    with pytest.raises(InputError, match="no file system for zz://"):
        resolve("zz://bucket/x")
    with pytest.raises(InputError, match="applies to a URI"):
        resolve(tmp_path, {"region": "x"})
    with pytest.raises(InputError, match="KEY=VALUE"):
        parse_options(["region"])
    assert parse_options(["region=eu-west-1", "anonymous=true", "connect_timeout=5"]) == {
        "region": "eu-west-1", "anonymous": True, "connect_timeout": 5}


def test_stem_of_names_the_input():
    assert [stem_of(t) for t in ("data/prompts.parquet", "s3://b/shards/", "shards/*.parquet", "s3://b",
                                 "gs://b/x/day-*/p.jsonl")] == ["prompts", "shards", "shards", "b", "x"]


def write_shards(root: Path, sizes: list[int], formats: list[str], with_id: bool) -> list[dict]:
    """Shards of `sizes` rows in `formats` (names in order); the rows written."""
    root.mkdir(parents=True, exist_ok=True)
    rows, first = [], 0
    for i, (n, fmt) in enumerate(zip(sizes, formats)):
        shard = [{"prompt": f"p{first + k}", **({"id": f"id-{first + k}"} if with_id else {})} for k in range(n)]
        rows.extend(shard)
        path = root / f"part-{i:03d}.{fmt}"
        if fmt == "parquet":
            pq.write_table(pa.Table.from_pylist(shard, pa.schema([("prompt", pa.string())] + ([("id", pa.string())] if with_id else []))), path)
        elif fmt == "jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in shard))
        else:
            path.write_text(("prompt,id\n" if with_id else "prompt\n")
                            + "".join(f"{r['prompt']}{',' + r['id'] if with_id else ''}\n" for r in shard))
        first += n
    return rows


@COSTLY
@given(st.lists(st.tuples(st.integers(1, 9000), st.sampled_from(["parquet", "jsonl", "csv"])), min_size=1, max_size=4),
       st.booleans())
def test_ids_number_across_the_shards_and_chunks_follow_them(shards, with_id):
    sizes, formats = [s for s, _ in shards], [f for _, f in shards]
    with tempfile.TemporaryDirectory() as tmp:
        rows = write_shards(Path(tmp) / "in", sizes, formats, with_id)
        if len(sizes) == 1:  # a file among others too: the same ids as a directory of one
            assert [c.ids for c in columns.chunks(Path(tmp) / "in" / f"part-000.{formats[0]}")] == \
                [c.ids for c in columns.chunks(Path(tmp) / "in")]
        chunks = list(columns.chunks(Path(tmp) / "in"))
        ids = [i for c in chunks for i in c.ids]
        assert ids == ([r["id"] for r in rows] if with_id else list(range(sum(sizes))))
        assert [c.src for c in chunks] == list(range(len(chunks)))
        assert all(len(c.ids) <= columns.CHUNK_ROWS for c in chunks)
        assert [r["prompt"] for c in chunks for r in c.rows] == [r["prompt"] for r in rows]
        assert count_rows(Path(tmp) / "in") == (sum(sizes) if set(formats) == {"parquet"} else None)


def test_an_id_column_in_some_shards_only_is_refused(tmp_path):
    write_shards(tmp_path / "in", [3], ["parquet"], True)
    pq.write_table(pa.table({"prompt": ["x"]}), tmp_path / "in" / "part-001.parquet")
    with pytest.raises(InputError, match="part-000.parquet has an 'id' column and part-001.parquet has none"):
        count_rows(tmp_path / "in")
    (tmp_path / "in" / "part-001.parquet").unlink()
    (tmp_path / "in" / "part-001.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(InputError, match="has none"):
        list(columns.chunks(tmp_path / "in"))


def test_a_csv_column_is_typed_over_the_whole_file(tmp_path):
    """pyarrow alone types a CSV by its first block; the reader joins every batch's types
    by the widening rules: int then float -> float64, int then text -> text, huge int +
    float -> text, all empty -> text."""
    n = 3 * readers.CHUNK_ROWS
    body = "".join(f"p{i},{i},{i},{2**60 if i == 0 else i},\n" for i in range(n - 1))
    path = tmp_path / "in.csv"
    path.write_text("prompt,f,s,w,e\n" + body + "last,2.5,word,0.5,\n")
    source = resolve(path)
    schema = readers.csv_schema(source.shards[0])
    assert [schema.field(c).type for c in "fswe"] == [pa.float64(), pa.string(), pa.string(), pa.string()]
    table = pa.concat_tables(pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b
                             for b, _ in readers.batches(source.shards[0]))
    assert table.num_rows == n and table.column("f").to_pylist()[-2:] == [n - 2.0, 2.5]
    assert table.column("w").to_pylist()[0] == str(2**60) and table.column("s").to_pylist()[-1] == "word"


def test_a_dataset_fingerprint_is_its_content_not_its_place(tmp_path):
    spec = m.JobSpec(job="j", out_dir="/o", sampling=m.SamplingSpec())
    write_shards(tmp_path / "a", [5, 7, 2], ["parquet", "jsonl", "csv"], False)
    write_shards(tmp_path / "b" / "deeper", [5, 7, 2], ["parquet", "jsonl", "csv"], False)
    fa, fb = of_source(resolve(tmp_path / "a")), of_source(resolve(tmp_path / "b" / "deeper"))
    assert fa == fb and fa["kind"] == "dataset" and fa["files"] == 3
    assert of_source(resolve(f"{tmp_path}/a/part-*")) == fa, "a glob of the same files is the same input"
    (tmp_path / "b" / "deeper" / "part-002.csv").write_text("prompt\nq12\nq13\n")  # one shard's content
    assert difference(of_job(tmp_path / "a", spec), of_job(tmp_path / "b" / "deeper", spec)) == \
        "input: another input (the same size, other content)"
    (tmp_path / "b" / "deeper" / "part-002.csv").rename(tmp_path / "b" / "deeper" / "part-009.csv")  # a name
    assert of_source(resolve(tmp_path / "b" / "deeper"))["digest"] != fa["digest"]
    (tmp_path / "b" / "deeper" / "part-009.csv").unlink()
    assert difference(of_job(tmp_path / "a", spec), of_job(tmp_path / "b" / "deeper", spec)) == \
        "input: another input (a dataset of 2 files, not a dataset of 3 files)"
    one = tmp_path / "a" / "part-000.parquet"
    assert of_source(resolve(one)) == of_input(one), "a single file: as before"


@given(st.integers(0, 10_000))
def test_a_dataset_samples_the_first_and_last_files_evenly(n):
    got = sampled(n, 64)
    assert got == sorted(set(got)) and all(0 <= i < n for i in got)
    assert len(got) == min(n, 64) and (n == 0 or (got[0] == 0 and got[-1] == n - 1))
