"""What the ingestor's plan needs of the model, loaded from its directory or hub id:
the fast tokenizer (no vLLM, no transformers at start-up) and the chat renderer."""

from __future__ import annotations

from prefixflow.services.ingestor.chat import TEMPLATE_TIMEOUT, renderer_for
from prefixflow.services.ingestor.plan import Model
from prefixflow.services.ingestor.row import model_names
from prefixflow.shared.prefix.tokenize import load_tokenizer, model_max_len


def load_model(model: str, max_model_len: int, hash_block_size: int, chat_template_timeout: float = TEMPLATE_TIMEOUT) -> Model:
    tokenizer = load_tokenizer(model)
    return Model(
        encode_batch=lambda texts: [e.ids for e in tokenizer.encode_batch_fast(texts)],
        vocab_size=tokenizer.get_vocab_size(),
        max_model_len=min(max_model_len, model_max_len(model)) if max_model_len else model_max_len(model),
        hash_block_size=hash_block_size,
        render_chat=renderer_for(model, chat_template_timeout).render,
        # vLLM tokenizes a rendered conversation without adding special tokens.
        encode_chat_batch=lambda texts: [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False)],
        names=model_names(model),
    )
