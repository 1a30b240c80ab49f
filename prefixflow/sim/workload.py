"""What the simulated cluster runs: prompts as packed token ids, and their output lengths.

Prompts are the same packed big-endian uint32 bytes the services carry
(`prefixflow.shared.prefix.tokens`), so the product's bucketer, sharder and prefix groups see
exactly what they would see in production. Shapes:

- `seed`: the reference (200k prompts, a 256-token prefix drawn from 512, a 256-token
  unique suffix, 128 output tokens), vLLM's PrefixRepetitionRandomDataset shape;
- `prefix-repetition`: the same generator with any sizes (`prefixflow dataset
  prefix-repetition` writes this shape for real runs);
- `zipf`: prefix popularity Zipf-skewed (prefix k drawn with weight 1 / k^s), so a few
  prefixes dominate and a long tail of prefixes has a few prompts each;
- a Parquet/JSONL file with `prompt_token_ids` (or `prompt`, tokenized with `--model`'s
  tokenizer) and optionally `output_len` (else a `sampling` column's `max_tokens`).
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prefixflow.shared.outcomes import usage_error
from prefixflow.sim.engine import HASH_MASK

VOCAB = 151_000
"""Token ids are drawn below this (Qwen3's vocabulary size); only equality matters."""


@dataclass
class Workload:
    name: str
    tokens: list[bytes]
    """Packed token ids per prompt, in dataset (arrival) order."""
    output_len: np.ndarray
    group: np.ndarray | None = None
    """Prefix group of each prompt when the generator knows it (statistics only)."""
    meta: dict = field(default_factory=dict)
    lora: list[str] | None = None
    """LoRA adapter of each prompt ("": the base model; None: every prompt the base model)."""
    _hashes: dict[int, list] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def prompt_len(self, i: int) -> int:
        return len(self.tokens[i]) // 4

    def engine_hashes(self, block_size: int) -> list:
        """Per prompt, the chain hashes of its full engine blocks (as vLLM's prefix cache
        names a block by its parent's hash and its own tokens). Computed once per block
        size. Python's `hash` is enough: only equality within this process matters."""
        got = self._hashes.get(block_size)
        if got is None:
            step = block_size * 4
            got = []
            for i, t in enumerate(self.tokens):
                h = hash(self.lora[i]) & HASH_MASK if self.lora and self.lora[i] else 0  # an adapter's own chain
                out = array.array("q")
                for k in range(0, len(t) - step + 1, step):
                    h = hash((h, t[k : k + step])) & HASH_MASK
                    out.append(h)
                got.append(out)
            self._hashes[block_size] = got
        return got

    def total_prompt_tokens(self) -> int:
        return sum(len(t) for t in self.tokens) // 4

    def subset(self, n: int) -> Workload:
        return Workload(f"{self.name}[:{n}]", self.tokens[:n], self.output_len[:n],
                        None if self.group is None else self.group[:n], dict(self.meta),
                        None if self.lora is None else self.lora[:n])

    def with_adapters(self, n: int) -> Workload:
        """The same prompts spread over `n` LoRA adapters (`lora0` ...): prompt i under
        adapter i mod n, so every prefix group is split over the adapters."""
        lora = [f"lora{i % n}" for i in range(len(self.tokens))] if n else None
        return Workload(f"{self.name}+{n}lora" if n else self.name, self.tokens, self.output_len, self.group,
                        {**self.meta, "adapters": n}, lora)

    def lora_of(self, i: int) -> str:
        return self.lora[i] if self.lora else ""


def _pack_rows(ids: np.ndarray) -> list[bytes]:
    be = np.ascontiguousarray(ids.astype(">u4"))
    width = be.shape[1] * 4
    flat = be.tobytes()
    return [flat[i : i + width] for i in range(0, len(flat), width)]


def prefix_repetition(
    *,
    num_prompts: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 512,
    output_len: int = 128,
    seed: int = 0,
    zipf: float = 0.0,
) -> Workload:
    """`num_prefixes` random prefixes, each prompt one of them plus a random suffix,
    shuffled. With `zipf` > 0 the prefixes are drawn with weight 1 / rank^zipf (every
    prefix at least once while there are enough prompts); otherwise evenly (the first
    `num_prompts % num_prefixes` prefixes get one prompt more)."""
    rng = np.random.default_rng(seed)
    if zipf > 0:
        w = 1.0 / np.arange(1, num_prefixes + 1) ** zipf
        group = rng.choice(num_prefixes, size=num_prompts, p=w / w.sum()).astype(np.int32)
    else:
        per = np.full(num_prefixes, num_prompts // num_prefixes)
        per[: num_prompts % num_prefixes] += 1
        group = np.repeat(np.arange(num_prefixes, dtype=np.int32), per)
        rng.shuffle(group)
    prefixes = rng.integers(0, VOCAB, size=(num_prefixes, prefix_len), dtype=np.int64)
    suffixes = rng.integers(0, VOCAB, size=(num_prompts, suffix_len), dtype=np.int64)
    ids = np.concatenate([prefixes[group], suffixes], axis=1)
    name = f"{'zipf' if zipf else 'prefix-repetition'}-{num_prompts}x{prefix_len}+{suffix_len}-p{num_prefixes}-o{output_len}"
    meta = {"num_prompts": num_prompts, "prefix_len": prefix_len, "suffix_len": suffix_len,
            "num_prefixes": num_prefixes, "output_len": output_len, "seed": seed, "zipf": zipf}
    return Workload(name, _pack_rows(ids), np.full(num_prompts, output_len, dtype=np.int32), group, meta)


SEED = {"num_prompts": 200_000, "prefix_len": 256, "suffix_len": 256, "num_prefixes": 512, "output_len": 128}
"""The reference dataset (Daft's benchmark: vLLM PrefixRepetitionRandomDataset, 200k)."""


def seed_shape(scale: float = 1.0, seed: int = 0) -> Workload:
    """The reference shape; `scale` < 1 keeps the proportions with fewer prompts and
    prefixes (prompts per prefix unchanged)."""
    n = max(1, round(SEED["num_prompts"] * scale))
    p = max(1, round(SEED["num_prefixes"] * scale))
    w = prefix_repetition(num_prompts=n, prefix_len=256, suffix_len=256, num_prefixes=p, output_len=128, seed=seed)
    w.name = "seed" if scale == 1 else f"seed-x{scale:g}"
    return w


def zipf_shape(scale: float = 1.0, seed: int = 0, s: float = 1.1) -> Workload:
    """The seed's sizes with Zipf(s)-skewed prefix popularity over 4096 prefixes."""
    n = max(1, round(SEED["num_prompts"] * scale))
    p = max(1, round(4096 * scale))
    w = prefix_repetition(num_prompts=n, prefix_len=256, suffix_len=256, num_prefixes=p, output_len=128, seed=seed, zipf=s)
    w.name = f"zipf{s:g}" if scale == 1 else f"zipf{s:g}-x{scale:g}"
    return w


def hierarchical_shape(scale: float = 1.0, seed: int = 0) -> Workload:
    """The seed's sizes with two levels of sharing, as in labelling jobs: one 128-token
    system prompt for every row, then one of 512 group prefixes of 128 tokens (its
    few-shot examples; rows spread evenly), then a 256-token question of its own."""
    n = max(1, round(SEED["num_prompts"] * scale))
    g = max(1, round(SEED["num_prefixes"] * scale))
    rng = np.random.default_rng(seed)
    system = rng.integers(0, VOCAB, size=128, dtype=np.int64)
    groups_prefix = rng.integers(0, VOCAB, size=(g, 128), dtype=np.int64)
    per = np.full(g, n // g)
    per[: n % g] += 1
    group = np.repeat(np.arange(g, dtype=np.int32), per)
    rng.shuffle(group)
    questions = rng.integers(0, VOCAB, size=(n, 256), dtype=np.int64)
    ids = np.concatenate([np.broadcast_to(system, (n, 128)), groups_prefix[group], questions], axis=1)
    name = "hierarchical" if scale == 1 else f"hierarchical-x{scale:g}"
    meta = {"num_prompts": n, "system_len": 128, "num_groups": g, "group_len": 128, "question_len": 256,
            "output_len": 128, "seed": seed}
    return Workload(name, _pack_rows(ids), np.full(n, 128, dtype=np.int32), group, meta)


def from_file(path: str | Path, *, model: str | None = None, output_len: int = 128) -> Workload:
    """Prompts from Parquet or JSONL: `prompt_token_ids`, or `prompt` text tokenized
    with `model`'s tokenizer; `output_len` per row if the column exists."""
    import pyarrow as pa
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    path = Path(path)
    table: pa.Table = pj.read_json(path) if path.suffix in (".jsonl", ".json") else pq.read_table(path)
    cols = table.column_names
    if "prompt_token_ids" in cols:
        ids = table.column("prompt_token_ids").to_pylist()
    elif "prompt" in cols:
        from prefixflow.datagen.make_model import make_model
        from prefixflow.shared.prefix.tokenize import load_tokenizer
        from prefixflow.shared.process.config import DEFAULT_MODEL

        model = model or DEFAULT_MODEL
        if model == DEFAULT_MODEL:
            make_model(model)
        tok = load_tokenizer(model)
        ids = [e.ids for e in tok.encode_batch(table.column("prompt").to_pylist())]
    else:
        raise usage_error(f"{path}: needs a prompt_token_ids or prompt column")
    tokens = []
    for row in ids:
        a = array.array("I", row)
        if sys.byteorder == "little":
            a.byteswap()
        tokens.append(a.tobytes())
    if "output_len" in cols:
        out = np.asarray(table.column("output_len").to_numpy(zero_copy_only=False), dtype=np.int32)
    elif "sampling" in cols:  # a real job's per-row sampling: its max_tokens, else the default
        rows = [r or {} for r in table.column("sampling").to_pylist()]
        out = np.array([r.get("max_tokens") or r.get("max_completion_tokens") or output_len for r in rows], dtype=np.int32)
    else:
        out = np.full(len(tokens), output_len, dtype=np.int32)
    group = None
    if "prefix_id" in cols:
        group = np.asarray(table.column("prefix_id").to_numpy(zero_copy_only=False), dtype=np.int32)
    lora = [x or "" for x in table.column("lora").to_pylist()] if "lora" in cols else None
    return Workload(path.stem, tokens, out, group, {"source": str(path)}, lora)
