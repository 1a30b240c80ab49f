"""Every vLLM engine argument reaches vLLM through vLLM's own definitions (must-show 3):
an argument prefixflow never names, given on the engine-worker's command line (loose,
after `--`, in --engine-args / PFX_ENGINE_ARGS) or after `prefixflow run ... --`, ends up
in the `VllmConfig` the engine is built from. No engine is started: the engine-worker's
own `AsyncEngineArgs` are turned into vLLM's config object, as `AsyncLLM` does first."""

from __future__ import annotations

import shlex
import subprocess
import sys

import pytest

from cli.main import parse_args
from services.engine_worker.engines import make_engine
from services.registry import load_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]


def engine_config(argv: list[str], tiny_model):
    args = parse_args(["serve", "engine-worker", "--replica", "r0", "--model", str(tiny_model), *argv])
    cfg = load_config("engine-worker", args)
    return cfg, make_engine(cfg).engine_args().create_engine_config()


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-batched-tokens", "1234"],  # loose, after the worker's own flags
        ["--", "--max-num-batched-tokens", "1234"],  # after `--`
        ["--engine-args", "--max-num-batched-tokens 1234"],  # one string (PFX_ENGINE_ARGS)
    ],
    ids=["loose", "after-dashdash", "engine-args"],
)
def test_unnamed_engine_argument_reaches_vllm(argv, tiny_model):
    cfg, config = engine_config(argv, tiny_model)
    assert shlex.split(cfg.engine_args) == ["--max-num-batched-tokens", "1234"]
    assert config.scheduler_config.max_num_batched_tokens == 1234
    # prefixflow's own defaults still apply where the arguments say nothing.
    assert config.cache_config.enable_prefix_caching is True
    assert config.model_config.max_model_len == 4096
    assert config.structured_outputs_config.disable_any_whitespace is True  # compact JSON


def test_several_arguments_and_overriding_a_default(tiny_model):
    _, config = engine_config(
        ["--max-num-batched-tokens", "2048", "--dtype", "float32", "--no-enable-prefix-caching", "--seed", "7",
         "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": false}'], tiny_model
    )
    assert config.structured_outputs_config.disable_any_whitespace is False
    assert config.scheduler_config.max_num_batched_tokens == 2048
    assert str(config.model_config.dtype) == "torch.float32"
    assert config.cache_config.enable_prefix_caching is False
    assert config.model_config.seed == 7


def test_a_single_flag_in_engine_args(tiny_model):
    """`prefixflow run ... -- --no-enable-prefix-caching` hands the worker
    `--engine-args=--no-enable-prefix-caching` (a value that looks like a flag)."""
    _, config = engine_config(["--engine-args=--no-enable-prefix-caching"], tiny_model)
    assert config.cache_config.enable_prefix_caching is False


def test_bad_engine_argument_fails_at_start_up(tiny_model):
    with pytest.raises(SystemExit):
        engine_config(["--max-num-batched-tokens", "not-a-number"], tiny_model)
    with pytest.raises(SystemExit):
        engine_config(["--no-such-vllm-flag", "1"], tiny_model)


def test_run_passes_everything_after_dashdash_to_the_replicas():
    args = parse_args(["run", "in.jsonl", "--out", "o", "--max-tokens", "4", "--", "--max-num-batched-tokens", "512", "--dtype", "float32"])
    assert args.engine_argv == ["--max-num-batched-tokens", "512", "--dtype", "float32"]
    assert args.max_tokens == 4
    with pytest.raises(SystemExit):  # other commands take no loose arguments
        parse_args(["submit", "in.jsonl", "--out", "o", "--max-num-batched-tokens", "512"])


def test_help_lists_vllms_own_engine_arguments():
    out = subprocess.run([sys.executable, "-m", "cli.main", "serve", "engine-worker", "--help"],
                         capture_output=True, text=True, check=True, timeout=240).stdout
    for flag in ("--replica", "--engine-args", "--max-num-batched-tokens", "--tensor-parallel-size",
                 "--gpu-memory-utilization", "--quantization", "--enable-lora", "--trust-remote-code"):
        assert flag in out, flag
