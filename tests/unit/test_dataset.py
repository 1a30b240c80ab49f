"""prefixflow.datagen.dataset: prefix-repetition prompts that keep their shared token prefix."""

from __future__ import annotations

import collections

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from prefixflow.datagen.dataset import (
    SCHEMA,
    dataset_metadata,
    ideal_hit_rate,
    prefix_repetition,
    write_prefix_repetition,
)
from prefixflow.datagen.make_model import make_model

pytestmark = pytest.mark.unit


@pytest.fixture(scope="session")
def dataset_tokenizer_dir(tmp_path_factory):
    # Same path and arguments as test_make_model's fixture: built once per session.
    return make_model(tmp_path_factory.getbasetemp() / "prefixflow-tiny-llama")


@pytest.fixture(scope="session")
def tokenizer(dataset_tokenizer_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(dataset_tokenizer_dir / "tokenizer.json"))


def _make(tok_dir, **kwargs):
    args = dict(num_prompts=103, prefix_len=64, suffix_len=32, num_prefixes=8, output_len=16, seed=0)
    return prefix_repetition(tokenizer_dir=tok_dir, **{**args, **kwargs})


def test_rows_ids_and_schema(dataset_tokenizer_dir):
    table = _make(dataset_tokenizer_dir)
    assert table.schema.remove_metadata() == SCHEMA
    assert table.num_rows == 103
    assert table["id"].to_pylist() == list(range(103))
    counts = collections.Counter(table["prefix_id"].to_pylist())
    assert sorted(counts) == list(range(8))
    assert sorted(counts.values()) == [12] * 1 + [13] * 7  # 103 = 8 * 12 + 7
    assert set(table["output_len"].to_pylist()) == {16}
    # shuffled: prefix groups are not laid out in blocks
    assert table["prefix_id"].to_pylist() != sorted(table["prefix_id"].to_pylist())


def test_groups_share_token_prefix(dataset_tokenizer_dir, tokenizer):
    table = _make(dataset_tokenizer_dir)
    first_by_group: dict[int, list[int]] = {}
    for row in table.to_pylist():
        ids = tokenizer.encode(row["prompt"]).ids
        assert row["prompt_len"] == len(ids) == 64 + 32  # exact: encode(decode(ids)) == ids
        assert tokenizer.decode(ids) == row["prompt"]
        first = first_by_group.setdefault(row["prefix_id"], ids)
        assert ids[:64] == first[:64]
    prefixes = {tuple(ids[:64]) for ids in first_by_group.values()}
    assert len(prefixes) == 8  # distinct prefixes per group
    assert dataset_metadata(table)["shared_prefix_tokens"] == 64


def test_default_lengths(dataset_tokenizer_dir):
    table = prefix_repetition(tokenizer_dir=dataset_tokenizer_dir, num_prompts=16)
    lens = table["prompt_len"].to_pylist()
    assert all(abs(n - 512) <= 8 for n in lens)
    assert set(table["output_len"].to_pylist()) == {128}


def test_deterministic_per_seed(dataset_tokenizer_dir):
    a = _make(dataset_tokenizer_dir, seed=7)
    b = _make(dataset_tokenizer_dir, seed=7)
    c = _make(dataset_tokenizer_dir, seed=8)
    assert a.equals(b, check_metadata=True)
    assert a["prompt"].to_pylist() != c["prompt"].to_pylist()
    assert set(a["prompt"].to_pylist()).isdisjoint(c["prompt"].to_pylist())


def test_fewer_prompts_than_prefixes(dataset_tokenizer_dir):
    table = _make(dataset_tokenizer_dir, num_prompts=3)
    assert table.num_rows == 3
    assert sorted(table["prefix_id"].to_pylist()) == [0, 1, 2]
    assert ideal_hit_rate(table, block_size=16) == 0.0
    assert _make(dataset_tokenizer_dir, num_prompts=0).num_rows == 0


def test_bad_arguments(dataset_tokenizer_dir):
    with pytest.raises(ValueError):
        _make(dataset_tokenizer_dir, num_prefixes=0)
    with pytest.raises(ValueError):
        _make(dataset_tokenizer_dir, num_prompts=-1)


def test_write_parquet(dataset_tokenizer_dir, tmp_path):
    out = tmp_path / "nested" / "dir" / "prompts.parquet"
    table = write_prefix_repetition(out, tokenizer_dir=dataset_tokenizer_dir, num_prompts=20,
                                    prefix_len=32, suffix_len=16, num_prefixes=4)
    read = pq.read_table(out)
    assert read.equals(table)
    assert dataset_metadata(read)["prefix_len"] == 32


def test_ideal_hit_rate_by_hand():
    table = pa.table({"prefix_id": pa.array([0, 0, 0, 1, 1], pa.int32()),
                      "prompt_len": pa.array([100] * 5, pa.int32())})
    # 2 groups -> 3 prompts reuse floor(40 / 16) * 16 = 32 tokens, of 500 in total
    assert ideal_hit_rate(table, 40, block_size=16) == pytest.approx(3 * 32 / 500)
    assert ideal_hit_rate(table, 40, block_size=64) == 0.0  # prefix shorter than a block
    with pytest.raises(ValueError):
        ideal_hit_rate(table, block_size=16)  # no metadata -> prefix_len required


def test_ideal_hit_rate_from_metadata(dataset_tokenizer_dir):
    table = _make(dataset_tokenizer_dir, num_prompts=16, prefix_len=256, suffix_len=256, num_prefixes=4)
    # vLLM CPU uses 128-token blocks: 12 of 16 prompts hit 256 of their 512 tokens
    assert ideal_hit_rate(table, block_size=128) == pytest.approx(12 * 256 / (16 * 512))
    assert ideal_hit_rate(table, block_size=96) == pytest.approx(12 * 192 / (16 * 512))


def test_prefix_repetition_ids_are_what_the_prompts_encode_to(dataset_tokenizer_dir, tokenizer):
    from prefixflow.datagen.dataset import prefix_repetition_ids

    shape = dict(num_prompts=40, prefix_len=12, suffix_len=5, num_prefixes=3, seed=4)
    table = prefix_repetition(tokenizer_dir=dataset_tokenizer_dir, output_len=2, **shape)
    tok = tokenizer
    groups, ids = prefix_repetition_ids(tok, **shape)
    assert ids.shape == (40, 17)
    assert [e.ids for e in tok.encode_batch(table["prompt"].to_pylist())] == ids.tolist()
    assert groups.tolist() == table["prefix_id"].to_pylist()


# --- benchmark shapes (prefixflow/datagen/shapes.py) as text rows ---------------------------

SMALL = {
    "seed": dict(num_prompts=60, num_prefixes=6, prefix_len=48, suffix_len=20, output_len=7),
    "zipf": dict(num_prompts=80, num_prefixes=12, prefix_len=48, suffix_len=20, output_len=5),
    "hierarchical": dict(num_prompts=60, system_len=40, num_groups=4, group_len=24, question_len=9, output_len=6),
    "variable": dict(num_prompts=80, num_prefixes=4, prefix_len=40, unique_len_median=30.0, max_unique_len=90,
                     output_len_median=8.0, max_output_len=20),
    "no-sharing": dict(num_prompts=30, prompt_len=40, output_len=4),
}


@pytest.fixture(scope="module")
def shape_tables(dataset_tokenizer_dir):
    from prefixflow.datagen.dataset import build_shape

    return {name: build_shape(name, tokenizer_dir=dataset_tokenizer_dir, **params) for name, params in SMALL.items()}


@pytest.mark.parametrize("name", list(SMALL))
def test_shape_text_round_trips(name, shape_tables, tokenizer):
    from prefixflow.datagen.dataset import SHAPE_SCHEMA

    table = shape_tables[name]
    meta = dataset_metadata(table)
    assert table.schema.remove_metadata() == SHAPE_SCHEMA
    assert table["id"].to_pylist() == list(range(SMALL[name]["num_prompts"]))
    assert meta["generator"] == name and meta["round_trip_mismatches"] == 0
    rows = table.to_pylist()
    encoded = [e.ids for e in tokenizer.encode_batch([r["prompt"] for r in rows])]
    assert [len(ids) for ids in encoded] == table["prompt_len"].to_pylist()
    assert [tokenizer.decode(ids) for ids in encoded] == [r["prompt"] for r in rows]
    assert meta["prompt_tokens"] == sum(map(len, encoded))
    for row in rows:  # the per-row sampling the pipeline reads: exactly output_len tokens
        assert row["sampling"] == {"max_tokens": row["output_len"], "min_tokens": row["output_len"]}


@pytest.mark.parametrize("name", list(SMALL))
def test_shape_groups_share_token_prefixes_after_reencoding(name, shape_tables, tokenizer):
    table = shape_tables[name]
    shared = {"seed": 48, "zipf": 48, "hierarchical": 64, "variable": 40, "no-sharing": 0}[name]
    groups: dict[int, list[list[int]]] = collections.defaultdict(list)
    for row in table.to_pylist():
        groups[row["prefix_id"]].append(tokenizer.encode(row["prompt"]).ids)
    firsts = {g: members[0] for g, members in groups.items() if g != -1}
    for g, first in firsts.items():
        assert all(ids[:shared] == first[:shared] for ids in groups[g])
    assert len({tuple(ids[:shared]) for ids in firsts.values()}) == len(firsts)  # groups differ
    if name == "hierarchical":  # the system prompt is every row's
        assert len({tuple(ids[:40]) for members in groups.values() for ids in members}) == 1
    if name in ("variable", "no-sharing"):
        unshared = groups[-1]
        assert unshared and len({tuple(ids[:4]) for ids in unshared}) == len(unshared)


@pytest.mark.parametrize("name", list(SMALL))
def test_shape_ideal_stored(name, shape_tables):
    meta = dataset_metadata(shape_tables[name])
    assert set(meta["ideal_hit_rate"]) == {"16", "128"}
    for rate in meta["ideal_hit_rate"].values():
        assert rate["exact"] == pytest.approx(rate["formula"], abs=0.04)  # small rows: Zipf draws, lognormal lengths
    if name in ("seed", "hierarchical", "no-sharing"):  # nothing random in what is shared
        assert meta["ideal_hit_rate"]["16"]["exact"] == meta["ideal_hit_rate"]["16"]["formula"]


def test_seed_keeps_prefix_repetition_metadata(shape_tables):
    table = shape_tables["seed"]
    meta = dataset_metadata(table)
    assert meta["shared_prefix_tokens"] == 48
    # the older helper (bench methods) gives the same ideal as the count
    assert ideal_hit_rate(table, block_size=16) == pytest.approx(meta["ideal_hit_rate"]["16"]["exact"])
    assert meta["kv_cache_blocks"]["128"] == {"prefix_blocks": 0, "request_blocks": 1, "suggested": 16}
    assert meta["kv_cache_blocks"]["16"] == {"prefix_blocks": 18, "request_blocks": 2, "suggested": 41}


def test_rows_sampling_is_what_the_ingestor_applies(shape_tables):
    from prefixflow.shared.wire.messages import SamplingSpec
    from prefixflow.shared.wire.sampling import row_sampling

    job = SamplingSpec(max_tokens=16)
    for row in shape_tables["variable"].to_pylist():
        spec = row_sampling(job, row)
        assert (spec.max_tokens, spec.min_tokens) == (row["output_len"], row["output_len"])


def test_shape_command(dataset_tokenizer_dir, tmp_path, capsys):
    from prefixflow.cli.main import build_parser

    out = tmp_path / "h.parquet"
    args = build_parser().parse_args(
        ["dataset", "hierarchical", "--num-prompts", "40", "--num-groups", "4", "--system-len", "32",
         "--group-len", "32", "--question-len", "16", "--block-size", "32",
         "--model", str(dataset_tokenizer_dir), "--out", str(out)]
    )
    args.fn(args)
    printed = capsys.readouterr().out
    meta = dataset_metadata(pq.read_table(out))
    assert (meta["num_prompts"], meta["num_groups"], meta["block_size"]) == (40, 4, 32)
    assert set(meta["ideal_hit_rate"]) == {"16", "32", "128"}
    # (36 rows x 64 + 3 first-of-group rows x 32 cached tokens) / (40 x 80)
    assert meta["ideal_hit_rate"]["32"] == {"formula": round((36 * 64 + 3 * 32) / 3200, 6),
                                           "exact": round((36 * 64 + 3 * 32) / 3200, 6)}
    assert "wrote 40 prompts" in printed and "75.00%" in printed
