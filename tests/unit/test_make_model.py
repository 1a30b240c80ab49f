"""prefixflow.datagen.make_model: deterministic, idempotent tiny Llama + tokenizer builds."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

from prefixflow.datagen.make_model import DEFAULT_MODEL_DIR, STAMP_FILE, make_model

pytestmark = pytest.mark.unit


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    # A fixed path under the session base dir: make_model is idempotent, so other test
    # files asking for the same path and arguments get this build for free.
    return make_model(tmp_path_factory.getbasetemp() / "prefixflow-tiny-llama")


def test_default_dir_is_relative():
    assert DEFAULT_MODEL_DIR == Path(".prefixflow/models/tiny-llama")


def test_files_and_stamp(tiny_model_dir):
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", STAMP_FILE):
        assert (tiny_model_dir / name).is_file(), name
    stamp = json.loads((tiny_model_dir / STAMP_FILE).read_text())
    assert stamp["seed"] == 0 and stamp["vocab_size"] == 8192
    leftovers = [p.name for p in tiny_model_dir.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_config_loads(tiny_model_dir):
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama"
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.max_position_embeddings >= 4096
    assert config.dtype == torch.bfloat16  # transformers 5 spelling of torch_dtype
    assert config.head_dim == config.hidden_size // config.num_attention_heads == 64
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (0, 1, 2)


def test_weights_are_bf16(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
        assert "lm_head.weight" in names and "model.embed_tokens.weight" in names
        embed = f.get_tensor("model.embed_tokens.weight")
    assert str(embed.dtype) == "torch.bfloat16"
    assert tuple(embed.shape) == (8192, 256)
    assert embed.float().std().item() > 0  # random, not zeros


def test_tokenizer_roundtrip(tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert len(tok) == 8192
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|eos|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Hello, wörld! tramou brea 123 \n\t<|eos|> end"
    ids = tok(text, add_special_tokens=True).input_ids
    assert tok.decode(ids) == text
    assert ids.count(tok.eos_token_id) == 1  # special token recognised, nothing added


def test_deterministic(tiny_model_dir, tmp_path):
    again = make_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha256(again / name) == _sha256(tiny_model_dir / name), name


def test_idempotent(tiny_model_dir):
    mtimes = {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()}
    start = time.perf_counter()
    assert make_model(tiny_model_dir) == tiny_model_dir
    assert time.perf_counter() - start < 0.5
    assert {p.name: p.stat().st_mtime_ns for p in tiny_model_dir.iterdir()} == mtimes


def test_rebuild_on_force_or_changed_params(tmp_path):
    small = dict(vocab_size=1024, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1,
                 intermediate_size=128)
    out = make_model(tmp_path / "m", **small)
    first = _sha256(out / "model.safetensors")
    stamp_mtime = (out / STAMP_FILE).stat().st_mtime_ns

    make_model(out, force=True, **small)
    assert (out / STAMP_FILE).stat().st_mtime_ns != stamp_mtime
    assert _sha256(out / "model.safetensors") == first

    make_model(out, seed=1, **small)  # different parameters: rebuilt in place
    assert json.loads((out / STAMP_FILE).read_text())["seed"] == 1
    assert _sha256(out / "model.safetensors") != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp/old dirs left


def test_rejects_bad_head_split(tmp_path):
    with pytest.raises(ValueError):
        make_model(tmp_path / "bad", hidden_size=256, num_heads=3)
    assert not (tmp_path / "bad").exists()
