"""Engines behind the engine-worker: real vLLM (`AsyncLLM`) and `echo` (no model)."""

from __future__ import annotations

import os

from prefixflow.services.engine_worker.engines.base import (
    BatchEngine,
    Completion,
    Engine,
    EngineDead,
    EngineStats,
    RequestFailed,
    is_engine_death,
)

__all__ = [
    "BatchEngine", "Completion", "Engine", "EngineDead", "EngineStats", "RequestFailed", "is_engine_death", "make_engine",
]


def gpu_count() -> int:
    """GPUs this process may use: CUDA_VISIBLE_DEVICES's count, else torch's."""
    from prefixflow.services.engine_worker.engine_args import visible_gpus

    n = visible_gpus(dict(os.environ))
    if n is not None:
        return n
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def make_engine(cfg) -> Engine:
    if cfg.engine == "echo":
        from prefixflow.services.engine_worker.engines.echo import EchoEngine, InstantEchoEngine

        cls = EchoEngine if cfg.echo_delay or cfg.echo_token_delay else InstantEchoEngine
        return cls(cfg.echo_delay, crash_token=cfg.echo_crash_token, crash_after=cfg.echo_crash_after,
                   start_seconds=cfg.echo_start_seconds, token_delay=cfg.echo_token_delay)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # Let vLLM's log records reach our structlog handler instead of its own.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if cfg.gpus:  # before vLLM (and torch's CUDA) start
        os.environ["CUDA_VISIBLE_DEVICES"] = cfg.gpus
    from prefixflow.services.engine_worker.engine_args import placement_defaults, split as split_engine_args
    from prefixflow.services.engine_worker.engines.vllm import VllmEngine

    return VllmEngine(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        kv_cache_blocks=cfg.kv_cache_blocks,
        max_num_seqs=cfg.max_num_seqs,
        placement=placement_defaults(gpu_count(), cfg.enforce_eager),
        engine_argv=split_engine_args(cfg.engine_args),
        task=cfg.task,
    )
