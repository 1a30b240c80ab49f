"""cli.dataset: prefix-repetition prompts that keep their shared token prefix."""

from __future__ import annotations

import collections

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cli.dataset import (
    SCHEMA,
    dataset_metadata,
    ideal_hit_rate,
    prefix_repetition,
    write_prefix_repetition,
)
from cli.make_model import make_model

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
    from cli.dataset import prefix_repetition_ids

    shape = dict(num_prompts=40, prefix_len=12, suffix_len=5, num_prefixes=3, seed=4)
    table = prefix_repetition(tokenizer_dir=dataset_tokenizer_dir, output_len=2, **shape)
    tok = tokenizer
    groups, ids = prefix_repetition_ids(tok, **shape)
    assert ids.shape == (40, 17)
    assert [e.ids for e in tok.encode_batch(table["prompt"].to_pylist())] == ids.tolist()
    assert groups.tolist() == table["prefix_id"].to_pylist()
