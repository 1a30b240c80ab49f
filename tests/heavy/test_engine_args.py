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

from prefixflow.cli.main import parse_args
from prefixflow.services.engine_worker.engines import make_engine
from prefixflow.services.registry import load_config

pytestmark = [pytest.mark.heavy, pytest.mark.timeout(300)]


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
    out = subprocess.run([sys.executable, "-m", "prefixflow.cli.main", "serve", "engine-worker", "--help"],
                         capture_output=True, text=True, check=True, timeout=240).stdout
    for flag in ("--replica", "--engine-args", "--max-num-batched-tokens", "--tensor-parallel-size",
                 "--gpu-memory-utilization", "--quantization", "--enable-lora", "--trust-remote-code"):
        assert flag in out, flag


def test_gpu_defaults_follow_the_replicas_devices(tiny_model, monkeypatch):
    """CUDA graphs on GPUs (enforce_eager only without one), tensor parallel over the
    replica's GPUs (`run --tensor-parallel-size 2` gives each worker CUDA_VISIBLE_DEVICES
    of two GPUs; the systemd unit `--gpus 4-7`); explicit arguments win. The engine args
    only, no engine config: this machine has no GPU to build one for."""

    def args(argv, visible):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        parsed = parse_args(["serve", "engine-worker", "--replica", "r0", "--model", str(tiny_model), *argv])
        return make_engine(load_config("engine-worker", parsed)).engine_args()

    a = args([], "0,1")
    assert (a.tensor_parallel_size, a.enforce_eager) == (2, False)
    a = args(["--gpus", "4-7"], "")
    assert (a.tensor_parallel_size, a.enforce_eager) == (4, False)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7", "set before vLLM starts"
    a = args([], "")
    assert (a.tensor_parallel_size, a.enforce_eager) == (1, True), "no GPU: eager, as on this machine"
    a = args(["--enforce-eager", "--tensor-parallel-size", "1"], "0,1")
    assert (a.tensor_parallel_size, a.enforce_eager) == (1, True), "explicit arguments win"
    a = args(["--no-enforce-eager"], "")
    assert a.enforce_eager is False


def test_max_model_len_is_the_models_own(tiny_model, tmp_path):
    """Unset, the context length is the model's (it was a fixed 4096): the engine's and the
    ingestor's, which rejects a longer prompt as an error row before it reaches an engine."""
    import json

    from prefixflow.services.ingestor.model import load_model

    model = tmp_path / "short-model"
    model.mkdir()
    for f in tiny_model.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((tiny_model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1536}))

    parsed = parse_args(["serve", "engine-worker", "--replica", "r0", "--model", str(model)])
    cfg = load_config("engine-worker", parsed)
    assert cfg.max_model_len == 0
    assert make_engine(cfg).engine_args().create_engine_config().model_config.max_model_len == 1536
    assert load_model(str(model), 0, 16).max_model_len == 1536
    assert load_model(str(model), 1024, 16).max_model_len == 1024, "a smaller setting wins"
    assert load_model(str(model), 9999, 16).max_model_len == 1536, "never past the model's"


def test_a_capped_kv_cache_lets_vllm_fit_the_context(tiny_model):
    """`--kv-cache-blocks` smaller than one full-length request (30 x 128 < 4,096 tokens)
    used to stop the engine at start ("To serve at least one request with the model's max
    seq len"): unset, the context is vLLM's auto-fit (-1): the model's own where the cache
    holds it, else what the cache holds (the e2e `test_kv_events` starts engines so). A
    context given explicitly is kept."""
    def engine(*flags: str):
        parsed = parse_args(["serve", "engine-worker", "--replica", "r0", "--model", str(tiny_model), *flags])
        return make_engine(load_config("engine-worker", parsed)).engine_args()

    assert engine("--kv-cache-blocks", "30").max_model_len == -1
    assert engine().max_model_len is None, "an uncapped cache: the model's own, as before"
    assert engine("--kv-cache-blocks", "30", "--max-model-len", "2048").max_model_len == 2048
    assert engine("--kv-cache-blocks", "30").create_engine_config().model_config.max_model_len == 4096


def test_an_explicit_dtype_wins_over_the_cpu_default():
    """float32 is the default on a CPU without native 16-bit floats; `--dtype` wins."""
    from prefixflow.services.engine_worker.engine_args import build, placement_defaults

    avx2 = frozenset({"avx", "avx2", "fma"})
    assert build({"model": "m", **placement_defaults(0, flags=avx2)}, ["--dtype", "bfloat16"]).dtype == "bfloat16"
    assert build({"model": "m", **placement_defaults(0, flags=avx2)}, []).dtype == "float32"
