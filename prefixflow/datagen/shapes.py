"""Benchmark dataset shapes: their token ids and their ideal prefix-cache hit rate.

Pure: no I/O, no tokenizer, no vLLM. Every generator takes ``words``, the token ids it may
draw from (`prefixflow dataset` passes the tokenizer's whole-word tokens so the prompt
text round-trips exactly: see prefixflow/datagen/dataset.py), and returns a `Shape`: per row its token
ids, prefix group (-1: shares nothing) and output length, plus the shape's parameters and
the formula for its ideal hit rate.

The ideal hit rate is the best any cluster can reach with an unbounded prefix cache: each
distinct shared prefix is computed once and every later prompt that starts with it reuses
it, counted the way vLLM counts: only full blocks of ``block_size`` tokens are cached, and
the last prompt token is always computed (a prompt of L tokens reuses at most
(L - 1) // block_size blocks). Each shape gives it twice:

- ``Shape.formula(block_size)``: from the parameters alone (an expectation where the shape
  draws at random: which Zipf prefix a row gets, lognormal lengths);
- ``ideal_count(shape.token_ids, block_size)``: counted over the generated ids.

The unit tests hold the two together (tests/unit/test_shapes.py).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes

NO_PREFIX = -1
"""`prefix_id` of a row that shares no prefix with any other."""


@dataclass(frozen=True)
class Shape:
    name: str
    token_ids: list[np.ndarray]
    """Per row, its prompt's token ids (row order = dataset order)."""
    prefix_id: np.ndarray
    """Per row, its prefix group (int32; `NO_PREFIX` when it shares nothing)."""
    output_len: np.ndarray
    """Per row, the tokens to generate (int32; the dataset asks min = max = this)."""
    params: dict[str, Any]
    """The generator's arguments (stored in the dataset's metadata)."""
    formula: Callable[[int], float]
    """block_size -> the ideal hit rate computed from `params` alone."""


@dataclass(frozen=True)
class IdealCount:
    """The unbounded-cache count over generated token ids, at one block size."""

    block_size: int
    cached_tokens: int
    """Prompt tokens the best cluster serves from its prefix cache."""
    prompt_tokens: int
    shared_blocks: int
    """Distinct full blocks held by two or more prompts: the KV blocks a cluster must keep
    to reach the ideal (its shared working set)."""

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def cached_tokens(shared: int, prompt_len: int, block_size: int) -> int:
    """Tokens vLLM reuses of a `prompt_len`-token prompt whose first `shared` tokens are
    in its cache: whole blocks only, and never the last prompt token."""
    return max(0, min(shared, prompt_len - 1)) // block_size * block_size


def ideal_count(token_ids: Sequence[np.ndarray], block_size: int) -> IdealCount:
    """Count the ideal over actual ids: prompts shortest first, each reusing the leading
    blocks an earlier prompt stored. Why shortest first: with an unbounded cache the only
    order effect is the last-token rule (a prompt that is exactly some blocks of another
    cannot reuse its own last block), and a prompt ending on a block boundary is shorter
    than every prompt that extends past that block, so this order is the best one."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    stored: Counter[int] = Counter()
    cached = total = 0
    for ids in sorted(token_ids, key=len):  # stable: ties keep dataset order
        hashes = block_hashes(tk.pack(np.asarray(ids).tolist()), block_size)
        limit = min(len(hashes), (len(ids) - 1) // block_size)
        hit = 0
        while hit < limit and hashes[hit] in stored:
            hit += 1
        cached += hit * block_size
        total += len(ids)
        stored.update(hashes)
    shared = sum(1 for n in stored.values() if n > 1)
    return IdealCount(block_size, cached, total, shared)


# --- the shapes ---------------------------------------------------------------------------


def prefix_repetition_ids(
    words: np.ndarray, *, num_prompts: int, prefix_len: int, suffix_len: int, num_prefixes: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's PrefixRepetitionRandomDataset: ``num_prefixes`` random prefixes, each prompt
    one of them (evenly: the first num_prompts % P get one prompt more) plus a random
    suffix, shuffled. Returns (prefix group per row, (num_prompts, prefix + suffix) ids)."""
    rng = np.random.default_rng(seed)
    per_prefix = np.full(num_prefixes, num_prompts // num_prefixes)
    per_prefix[: num_prompts % num_prefixes] += 1
    prefixes = rng.choice(words, size=(num_prefixes, prefix_len))
    suffixes = rng.choice(words, size=(num_prompts, suffix_len))
    prefix_ids = np.repeat(np.arange(num_prefixes, dtype=np.int32), per_prefix)
    token_ids = np.concatenate([prefixes[prefix_ids], suffixes], axis=1)
    order = rng.permutation(num_prompts)
    return prefix_ids[order], token_ids[order]


def repetition_ideal(block_size: int, *, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int) -> float:
    """Every prefix used (min(N, P) of them) is computed once; the other prompts reuse it."""
    length = prefix_len + suffix_len
    used = min(num_prompts, num_prefixes)
    return _rate((num_prompts - used) * cached_tokens(prefix_len, length, block_size), num_prompts * length)


def seed_shape(
    words: np.ndarray, *, num_prompts: int = 512, num_prefixes: int = 32, prefix_len: int = 256,
    suffix_len: int = 256, output_len: int = 128, seed: int = 0,
) -> Shape:
    """The reference shape, scaled down: one of P prefixes, a unique suffix, fixed output.

    By default a 256-token prefix, a 256-token suffix and 128 output tokens, as the
    reference (vLLM's PrefixRepetitionRandomDataset, 200k prompts, 512 prefixes). Meant to
    run with a KV cache too small for every prefix (`seed_kv_blocks`)."""
    _check(num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len)
    _check_positive(num_prefixes=num_prefixes, output_len=output_len, prompt_len=prefix_len + suffix_len)
    params = dict(num_prompts=num_prompts, num_prefixes=num_prefixes, prefix_len=prefix_len, suffix_len=suffix_len)
    groups, ids = prefix_repetition_ids(words, seed=seed, **params)
    return Shape("seed", list(ids), groups, _full(num_prompts, output_len), {**params, "output_len": output_len, "seed": seed},
                 functools.partial(repetition_ideal, **params))


def seed_kv_blocks(*, num_prompts: int, num_prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                   block_size: int, inflight: int) -> dict[str, int]:
    """KV blocks of the seed shape at one engine block size: ``prefix_blocks`` (every
    prefix cached: the working set the ideal needs), ``request_blocks`` (what one running
    request holds beyond its shared prefix) and ``suggested``, a cap holding half the
    prefixes plus ``inflight`` running requests. With two replicas, routing that keeps
    each prefix on one replica fits in it; spreading every prefix over both does not."""
    prefix_blocks = min(num_prompts, num_prefixes) * (prefix_len // block_size)
    request_blocks = -(-(prefix_len + suffix_len + output_len) // block_size) - prefix_len // block_size
    suggested = -(-prefix_blocks // 2) + inflight * request_blocks
    return {"prefix_blocks": prefix_blocks, "request_blocks": request_blocks, "suggested": suggested}


def zipf_weights(num_prefixes: int, s: float) -> np.ndarray:
    """P(prefix k) ∝ 1 / (k + 1)^s: prefix 0 is the most popular."""
    w = 1.0 / np.arange(1, num_prefixes + 1, dtype=np.float64) ** s
    return w / w.sum()


def zipf_shape(
    words: np.ndarray, *, num_prompts: int = 512, num_prefixes: int = 64, zipf_s: float = 1.1, prefix_len: int = 256,
    suffix_len: int = 256, output_len: int = 64, seed: int = 0,
) -> Shape:
    """Zipf-skewed prefix popularity: a few prefixes dominate, a long tail is rare.

    Each row draws its prefix independently with weight 1 / rank^s, so the tail prefixes
    have a prompt or two each (or none)."""
    _check(num_prompts=num_prompts, prefix_len=prefix_len, suffix_len=suffix_len, zipf_s=zipf_s)
    _check_positive(num_prefixes=num_prefixes, output_len=output_len, prompt_len=prefix_len + suffix_len)
    rng = np.random.default_rng(seed)
    groups = rng.choice(num_prefixes, size=num_prompts, p=zipf_weights(num_prefixes, zipf_s)).astype(np.int32)
    prefixes = rng.choice(words, size=(num_prefixes, prefix_len))
    suffixes = rng.choice(words, size=(num_prompts, suffix_len))
    ids = np.concatenate([prefixes[groups], suffixes], axis=1)
    params = dict(num_prompts=num_prompts, num_prefixes=num_prefixes, zipf_s=zipf_s, prefix_len=prefix_len, suffix_len=suffix_len)
    return Shape("zipf", list(ids), groups, _full(num_prompts, output_len), {**params, "output_len": output_len, "seed": seed},
                 functools.partial(zipf_ideal, **params))


def zipf_ideal(block_size: int, *, num_prompts: int, num_prefixes: int, zipf_s: float, prefix_len: int, suffix_len: int) -> float:
    """As prefix repetition, with the expected number of prefixes drawn at least once:
    sum over k of 1 - (1 - p_k)^N."""
    p = zipf_weights(num_prefixes, zipf_s)
    used = float(np.sum(-np.expm1(num_prompts * np.log1p(-p)))) if num_prompts else 0.0
    length = prefix_len + suffix_len
    return _rate((num_prompts - used) * cached_tokens(prefix_len, length, block_size), num_prompts * length)


def hierarchical_shape(
    words: np.ndarray, *, num_prompts: int = 512, system_len: int = 256, num_groups: int = 16, group_len: int = 256,
    question_len: int = 64, output_len: int = 64, seed: int = 0,
) -> Shape:
    """Two levels of sharing: a global system prompt, then one of G group prefixes.

    As in labelling jobs: one system prompt for every row, then one of G group prefixes
    (its few-shot examples; rows spread evenly), then a question of its own.
    ``prefix_id`` is the group."""
    _check(num_prompts=num_prompts, system_len=system_len, group_len=group_len, question_len=question_len)
    _check_positive(num_groups=num_groups, output_len=output_len, prompt_len=system_len + group_len + question_len)
    rng = np.random.default_rng(seed)
    system = rng.choice(words, size=system_len)
    group_prefixes = rng.choice(words, size=(num_groups, group_len))
    questions = rng.choice(words, size=(num_prompts, question_len))
    groups = _even_groups(num_prompts, num_groups, rng)
    ids = np.concatenate([np.broadcast_to(system, (num_prompts, system_len)), group_prefixes[groups], questions], axis=1)
    params = dict(num_prompts=num_prompts, system_len=system_len, num_groups=num_groups, group_len=group_len,
                  question_len=question_len)
    return Shape("hierarchical", list(ids), groups, _full(num_prompts, output_len),
                 {**params, "output_len": output_len, "seed": seed}, functools.partial(hierarchical_ideal, **params))


def hierarchical_ideal(block_size: int, *, num_prompts: int, system_len: int, num_groups: int, group_len: int,
                       question_len: int) -> float:
    """The first row computes everything; the first row of each other group reuses the
    system prompt; every other row reuses system prompt and group prefix."""
    length = system_len + group_len + question_len
    used = min(num_prompts, num_groups)
    hits = ((num_prompts - used) * cached_tokens(system_len + group_len, length, block_size)
            + max(used - 1, 0) * cached_tokens(system_len, length, block_size))
    return _rate(hits, num_prompts * length)


def variable_shape(
    words: np.ndarray, *, num_prompts: int = 512, num_prefixes: int = 16, prefix_len: int = 256,
    shared_fraction: float = 0.5, unique_len_median: float = 128.0, unique_len_sigma: float = 1.0,
    max_unique_len: int = 1024, output_len_median: float = 64.0, output_len_sigma: float = 0.75,
    max_output_len: int = 512, seed: int = 0,
) -> Shape:
    """Lognormal prompt and output lengths; only some rows share a prefix.

    round(N * shared_fraction) rows start with one of P prefixes (spread evenly), the
    rest share nothing; every row then has a unique part and an output whose lengths are
    lognormal (median, sigma), rounded and clipped to [1, max]."""
    _check(num_prompts=num_prompts, prefix_len=prefix_len, unique_len_sigma=unique_len_sigma,
           output_len_sigma=output_len_sigma)
    _check_positive(num_prefixes=num_prefixes, unique_len_median=unique_len_median, max_unique_len=max_unique_len,
                    output_len_median=output_len_median, max_output_len=max_output_len)
    if not 0.0 <= shared_fraction <= 1.0:
        raise ValueError("shared_fraction must be within [0, 1]")
    rng = np.random.default_rng(seed)
    n_shared = shared_rows(num_prompts, shared_fraction)
    groups = np.full(num_prompts, NO_PREFIX, dtype=np.int32)
    groups[:n_shared] = _even_groups(n_shared, num_prefixes, rng)
    rng.shuffle(groups)
    unique_len = lognormal_lengths(rng, num_prompts, unique_len_median, unique_len_sigma, max_unique_len)
    output_len = lognormal_lengths(rng, num_prompts, output_len_median, output_len_sigma, max_output_len)
    prefixes = rng.choice(words, size=(num_prefixes, prefix_len))
    uniques = np.split(rng.choice(words, size=int(unique_len.sum())), np.cumsum(unique_len)[:-1]) if num_prompts else []
    ids = [np.concatenate([prefixes[g], u]) if g != NO_PREFIX else u for g, u in zip(groups, uniques, strict=True)]
    params = dict(num_prompts=num_prompts, num_prefixes=num_prefixes, prefix_len=prefix_len,
                  shared_fraction=shared_fraction, unique_len_median=unique_len_median,
                  unique_len_sigma=unique_len_sigma, max_unique_len=max_unique_len)
    outputs = dict(output_len_median=output_len_median, output_len_sigma=output_len_sigma, max_output_len=max_output_len)
    return Shape("variable", ids, groups, output_len, {**params, **outputs, "seed": seed},
                 functools.partial(variable_ideal, **params))


def variable_ideal(block_size: int, *, num_prompts: int, num_prefixes: int, prefix_len: int, shared_fraction: float,
                   unique_len_median: float, unique_len_sigma: float, max_unique_len: int) -> float:
    """Shared rows past the first of each prefix reuse the prefix (their unique part has
    at least one token, so the last-token rule never bites); prompt tokens are the
    expected unique part of every row plus the prefixes of the shared rows."""
    n_shared = shared_rows(num_prompts, shared_fraction)
    hits = (n_shared - min(n_shared, num_prefixes)) * cached_tokens(prefix_len, prefix_len + 1, block_size)
    mean_unique = lognormal_mean(unique_len_median, unique_len_sigma, max_unique_len)
    return _rate(hits, num_prompts * mean_unique + n_shared * prefix_len)


def no_sharing_shape(words: np.ndarray, *, num_prompts: int = 512, prompt_len: int = 512, output_len: int = 64,
               seed: int = 0) -> Shape:
    """The control: unique prompts, nothing to reuse."""
    _check(num_prompts=num_prompts)
    _check_positive(prompt_len=prompt_len, output_len=output_len)
    rng = np.random.default_rng(seed)
    ids = rng.choice(words, size=(num_prompts, prompt_len))
    params = dict(num_prompts=num_prompts, prompt_len=prompt_len)
    return Shape("no-sharing", list(ids), np.full(num_prompts, NO_PREFIX, dtype=np.int32), _full(num_prompts, output_len),
                 {**params, "output_len": output_len, "seed": seed}, lambda block_size: 0.0)


SHAPES: dict[str, Callable[..., Shape]] = {
    "seed": seed_shape, "zipf": zipf_shape, "hierarchical": hierarchical_shape, "variable": variable_shape,
    "no-sharing": no_sharing_shape,
}
"""`prefixflow dataset <name>` -> generator (its keyword arguments are the command's flags)."""


# --- helpers ------------------------------------------------------------------------------

_NORMAL = NormalDist()


def shared_rows(num_prompts: int, shared_fraction: float) -> int:
    return round(num_prompts * shared_fraction)


def lognormal_lengths(rng: np.random.Generator, n: int, median: float, sigma: float, high: int) -> np.ndarray:
    """n lengths following round(LogNormal(ln median, sigma)) clipped to [1, high],
    stratified (one draw from each of n equally likely slices of the law, in random
    order): each row still follows the law, and a few hundred rows already have its mean,
    which keeps the formula and the counted ideal close."""
    q = np.clip((rng.permutation(n) + rng.random(n)) / max(n, 1), 1e-12, 1 - 1e-12)
    z = np.array([_NORMAL.inv_cdf(float(x)) for x in q])
    return np.clip(np.rint(median * np.exp(sigma * z)), 1, high).astype(np.int32)


def lognormal_mean(median: float, sigma: float, high: int) -> float:
    """E[clip(round(X), 1, high)] for X ~ LogNormal(ln median, sigma), as
    1 + sum_{k=1}^{high-1} P(round(X) > k)."""
    if sigma == 0:
        return float(min(max(round(median), 1), high))
    law = NormalDist(math.log(median), sigma)
    return 1.0 + sum(1.0 - law.cdf(math.log(k + 0.5)) for k in range(1, high))


def _even_groups(n: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """n group ids spread evenly over `groups` (the first n % groups one more), shuffled."""
    per = np.full(groups, n // groups)
    per[: n % groups] += 1
    ids = np.repeat(np.arange(groups, dtype=np.int32), per)
    rng.shuffle(ids)
    return ids


def _full(n: int, value: int) -> np.ndarray:
    return np.full(n, value, dtype=np.int32)


def _rate(cached: float, total: float) -> float:
    return cached / total if total else 0.0


def _check(**values: float) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0")


def _check_positive(**values: float) -> None:
    """Lengths that must hold a token: an empty prompt is an error row, and vLLM wants
    max_tokens > 0."""
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be > 0")
