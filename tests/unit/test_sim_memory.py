"""Memory scenarios of the simulator's GPU profiles (issue 42, item 6): vLLM's
`--kv-cache-dtype fp8` and another `--gpu-memory-utilization`, applied to the profile
so every method runs under the same setting (`prefixflow simulate --kv-cache-dtype fp8
--gpu-memory-utilization 0.95`)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.shared.outcomes import CommandError
from prefixflow.sim.cost import KV_BYTES_PER_TOKEN_8B, WEIGHT_BYTES_8B, kv_blocks_for, load_profile, with_memory

pytestmark = pytest.mark.unit


def test_the_defaults_are_the_profile_itself():
    l4 = load_profile("l4-8b")
    assert with_memory(l4) is l4 and with_memory(l4, 0.9, "auto") is l4
    assert l4.kv_blocks == kv_blocks_for(l4.mem_gib, 0.9, WEIGHT_BYTES_8B, l4.activation_gib, KV_BYTES_PER_TOKEN_8B, 16)
    assert l4.kv_blocks == 1441, "the L4 profile's KV cache as fitted and documented"


@pytest.mark.parametrize("name", ["l4-8b", "h100-8b"])
def test_fp8_kv_holds_twice_the_tokens_and_reads_half_the_bytes(name):
    base = load_profile(name)
    fp8 = with_memory(base, None, "fp8")
    assert abs(fp8.kv_blocks - 2 * base.kv_blocks) <= 1
    assert fp8.c_ctx == pytest.approx(base.c_ctx / 2) and fp8.kv_bytes_per_token == base.kv_bytes_per_token / 2
    assert (fp8.c0, fp8.c_pf, fp8.c_dec, fp8.speed) == (base.c0, base.c_pf, base.c_dec, base.speed)
    assert fp8.name == f"{name}-fp8kv" and with_memory(fp8, None, "auto").kv_blocks == base.kv_blocks


@given(st.floats(0.8, 1.0), st.floats(0.8, 1.0), st.sampled_from(["auto", "fp8"]))
def test_more_memory_for_vllm_never_means_fewer_blocks(u1, u2, dtype):
    l4 = load_profile("l4-8b")
    lo, hi = sorted((u1, u2))
    a, b = with_memory(l4, lo, dtype), with_memory(l4, hi, dtype)
    assert a.kv_blocks <= b.kv_blocks
    extra = (hi - lo) * l4.mem_gib * 2**30 / (16 * a.kv_bytes_per_token)
    assert abs((b.kv_blocks - a.kv_blocks) - extra) <= 1, "every extra byte goes to the KV cache"


def test_a_profile_without_memory_figures_or_a_bad_setting_is_refused():
    with pytest.raises(CommandError, match="no GPU memory figures"):
        with_memory(load_profile("cpu-tiny"), None, "fp8")
    with pytest.raises(CommandError, match="leaves no KV cache"):
        with_memory(load_profile("l4-8b"), 0.5)
    with pytest.raises(CommandError, match="in \\(0, 1\\]"):
        with_memory(load_profile("l4-8b"), 1.5)
