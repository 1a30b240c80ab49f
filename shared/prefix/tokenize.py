"""Loading the model's tokenizer without importing vLLM or transformers (fast start)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer


def load_tokenizer(model: str) -> Tokenizer:
    """The `tokenizers` tokenizer of a local model directory or a hub id."""
    path = Path(model)
    if (path / "tokenizer.json").exists():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    if path.exists():
        raise FileNotFoundError(f"{path} has no tokenizer.json")
    return Tokenizer.from_pretrained(model)


def model_max_len(model: str, default: int) -> int:
    """`max_position_embeddings` of a local model, else `default`."""
    config = Path(model) / "config.json"
    if config.exists():
        return int(json.loads(config.read_text()).get("max_position_embeddings", default))
    return default
