"""Synthetic prefix-repetition prompts (the shape of vLLM's PrefixRepetitionRandomDataset).

``num_prefixes`` random prefixes of ``prefix_len`` tokens are drawn; every prompt is one
prefix followed by ``suffix_len`` random tokens, and the rows are shuffled. Unlike vLLM's
version, the prompts are built so that the text round-trips through the tokenizer: token
ids are sampled only from "whole word" tokens (``Ġ`` + ASCII letters, i.e. a space plus a
word) that encode back to themselves. Decoding then gives `` word word ...`` and
re-encoding splits at the same word boundaries, so ``encode(decode(ids)) == ids`` and all
prompts of a prefix group share exactly the same token prefix, which is what prefix
caching needs. The number of prompts need not divide evenly: the remainder is spread
over the first prefixes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shared.prefix.tokenize import load_tokenizer

SCHEMA = pa.schema(
    [
        ("id", pa.int64()),
        ("prompt", pa.string()),
        ("prefix_id", pa.int32()),
        ("prompt_len", pa.int32()),
        ("output_len", pa.int32()),
    ]
)
METADATA_KEY = b"prefixflow.dataset"


def prefix_repetition(
    *,
    tokenizer_dir: str | Path,
    num_prompts: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 8,
    output_len: int = 128,
    seed: int = 0,
) -> pa.Table:
    """Generate the prompt table (columns: id, prompt, prefix_id, prompt_len, output_len).

    The generation parameters, plus ``shared_prefix_tokens`` (the shortest token prefix
    actually shared within a prefix group after re-encoding), are stored as JSON in the
    schema metadata under ``prefixflow.dataset``.
    """
    if num_prompts < 0 or prefix_len < 0 or suffix_len < 0 or output_len < 0:
        raise ValueError("num_prompts, prefix_len, suffix_len and output_len must be >= 0")
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    prefix_ids, token_ids = prefix_repetition_ids(
        tokenizer, num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, seed=seed,
    )
    prompts = tokenizer.decode_batch(token_ids.tolist(), skip_special_tokens=False)
    encoded = [e.ids for e in tokenizer.encode_batch(prompts)]

    metadata = {
        "generator": "prefix_repetition",
        "num_prompts": num_prompts,
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "num_prefixes": num_prefixes,
        "output_len": output_len,
        "seed": seed,
        "shared_prefix_tokens": _shared_prefix_tokens(prefix_ids, encoded, default=prefix_len),
    }
    columns = {
        "id": np.arange(num_prompts, dtype=np.int64),
        "prompt": prompts,
        "prefix_id": prefix_ids,
        "prompt_len": np.array([len(ids) for ids in encoded], dtype=np.int32),
        "output_len": np.full(num_prompts, output_len, dtype=np.int32),
    }
    schema = SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata)})
    return pa.table(columns, schema=schema)


def prefix_repetition_ids(
    tokenizer, *, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """The token ids behind ``prefix_repetition`` (same seed, same ids): the prefix group
    of each prompt and a (num_prompts, prefix_len + suffix_len) array, shuffled. Drawn
    from whole-word tokens, so they are exactly what the prompt text encodes to."""
    words = _whole_word_token_ids(tokenizer)
    rng = np.random.default_rng(seed)
    # Prompts per prefix: num_prompts // P each, the first num_prompts % P get one more.
    per_prefix = np.full(num_prefixes, num_prompts // num_prefixes)
    per_prefix[: num_prompts % num_prefixes] += 1
    prefixes = rng.choice(words, size=(num_prefixes, prefix_len))
    suffixes = rng.choice(words, size=(num_prompts, suffix_len))
    prefix_ids = np.repeat(np.arange(num_prefixes, dtype=np.int32), per_prefix)
    token_ids = np.concatenate([prefixes[prefix_ids], suffixes], axis=1)
    order = rng.permutation(num_prompts)
    return prefix_ids[order], token_ids[order]


SHAPE_ARGS = ("num_prompts", "prefix_len", "suffix_len", "num_prefixes", "output_len", "seed")


def shape_args(args) -> dict:
    """The generator's keyword arguments from a command line's parsed flags (those the
    command has)."""
    return {name: getattr(args, name) for name in SHAPE_ARGS if hasattr(args, name)}


def write_prefix_repetition(out_file: str | Path, **kwargs) -> pa.Table:
    """Generate with ``prefix_repetition(**kwargs)`` and write it to ``out_file`` (Parquet)."""
    table = prefix_repetition(**kwargs)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out_file)
    return table


def dataset_metadata(table: pa.Table) -> dict:
    """The generation parameters stored by ``prefix_repetition`` ({} if there are none)."""
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    return json.loads(raw) if raw else {}


def ideal_hit_rate(table: pa.Table, prefix_len: int | None = None, *, block_size: int) -> float:
    """Best possible prefix-cache hit rate (cached prompt tokens / all prompt tokens).

    In each prefix group every prompt but the first can reuse the shared prefix, but
    only in whole KV-cache blocks: ``(N - groups) * (prefix_len // block_size *
    block_size) / sum(prompt_len)``. ``prefix_len`` is the shared prefix length in
    tokens; by default it is read from the table's metadata (``shared_prefix_tokens``).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    if prefix_len is None:
        prefix_len = dataset_metadata(table).get("shared_prefix_tokens")
        if prefix_len is None:
            raise ValueError("table has no prefixflow metadata: pass prefix_len")
    total_tokens = pc.sum(table["prompt_len"]).as_py() or 0
    if total_tokens == 0:
        return 0.0
    groups = len(pc.unique(table["prefix_id"]))
    cached_per_prompt = prefix_len // block_size * block_size
    return (table.num_rows - groups) * cached_per_prompt / total_tokens


analytic_ideal_hit_rate = ideal_hit_rate


def _whole_word_token_ids(tokenizer) -> np.ndarray:
    """Ids of tokens that are a space plus ASCII letters and encode back to themselves."""
    special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    candidates = sorted(
        token_id
        for token, token_id in tokenizer.get_vocab().items()
        if token.startswith("Ġ") and token[1:].isascii() and token[1:].isalpha() and token not in special
    )
    texts = tokenizer.decode_batch([[t] for t in candidates])
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    words = [t for t, e in zip(candidates, encoded) if e.ids == [t]]
    if not words:
        raise ValueError("tokenizer has no whole-word ('Ġ' + letters) tokens to sample from")
    return np.array(words, dtype=np.int64)


def _shared_prefix_tokens(prefix_ids: np.ndarray, encoded: list[list[int]], default: int) -> int:
    """Shortest common token prefix within any prefix group of two or more prompts."""
    shared = None
    for group in np.unique(prefix_ids):
        members = [encoded[i] for i in np.flatnonzero(prefix_ids == group)]
        if len(members) < 2:
            continue
        n = min(len(ids) for ids in members)
        first = members[0]
        for ids in members[1:]:
            n = next((i for i in range(n) if ids[i] != first[i]), n)
        shared = n if shared is None else min(shared, n)
    return default if shared is None else shared
