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

The benchmark shapes (`seed`, `zipf`, `hierarchical`, `variable`, `no-sharing`) are
generated as token ids by prefixflow/datagen/shapes.py (pure) from the same whole-word tokens; this module
turns them into text, checks the round trip, counts their ideal hit rate over the
re-encoded ids, writes the Parquet file and registers their subcommands. Their rows carry
a `sampling` column (`max_tokens` = `min_tokens` = `output_len`), the per-row sampling
the pipeline honours (prefixflow/shared/wire/sampling.py), so every method generates the same tokens.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from prefixflow.datagen import shapes
from prefixflow.shared.prefix.tokenize import load_tokenizer

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
    return shapes.prefix_repetition_ids(
        _whole_word_token_ids(tokenizer), num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len,
        num_prefixes=num_prefixes, seed=seed,
    )


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


# --- benchmark shapes (token ids from prefixflow/datagen/shapes.py) ----------------------------

SHAPE_SCHEMA = pa.schema(
    [
        *SCHEMA,
        ("sampling", pa.struct([("max_tokens", pa.int32()), ("min_tokens", pa.int32())])),
    ]
)
"""Prefix repetition's columns plus the per-row sampling the pipeline honours."""
CPU_BLOCK_SIZE = 128
"""vLLM CPU's KV block (and prefixflow's hash block, prefixflow/shared/prefix/block_keys.py)."""
GPU_BLOCK_SIZE = 16
"""vLLM's default KV block on GPUs."""


def build_shape(name: str, *, tokenizer_dir: str | Path, block_size: int = GPU_BLOCK_SIZE, inflight: int = 16,
                **params) -> pa.Table:
    """Generate shape ``name`` (prefixflow/datagen/shapes.py ``SHAPES``) with ``params`` as text rows.

    The schema metadata (``prefixflow.dataset``) holds the parameters, and at
    ``block_size``, 16 and 128 tokens: the ideal hit rate (``formula`` from the parameters,
    ``exact`` counted over the re-encoded ids, what the engines see), the shared working
    set in blocks and, for ``seed``, a suggested KV cap (`shapes.seed_kv_blocks`).
    """
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    tokenizer = load_tokenizer(str(tokenizer_dir))
    shape = shapes.SHAPES[name](_whole_word_token_ids(tokenizer), **params)
    prompts = tokenizer.decode_batch([ids.tolist() for ids in shape.token_ids], skip_special_tokens=False)
    encoded = [e.ids for e in tokenizer.encode_batch(prompts)] if prompts else []
    mismatches = sum(enc != ids.tolist() for enc, ids in zip(encoded, shape.token_ids, strict=True))
    encoded_ids = [np.asarray(ids, dtype=np.int64) for ids in encoded]

    metadata: dict = {"generator": name, **shape.params, "block_size": block_size, "round_trip_mismatches": mismatches}
    ideal, shared_blocks = {}, {}
    for size in sorted({block_size, GPU_BLOCK_SIZE, CPU_BLOCK_SIZE}):
        count = shapes.ideal_count(encoded_ids, size)
        ideal[str(size)] = {"formula": round(shape.formula(size), 6), "exact": round(count.hit_rate, 6)}
        shared_blocks[str(size)] = count.shared_blocks
    metadata |= {"ideal_hit_rate": ideal, "shared_blocks": shared_blocks,
                 "prompt_tokens": sum(map(len, encoded)), "output_tokens": int(shape.output_len.sum())}
    if name == "seed":
        metadata["shared_prefix_tokens"] = _shared_prefix_tokens(shape.prefix_id, encoded, default=shape.params["prefix_len"])
        kv_args = {k: shape.params[k] for k in ("num_prompts", "num_prefixes", "prefix_len", "suffix_len", "output_len")}
        metadata["inflight"] = inflight
        metadata["kv_cache_blocks"] = {
            str(size): shapes.seed_kv_blocks(**kv_args, block_size=size, inflight=inflight)
            for size in (GPU_BLOCK_SIZE, CPU_BLOCK_SIZE)
        }

    out_len = shape.output_len
    columns = {
        "id": np.arange(len(prompts), dtype=np.int64),
        "prompt": prompts,
        "prefix_id": shape.prefix_id,
        "prompt_len": np.array([len(ids) for ids in encoded], dtype=np.int32),
        "output_len": out_len,
        "sampling": pa.StructArray.from_arrays(
            [pa.array(out_len, pa.int32()), pa.array(out_len, pa.int32())], names=["max_tokens", "min_tokens"]
        ),
    }
    schema = SHAPE_SCHEMA.with_metadata({METADATA_KEY: json.dumps(metadata)})
    return pa.table(columns, schema=schema)


def write_shape(out_file: str | Path, name: str, **kwargs) -> pa.Table:
    """``build_shape(name, **kwargs)`` written to ``out_file`` (Parquet)."""
    table = build_shape(name, **kwargs)
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out_file)
    return table


def shape_summary(meta: dict) -> list[str]:
    """What `prefixflow dataset <shape>` prints: sizes, ideal hit rates, working set."""
    sizes = (f"{meta['generator']}: {meta['num_prompts']} prompts, {meta['prompt_tokens']:,} prompt tokens, "
             f"{meta['output_tokens']:,} output tokens (min_tokens = max_tokens per row)")
    lines = [sizes]
    if meta["round_trip_mismatches"]:
        lines.append(f"WARNING: {meta['round_trip_mismatches']} prompts do not re-encode to their token ids")
    lines.append("ideal hit rate, unbounded cache (formula from the parameters / counted over the token ids):")
    for size, rate in meta["ideal_hit_rate"].items():
        lines.append(f"  {int(size):4d}-token blocks: {rate['formula']:7.2%} / {rate['exact']:7.2%}")
    lines.append("shared working set (blocks held by 2+ prompts): "
                 + ", ".join(f"{n} of {size} tokens" for size, n in meta["shared_blocks"].items()))
    if "kv_cache_blocks" in meta:
        gpu, cpu = meta["kv_cache_blocks"][str(GPU_BLOCK_SIZE)], meta["kv_cache_blocks"][str(CPU_BLOCK_SIZE)]
        lines.append(
            f"KV cap: prefixes {gpu['prefix_blocks']} / {cpu['prefix_blocks']} blocks of {GPU_BLOCK_SIZE} / "
            f"{CPU_BLOCK_SIZE} tokens, a running request {gpu['request_blocks']} / {cpu['request_blocks']} more; "
            f"suggested --kv-cache-blocks {cpu['suggested']} on vLLM CPU ({CPU_BLOCK_SIZE}-token blocks), "
            f"{gpu['suggested']} with {GPU_BLOCK_SIZE}-token blocks (half the prefixes + {meta['inflight']} "
            "requests in flight per replica)"
        )
    return lines


OPTION_HELP = {
    "num_prompts": "rows",
    "num_prefixes": "distinct shared prefixes",
    "prefix_len": "tokens per shared prefix",
    "suffix_len": "unique tokens after the prefix",
    "output_len": "tokens generated per row (min_tokens = max_tokens)",
    "seed": "random seed",
    "zipf_s": "Zipf exponent: prefix k is drawn with weight 1 / (k + 1)^s",
    "system_len": "tokens of the global system prompt (every row)",
    "num_groups": "group prefixes (few-shot examples), rows spread evenly",
    "group_len": "tokens per group prefix",
    "question_len": "unique question tokens per row",
    "shared_fraction": "fraction of rows that start with a shared prefix",
    "unique_len_median": "median unique tokens per row (lognormal)",
    "unique_len_sigma": "sigma of the unique part's lognormal",
    "max_unique_len": "unique tokens per row, at most",
    "output_len_median": "median output tokens per row (lognormal)",
    "output_len_sigma": "sigma of the output length's lognormal",
    "max_output_len": "output tokens per row, at most",
    "prompt_len": "tokens per prompt",
}


def add_shape_parsers(sub) -> None:
    """One `prefixflow dataset <shape>` subcommand per shape; its flags are the
    generator's keyword arguments (defaults and types from its signature)."""
    from prefixflow.shared.process.config import DEFAULT_MODEL

    for name, generate in shapes.SHAPES.items():
        p = sub.add_parser(name, help=(generate.__doc__ or "").strip().splitlines()[0])
        for param in inspect.signature(generate).parameters.values():
            if param.kind is not inspect.Parameter.KEYWORD_ONLY:
                continue
            p.add_argument(f"--{param.name.replace('_', '-')}", type=type(param.default), default=param.default,
                           help=f"{OPTION_HELP[param.name]} (default {param.default})")
        p.add_argument("--block-size", type=int, default=GPU_BLOCK_SIZE,
                       help=f"engine KV block size for the ideal hit rate (also given at {GPU_BLOCK_SIZE} and "
                            f"{CPU_BLOCK_SIZE}; default {GPU_BLOCK_SIZE})")
        if name == "seed":
            p.add_argument("--inflight", type=int, default=16,
                           help="running requests per replica the suggested --kv-cache-blocks leaves room for (default 16)")
        p.add_argument("--model", default=DEFAULT_MODEL, help="model whose tokenizer turns token ids into text")
        p.add_argument("--out", required=True, help="output .parquet file")
        p.set_defaults(fn=cmd_shape, shape=name)


def cmd_shape(args) -> None:
    from prefixflow.datagen.make_model import make_model
    from prefixflow.shared.process.config import DEFAULT_MODEL

    if args.model == DEFAULT_MODEL:
        make_model(args.model)
    names = [n for n in inspect.signature(shapes.SHAPES[args.shape]).parameters if n != "words"]
    extra = {"inflight": args.inflight} if args.shape == "seed" else {}
    table = write_shape(args.out, args.shape, tokenizer_dir=args.model, block_size=args.block_size,
                        **extra, **{n: getattr(args, n) for n in names})
    print(f"wrote {table.num_rows} prompts to {args.out}")
    print("\n".join(shape_summary(dataset_metadata(table))))
