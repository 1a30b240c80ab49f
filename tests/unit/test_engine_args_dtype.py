"""A CPU without native 16-bit floats runs the model in float32 by default (bf16 is
emulated there, ~5x slower); one with them, and every GPU, keeps the model's dtype; an
explicit `--dtype` always wins."""

from __future__ import annotations

import pytest

from prefixflow.services.engine_worker.engine_args import NATIVE_HALF, cpu_dtype, cpu_flags, placement_defaults

pytestmark = pytest.mark.unit

AVX2 = frozenset({"fpu", "sse4_2", "avx", "avx2", "fma"})


def test_float32_only_on_a_cpu_without_native_half_floats():
    assert cpu_dtype(AVX2) == "float32"
    for flag in NATIVE_HALF:
        assert cpu_dtype(AVX2 | {flag}) is None, flag
    assert cpu_dtype(frozenset()) is None  # flags not read: the model's own


def test_placement_sets_the_dtype_on_cpus_only():
    assert placement_defaults(0, flags=AVX2) == {"enforce_eager": True, "tensor_parallel_size": 1, "dtype": "float32"}
    assert "dtype" not in placement_defaults(0, flags=AVX2 | {"avx512_bf16"})
    assert placement_defaults(4, flags=AVX2) == {"enforce_eager": False, "tensor_parallel_size": 4}


def test_cpu_flags_reads_x86_and_arm_cpuinfo(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: EPYC\nflags\t\t: fpu avx2 fma\n\nprocessor\t: 1\nflags\t\t: fpu avx2 fma\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(str(x86)) == {"fpu", "avx2", "fma"}
    assert cpu_flags(str(arm)) >= {"bf16"} and cpu_dtype(cpu_flags(str(arm))) is None
    assert cpu_flags(str(tmp_path / "absent")) == frozenset()

