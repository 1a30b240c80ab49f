"""LoRA adapters of an engine: `--lora-modules NAME=PATH ...` among the engine arguments.

vLLM's `--lora-modules` belongs to its OpenAI server, not to its engine arguments, so the
worker takes it out of the argument list before vLLM's engine parser sees the rest, and
parses it with vLLM's own action (`name=path`, or the JSON form `{"name", "path"}`). The
engine then starts with LoRA on and defaults that fit the adapters given: its largest
rank (`max_lora_rank`, rounded up to a rank vLLM accepts), every adapter kept in CPU
memory (`max_cpu_loras`), `max_loras` adapters at once (vLLM's default slots,
`DEFAULT_SLOTS`, or fewer adapters). An explicit engine argument wins. A path without an
`adapter_config.json` stops the worker at start-up with that message.

A row names its adapter (`Prompt.lora`); the engine serves it with that adapter's
`LoRARequest`, and a name it does not serve is that row's error.

NOTE: vLLM's CPU LoRA kernels (`vllm/lora/ops/torch_ops`) index the adapter slots with
the "no adapter" index -1, which selects the last slot: a base-model request that runs
beside adapter requests gets the last loaded adapter applied. On CPU the worker therefore
serves base-model requests through an adapter of zeros (`BASE_STANDIN`, one more slot),
which adds exactly nothing; GPUs run them without an adapter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

BASE_STANDIN = "prefixflow-base"
"""The zero adapter that serves base-model requests on CPU (see the note above); its KV
events count as the base model's (`kv_events.py`)."""
DEFAULT_SLOTS = 4
"""Adapters an engine runs at once without `--max-loras` (at most the adapters given)."""
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM accepts."""


def split_lora_modules(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(`argv` without `--lora-modules ...`, {adapter name: path}) with vLLM's parser action."""
    if not any(a == "--lora-modules" or a.startswith("--lora-modules=") for a in argv):
        return list(argv), {}
    from vllm.entrypoints.launchers.cli_args import LoRAParserAction

    parser = argparse.ArgumentParser(prog="--lora-modules", add_help=False, allow_abbrev=False)
    parser.add_argument("--lora-modules", nargs="+", action=LoRAParserAction, default=[])
    ns, rest = parser.parse_known_args(argv)
    modules: dict[str, str] = {}
    for module in ns.lora_modules:
        if module.name in modules:
            raise ValueError(f"--lora-modules: adapter {module.name!r} given twice")
        modules[module.name] = module.path
    return rest, modules


def adapter_rank(path: str) -> int:
    """The rank `r` of the PEFT adapter at `path` (its `adapter_config.json`)."""
    config = Path(path) / "adapter_config.json"
    try:
        data = json.loads(config.read_text())
    except OSError as exc:
        raise ValueError(f"LoRA adapter at {path!r}: cannot read {config.name} ({exc.strerror})") from None
    except ValueError as exc:
        raise ValueError(f"LoRA adapter at {path!r}: {config.name} is not JSON ({exc})") from None
    ranks = [data.get("r", 0), *(data.get("rank_pattern") or {}).values()]
    return max(int(r) for r in ranks)


def lora_args(modules: dict[str, str], explicit: dict[str, Any], standin: bool = False) -> dict[str, Any]:
    """Engine arguments for serving `modules` (`explicit`: those given on the command line,
    which win; `standin`: one more slot for `BASE_STANDIN`)."""
    if not modules:
        return {}
    rank = max(adapter_rank(path) for path in modules.values())
    fitting = [r for r in VLLM_RANKS if r >= rank]
    if not fitting:
        raise ValueError(f"LoRA rank {rank} is over vLLM's largest ({VLLM_RANKS[-1]})")
    slots = (explicit.get("max_loras") or min(len(modules), DEFAULT_SLOTS)) + standin
    return {
        "enable_lora": True,
        "max_lora_rank": fitting[0],
        "max_loras": slots,
        "max_cpu_loras": max(len(modules) + standin, slots),
    }


def zero_adapter(model: str, rank: int = 1) -> str:
    """A PEFT adapter of zeros for `model` (on its attention query projections): serving a
    request through it gives exactly the base model's output. Built once per model shape
    in the temporary directory; returns its path."""
    import hashlib
    import os
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model) / "config.json").read_text())
    hidden = config["hidden_size"]
    q = config["num_attention_heads"] * (config.get("head_dim") or hidden // config["num_attention_heads"])
    layers = config["num_hidden_layers"]
    digest = hashlib.sha256(json.dumps([hidden, q, layers, rank]).encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"prefixflow-zero-lora-{digest}"
    if (out / "adapter_model.safetensors").is_file():
        return str(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        tensors = {}
        for layer in range(layers):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
            tensors[f"{prefix}.lora_A.weight"] = torch.zeros(rank, hidden)
            tensors[f"{prefix}.lora_B.weight"] = torch.zeros(q, rank)
        save_file(tensors, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["q_proj"], "bias": "none"}))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, out)  # another worker may have built it meanwhile: theirs is the same
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def lora_requests(modules: dict[str, str], base: str | None = None) -> dict[str, Any]:
    """{name: vLLM `LoRARequest`}, ids from 1 in the order given; with `base` (the path of
    a zero adapter), "" (the base model) is served through it as `BASE_STANDIN`."""
    from vllm.lora.request import LoRARequest

    out = {name: LoRARequest(name, i, str(Path(path).resolve())) for i, (name, path) in enumerate(modules.items(), 1)}
    if base is not None:
        out[""] = LoRARequest(BASE_STANDIN, len(modules) + 1, base)
    return out


def unknown_adapter(lora: str, served: list[str], base: str = "") -> str:
    """The error row of a prompt asking for an adapter this engine does not serve (`base`:
    the model's path: its last name, or no name, means the base model)."""
    have = ", ".join(repr(a) for a in served) if served else "none"
    name = f" {Path(base).name!r}" if base else ""
    return (f"unknown LoRA adapter {lora!r}: not the base model{name}, nor an adapter this replica serves ({have}); "
            "name the base model by its name or not at all")
