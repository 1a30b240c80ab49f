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

    gpus = gpu_count()
    if gpus == 0:
        # On CPU, vLLM runs a one-rank model in a worker process of its own beside the engine
        # core (its "mp" executor), unless multiprocessing is off: then the worker runs in the
        # engine core's process ("uni"). AsyncLLM keeps its engine core in a process either
        # way. One process fewer per replica: ~15 CPU-s less per start (every process imports
        # vLLM), ~1 GiB less, and no busy polling between two processes on the same cores
        # (1.7x the prompt tokens/s of the tiny model on 2 cores). An explicit setting wins.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return VllmEngine(
        model=cfg.model,
        max_model_len=cfg.max_model_len,
        kv_cache_blocks=cfg.kv_cache_blocks,
        max_num_seqs=cfg.max_num_seqs,
        placement=placement_defaults(gpus, cfg.enforce_eager),
        engine_argv=split_engine_args(cfg.engine_args),
        task=cfg.task,
    )
