"""prefixflow.datagen.shapes: the benchmark shapes' token ids, and their ideal hit rate by formula and by count."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from prefixflow.datagen import shapes as S
from tests.tiers import COSTLY

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
WORDS = np.arange(1_000_000, dtype=np.int64)
"""A large vocabulary: two random blocks of a few tokens never collide by chance, so the
counted ideal can only differ from the formula where the shape itself is random."""
BLOCKS = st.sampled_from([4, 7, 16, 32, 128])


def _counted(shape: S.Shape, block_size: int) -> float:
    return S.ideal_count(shape.token_ids, block_size).hit_rate


def _shares_by_chance(shape: S.Shape, structural) -> bool:
    """Whether two prompts share more leading tokens than the shape puts there
    (`structural(group_a, group_b)`): random tokens that happen to repeat (rare in a
    million-word vocabulary, but a draw of 59 prompts once gave two the same first suffix
    token), which the formula rightly does not count. Sorted, each prompt's longest shared
    prefix is with a neighbour, so neighbours are enough."""
    rows = sorted(zip(shape.token_ids, shape.prefix_id.tolist()), key=lambda r: tuple(r[0].tolist()))
    return any(_common(a, b) > structural(ga, gb) for (a, ga), (b, gb) in zip(rows, rows[1:]))


def _common(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


# --- the counting rule --------------------------------------------------------------------


def test_cached_tokens_whole_blocks_never_the_last_token():
    assert S.cached_tokens(256, 512, 16) == 256
    assert S.cached_tokens(250, 512, 16) == 240  # a partial block is not cached
    assert S.cached_tokens(32, 32, 16) == 16  # the whole prompt cached: its last token is recomputed
    assert S.cached_tokens(32, 33, 16) == 32
    assert S.cached_tokens(10, 512, 16) == 0
    assert S.cached_tokens(0, 0, 16) == 0


def test_ideal_count_by_hand():
    a = np.arange(32)
    ax = np.arange(48)
    # Shortest first, whatever the dataset order: a computes 2 blocks, ax reuses both.
    for order in ([a, ax], [ax, a]):
        count = S.ideal_count(order, 16)
        assert (count.cached_tokens, count.prompt_tokens, count.shared_blocks) == (32, 80, 2)
    # Two identical prompts: the second reuses all but the block holding its last token.
    assert S.ideal_count([a, a.copy()], 16).cached_tokens == 16
    # Sharing less than a block is worth nothing; sharing a block then diverging is.
    b = np.concatenate([np.arange(15), [99] * 20])
    c = np.concatenate([np.arange(16), [98] * 20])
    assert S.ideal_count([ax, b], 16).cached_tokens == 0
    assert S.ideal_count([ax, c], 16).cached_tokens == 16
    assert S.ideal_count([], 16).hit_rate == 0.0
    with pytest.raises(ValueError):
        S.ideal_count([a], 0)


# --- formula == count where the shape is not random ----------------------------------------


@settings(COSTLY)
@given(n=st.integers(0, 120), p=st.integers(1, 20), prefix=st.integers(0, 300), suffix=st.integers(0, 100),
       block=BLOCKS, seed=st.integers(0, 3))
def test_seed_formula_equals_count(n, p, prefix, suffix, block, seed):
    assume(prefix + suffix > 0)  # suffix 0: every prompt of a group is its prefix (the last-token rule)
    shape = S.seed_shape(WORDS, num_prompts=n, num_prefixes=p, prefix_len=prefix, suffix_len=suffix, seed=seed)
    assume(not _shares_by_chance(shape, lambda ga, gb: prefix if ga == gb else 0))
    assert _counted(shape, block) == pytest.approx(shape.formula(block), abs=1e-12)


@settings(COSTLY)
@given(n=st.integers(0, 120), g=st.integers(1, 12), system=st.integers(0, 200), group=st.integers(0, 200),
       question=st.integers(0, 60), block=BLOCKS, seed=st.integers(0, 3))
def test_hierarchical_formula_equals_count(n, g, system, group, question, block, seed):
    assume(system + group + question > 0)
    shape = S.hierarchical_shape(WORDS, num_prompts=n, num_groups=g, system_len=system, group_len=group,
                                 question_len=question, seed=seed)
    assume(not _shares_by_chance(shape, lambda ga, gb: system + group if ga == gb else system))
    assert _counted(shape, block) == pytest.approx(shape.formula(block), abs=1e-12)


@settings(COSTLY)
@given(n=st.integers(0, 100), length=st.integers(1, 300), block=BLOCKS, seed=st.integers(0, 3))
def test_no_sharing_has_nothing_to_reuse(n, length, block, seed):
    shape = S.no_sharing_shape(WORDS, num_prompts=n, prompt_len=length, seed=seed)
    assert shape.formula(block) == 0.0
    count = S.ideal_count(shape.token_ids, block)
    assert (count.cached_tokens, count.shared_blocks) == (0, 0)


# --- formula ≈ count where the shape draws at random ---------------------------------------


@settings(COSTLY)
@given(n=st.integers(300, 1500), p=st.integers(8, 200), s=st.floats(0.5, 2.0), block=BLOCKS, seed=st.integers(0, 99))
def test_zipf_formula_close_to_count(n, p, s, block, seed):
    shape = S.zipf_shape(WORDS, num_prompts=n, num_prefixes=p, zipf_s=s, prefix_len=200, suffix_len=100, seed=seed)
    # The count differs from the formula only by how many prefixes were drawn (D): each
    # one drawn more or less is one prompt's prefix more or less to compute. D is a sum of
    # negatively correlated indicators, so its variance is at most sum q(1 - q); one
    # prefix more for D being an integer (a rare prefix missing when E[D] is 20.99).
    q = -np.expm1(n * np.log1p(-S.zipf_weights(p, s)))
    per_prefix = S.cached_tokens(200, 300, block) / (n * 300)
    tolerance = (4 * math.sqrt(float(np.sum(q * (1 - q)))) + 1) * per_prefix
    assert abs(_counted(shape, block) - shape.formula(block)) <= tolerance + 1e-12
    assert tolerance < 0.06


@settings(COSTLY)
@given(n=st.integers(300, 1500), p=st.integers(1, 40), f=st.floats(0.0, 1.0), median=st.floats(20, 400),
       sigma=st.floats(0.0, 1.5), block=BLOCKS, seed=st.integers(0, 99))
@example(n=326, p=1, f=0.21923864034342283, median=20.0, sigma=1.0589, block=16, seed=17)  # 0.011 off: a fixed 0.01 failed
def test_variable_formula_close_to_count(n, p, f, median, sigma, block, seed):
    """The counted ideal is the formula's up to the sample's unique lengths. They are
    stratified (one draw from each of n equally likely slices of the law), so each draw lies
    in its slice, as does the slice's mean: the sum of the n lengths is within the sum of
    the slices' widths, the law's range (at most max - 1), of n times the mean (a bound, not a typical error: the top
    slice of a heavy tail alone spans hundreds of tokens at a few hundred rows). The rate
    H / (n * mean + shared * prefix) moves by at most rate * (max - 1) / that denominator;
    0.005 more for the unique parts' chance sharing."""
    high = 1024  # variable_shape's max_unique_len
    shape = S.variable_shape(WORDS, num_prompts=n, num_prefixes=p, prefix_len=150, shared_fraction=f,
                             unique_len_median=median, unique_len_sigma=sigma, max_unique_len=high, seed=seed)
    formula = shape.formula(block)
    tokens = n * S.lognormal_mean(median, sigma, high) + S.shared_rows(n, f) * 150
    z = NormalDist().inv_cdf(1 - 1e-12)  # the draws' quantiles are clipped to [1e-12, 1 - 1e-12]
    lo, hi = (min(max(round(median * math.exp(sigma * x)), 1), high) for x in (-z, z))
    tolerance = formula * (hi - lo) / tokens + 0.005
    assert abs(_counted(shape, block) - formula) <= tolerance


@pytest.mark.parametrize("name", ["zipf", "variable"])
def test_formula_is_the_mean_over_seeds(name):
    """Not merely close: averaged over seeds, the counted ideal converges on the formula."""
    make = S.SHAPES[name]
    counted = [_counted(make(WORDS, num_prompts=200, seed=seed), 16) for seed in range(40)]
    formula = make(WORDS, num_prompts=200).formula(16)
    assert np.std(counted) > 0  # the shape is random ...
    assert np.mean(counted) == pytest.approx(formula, abs=0.003)  # ... and the formula is its expectation


@pytest.mark.parametrize("name", list(S.SHAPES))
@pytest.mark.parametrize("block", [16, 128])
def test_defaults_agree_and_share(name, block):
    shape = S.SHAPES[name](WORDS)
    assert len(shape.token_ids) == 512
    assert _counted(shape, block) == pytest.approx(shape.formula(block), abs=0.005)
    if name != "no-sharing":
        assert shape.formula(block) > 0.25  # meaningful sharing at the default scale


# --- what the rows look like ---------------------------------------------------------------


def test_seed_rows():
    shape = S.seed_shape(WORDS, num_prompts=100, num_prefixes=7, prefix_len=40, suffix_len=9, output_len=5)
    assert all(len(ids) == 49 for ids in shape.token_ids)
    assert set(shape.output_len.tolist()) == {5}
    counts = np.bincount(shape.prefix_id)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 100
    _assert_groups_share(shape, 40)


def test_zipf_rows_follow_the_law():
    shape = S.zipf_shape(WORDS, num_prompts=20_000, num_prefixes=50, zipf_s=1.1, prefix_len=8, suffix_len=2)
    freq = np.bincount(shape.prefix_id, minlength=50) / 20_000
    assert np.allclose(freq, S.zipf_weights(50, 1.1), atol=0.01)
    assert freq[0] > 5 * freq[-1]  # a few dominate
    _assert_groups_share(shape, 8)


def test_hierarchical_rows():
    shape = S.hierarchical_shape(WORDS, num_prompts=60, system_len=30, num_groups=5, group_len=20, question_len=7)
    first = shape.token_ids[0]
    assert all(len(ids) == 57 for ids in shape.token_ids)
    assert all(np.array_equal(ids[:30], first[:30]) for ids in shape.token_ids)  # one system prompt
    assert sorted(np.bincount(shape.prefix_id).tolist()) == [12] * 5
    _assert_groups_share(shape, 50)


def test_variable_rows():
    shape = S.variable_shape(WORDS, num_prompts=400, num_prefixes=6, prefix_len=64, shared_fraction=0.3,
                             unique_len_median=50, unique_len_sigma=0.8, max_unique_len=300,
                             output_len_median=20, output_len_sigma=0.5, max_output_len=60)
    shared = shape.prefix_id != S.NO_PREFIX
    assert shared.sum() == 120
    unique = np.array([len(ids) for ids in shape.token_ids]) - 64 * shared
    assert unique.min() >= 1 and unique.max() <= 300
    assert 1 <= shape.output_len.min() and shape.output_len.max() <= 60
    # lognormal: the median of the draws is the parameter, the mean above it
    assert np.median(unique) == pytest.approx(50, rel=0.05)
    assert np.median(shape.output_len) == pytest.approx(20, rel=0.1)
    assert np.mean(unique) == pytest.approx(S.lognormal_mean(50, 0.8, 300), rel=0.01)
    _assert_groups_share(shape, 64)
    prefixes = {tuple(shape.token_ids[i][:64]) for i in np.flatnonzero(shared)}
    assert not any(tuple(shape.token_ids[i][:64]) in prefixes for i in np.flatnonzero(~shared))


def test_no_sharing_rows():
    shape = S.no_sharing_shape(WORDS, num_prompts=50, prompt_len=30, output_len=3)
    assert set(shape.prefix_id.tolist()) == {S.NO_PREFIX}
    assert max(_common(a, b) for i, a in enumerate(shape.token_ids) for b in shape.token_ids[i + 1:]) < 3


def _assert_groups_share(shape: S.Shape, prefix_len: int) -> None:
    """Rows of a group share exactly their prefix; different groups' prefixes differ."""
    firsts: dict[int, np.ndarray] = {}
    for group, ids in zip(shape.prefix_id.tolist(), shape.token_ids, strict=True):
        if group == S.NO_PREFIX:
            continue
        first = firsts.setdefault(group, ids)
        assert np.array_equal(ids[:prefix_len], first[:prefix_len])
    prefixes = {tuple(ids[:prefix_len]) for ids in firsts.values()}
    assert len(prefixes) == len(firsts)


@pytest.mark.parametrize("name", list(S.SHAPES))
def test_deterministic_per_seed(name):
    a, b, c = (S.SHAPES[name](WORDS, num_prompts=50, seed=s) for s in (3, 3, 4))
    assert all(np.array_equal(x, y) for x, y in zip(a.token_ids, b.token_ids, strict=True))
    assert np.array_equal(a.prefix_id, b.prefix_id) and np.array_equal(a.output_len, b.output_len)
    assert not all(np.array_equal(x, y) for x, y in zip(a.token_ids, c.token_ids, strict=True))


# --- helpers and arguments -----------------------------------------------------------------


def test_lognormal_mean():
    assert S.lognormal_mean(128, 1.0, 10**5) == pytest.approx(128 * math.exp(0.5), rel=1e-3)  # clipping negligible
    assert S.lognormal_mean(100, 0.0, 500) == 100
    assert S.lognormal_mean(100, 0.0, 50) == 50
    assert S.lognormal_mean(100, 2.0, 200) < 200  # clipped from above


def test_seed_kv_blocks():
    args = dict(num_prompts=512, num_prefixes=32, prefix_len=256, suffix_len=256, output_len=128, inflight=16)
    # 32 prefixes x 2 blocks; a request holds ceil(640 / 128) - 2 = 3 more; cap: 32 + 16 x 3
    assert S.seed_kv_blocks(**args, block_size=128) == {"prefix_blocks": 64, "request_blocks": 3, "suggested": 80}
    assert S.seed_kv_blocks(**args, block_size=16) == {"prefix_blocks": 512, "request_blocks": 24, "suggested": 640}
    shape = S.seed_shape(WORDS, **{k: v for k, v in args.items() if k != "inflight"})
    assert S.ideal_count(shape.token_ids, 128).shared_blocks == 64  # the working set the count sees


@pytest.mark.parametrize(
    "name,bad",
    [("seed", {"num_prefixes": 0}), ("seed", {"num_prompts": -1}), ("zipf", {"zipf_s": -1.0}),
     ("hierarchical", {"num_groups": 0}), ("variable", {"shared_fraction": 1.5}),
     ("variable", {"unique_len_median": 0.0}), ("no-sharing", {"prompt_len": 0}), ("zipf", {"output_len": 0}),
     ("seed", {"prefix_len": 0, "suffix_len": 0}), ("hierarchical", {"system_len": 0, "group_len": 0, "question_len": 0})],
)
def test_bad_arguments(name, bad):
    with pytest.raises(ValueError):
        S.SHAPES[name](WORDS, **bad)


def test_pure_module():
    code = ("import sys, prefixflow.datagen.shapes; print(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('nats', 'vllm', 'torch', 'pyarrow', 'tokenizers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.strip() == "[]"
