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


FALLBACK_MAX_LEN = 4096
"""Context length assumed for a model whose config cannot be read (the engines still check)."""


def model_max_len(model: str) -> int:
    """The model's context length as vLLM derives it for the common configs: its
    config's `max_position_embeddings` (or `n_positions`, `max_seq_len`, `seq_length`), of
    a local directory or a hub id's (fetched like its tokenizer); FALLBACK_MAX_LEN if
    neither can be read."""
    config = Path(model) / "config.json"
    if not config.exists() and not Path(model).exists():
        try:
            from huggingface_hub import hf_hub_download

            config = Path(hf_hub_download(model, "config.json"))
        except Exception:  # noqa: BLE001 - offline, gated, not a model: the engines check lengths too
            return FALLBACK_MAX_LEN
    if not config.exists():
        return FALLBACK_MAX_LEN
    data = json.loads(config.read_text())
    data = {**data.get("text_config", {}), **data}
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        if isinstance(data.get(key), int):
            return data[key]
    return FALLBACK_MAX_LEN
