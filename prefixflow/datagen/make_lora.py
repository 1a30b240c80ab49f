"""Build small random LoRA adapters for the local model (PEFT's on-disk format).

Each adapter is a directory vLLM loads with ``--lora-modules NAME=PATH``:
``adapter_config.json`` (rank, alpha, target modules) and ``adapter_model.safetensors``
(``lora_A`` / ``lora_B`` for the attention and MLP projections of every layer). The
weights are seeded by the adapter's name, so the same name always gives the same
adapter, and they are large enough that greedy outputs differ from the base model's
and from each other's. A ``prefixflow_lora.json`` stamp makes repeated builds no-ops.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import structlog

from prefixflow.datagen.make_model import DEFAULT_MODEL_DIR

STAMP_FILE = "prefixflow_lora.json"
STAMP_VERSION = 1
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_RANK = 8
DEFAULT_NAMES = ("alpha", "beta", "gamma")

log = structlog.get_logger()


def adapter_dir(model_dir: str | Path, name: str) -> Path:
    """Where ``make_adapters`` puts adapter ``name`` of the model in ``model_dir``."""
    model_dir = Path(model_dir)
    return model_dir.parent / f"{model_dir.name}-lora" / name


def make_adapters(
    names: list[str] | tuple[str, ...] = DEFAULT_NAMES,
    *,
    model_dir: str | Path = DEFAULT_MODEL_DIR,
    rank: int = DEFAULT_RANK,
    force: bool = False,
) -> dict[str, Path]:
    """Build one adapter per name beside the model; returns ``{name: path}``."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return {name: _make_adapter(name, config, adapter_dir(model_dir, name), rank, force) for name in names}


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each target projection."""
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]
    return {
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
        "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden),
    }


def _make_adapter(name: str, config: dict, out: Path, rank: int, force: bool) -> Path:
    stamp = {"stamp_version": STAMP_VERSION, "name": name, "rank": rank,
             "base": {k: config[k] for k in ("hidden_size", "num_hidden_layers", "intermediate_size")}}
    if not force and _stamp(out) == stamp:
        return out
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(_seed(name))
    tensors = {}
    mlp = {"gate_proj", "up_proj", "down_proj"}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in _shapes(config).items():
            prefix = f"base_model.model.model.layers.{layer}.{'mlp' if module in mlp else 'self_attn'}.{module}"
            # A and B both random (PEFT starts B at zero, which would change nothing)
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.5
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank,
        "target_modules": list(TARGET_MODULES), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": str(out.parent.parent), "inference_mode": True,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("lora adapter built", name=name, path=str(out), rank=rank)
    return out


def _stamp(out: Path) -> dict | None:
    try:
        stamp = json.loads((out / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None
    return stamp if (out / "adapter_model.safetensors").is_file() else None
