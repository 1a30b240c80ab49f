"""Engines behind the engine-worker: real vLLM (`AsyncLLM`) and `echo` (no model)."""

from __future__ import annotations

import os

from services.engine_worker.engines.base import Completion, Engine, EngineStats, RequestFailed

__all__ = ["Completion", "Engine", "EngineStats", "RequestFailed", "make_engine"]


def make_engine(cfg) -> Engine:
    if cfg.engine == "echo":
        from services.engine_worker.engines.echo import EchoEngine

        return EchoEngine(cfg.echo_delay)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Let vLLM's log records reach our structlog handler instead of its own.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    from services.engine_worker.engines.vllm import VllmEngine

    return VllmEngine(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        kv_cache_blocks=cfg.kv_cache_blocks,
        max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager,
    )
