"""Build a tiny, random-weight Llama model plus a locally trained tokenizer.

Used for CPU demos and end-to-end tests: nothing is downloaded. The same arguments
always produce byte-identical files (seeded weight init, a seeded synthetic corpus
and a deterministic BPE training run). The model is written to a temporary directory
beside ``out_dir`` and renamed into place, and a ``prefixflow_model.json`` stamp with
the build parameters makes repeated calls with the same arguments a no-op.

The tokenizer is byte-level BPE (GPT-2 style, ``Ġ`` marks a leading space) with the
special tokens ``<|pad|>`` (id 0), ``<|bos|>`` (id 1), ``<|eos|>`` (id 2) and the chat
markers ``<|im_start|>`` (id 3) and ``<|im_end|>`` (id 4). It adds no special tokens
when encoding, so a prompt's token count is exactly what its text encodes to. Its
``chat_template`` (in ``tokenizer_config.json``) is ChatML style, so chat jobs run on the
local model: every message is ``<|im_start|>ROLE\nCONTENT<|im_end|>\n``, and the
generation prompt is ``<|im_start|>assistant\n``.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import structlog

from prefixflow.shared.process.config import DEFAULT_MODEL

DEFAULT_MODEL_DIR = Path(DEFAULT_MODEL)

STAMP_FILE = "prefixflow_model.json"
STAMP_VERSION = 2  # bump when the build recipe changes, so old models get rebuilt (2: chat template)
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # trainer assigns ids 0..4 in this order
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML: content is a string (vLLM joins a list of text parts with newlines first)."""
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr fl gr kr pl sh st th tr".split()
_VOWELS = "a e i o u ai ea ou io".split()
_CODAS = ["", "", "", "n", "r", "s", "l", "m", "nd", "st"]

log = structlog.get_logger()


def make_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 8192,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 768,
    max_position_embeddings: int = 4096,
    force: bool = False,
) -> Path:
    """Build the model into ``out_dir`` (unless already built with these arguments).

    Returns ``out_dir`` as a Path.
    """
    out_dir = Path(out_dir)
    params = {
        "stamp_version": STAMP_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
    }
    if not force and _is_complete(out_dir, params):
        return out_dir
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, num_heads by num_kv_heads")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        fast_tokenizer = _build_tokenizer(tmp, seed=seed, vocab_size=vocab_size)
        _build_weights(tmp, params, fast_tokenizer)
        (tmp / STAMP_FILE).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            path.chmod(0o644)  # some writers create 0600 files
        if force or not _is_complete(out_dir, params):  # another process may have won the race
            _swap_into_place(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("model built", path=str(out_dir), **params)
    return out_dir


def _is_complete(out_dir: Path, params: dict) -> bool:
    try:
        stamp = json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return False
    return stamp == params and all((out_dir / name).is_file() for name in REQUIRED_FILES)


def _swap_into_place(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, moving any previous (stale) model out of the way."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        out_dir.rename(old)
    tmp.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _synthetic_corpus(seed: int, num_sentences: int = 6000, lexicon_size: int = 8000) -> list[str]:
    """Sentences of pronounceable pseudo-words with a Zipf-like word distribution."""
    rng = random.Random(seed)

    def word() -> str:
        syllables = rng.choice((1, 2, 2, 3, 3, 4))
        return "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))

    lexicon = list(dict.fromkeys(word() for _ in range(lexicon_size)))
    cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(lexicon))))
    sentences = []
    for _ in range(num_sentences):
        words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(6, 18))
        if rng.random() < 0.3:
            words[rng.randrange(len(words) - 1)] += ","
        sentences.append(" ".join(words) + rng.choice(".....?!"))
    return sentences


def _build_tokenizer(out_dir: Path, *, seed: int, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_synthetic_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def _build_weights(out_dir: Path, params: dict, tokenizer) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    config = LlamaConfig(
        vocab_size=params["vocab_size"],
        hidden_size=params["hidden_size"],
        num_hidden_layers=params["num_layers"],
        num_attention_heads=params["num_heads"],
        num_key_value_heads=params["num_kv_heads"],
        head_dim=params["hidden_size"] // params["num_heads"],
        intermediate_size=params["intermediate_size"],
        max_position_embeddings=params["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype=torch.bfloat16,
    )
    torch.manual_seed(params["seed"])
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar on stderr
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if bars_were_enabled:
            hf_logging.enable_progress_bar()
