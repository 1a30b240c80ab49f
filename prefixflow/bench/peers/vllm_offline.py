"""Peer: plain vLLM offline, one engine on every core, `LLM.generate` over the whole dataset.

`--order dataset` submits the prompts in file order; `--order sorted` sorts them by prompt text
first (the sort is timed), so prompts sharing a prefix run next to each other: the simplest thing
a user of vLLM would do for prefix caching. vLLM's scheduler then admits them FCFS.

Hit rate: cached / prompt tokens over `RequestOutput.num_cached_tokens` and the prompt token ids.
Prints one line `PEER_RESULT {json}` (common.emit).
"""

from __future__ import annotations

import time

import common


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--order", choices=("dataset", "sorted"), default="dataset")
    args = p.parse_args()
    all_cores = common.cores()
    common.place_engine(all_cores)

    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, **common.engine_args(args))
    ready = time.time()
    rows = common.read_rows(args.input)
    if args.order == "sorted":
        rows.sort(key=lambda r: r["prompt"])
    params = [SamplingParams(**common.sampling_kwargs(args, r)) for r in rows]
    outputs = llm.generate([r["prompt"] for r in rows], params, use_tqdm=False)
    done = time.time()
    cache = llm.llm_engine.vllm_config.cache_config

    errors = sum(1 for o in outputs if not o.finished)
    prompt = sum(len(o.prompt_token_ids or ()) for o in outputs)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    output = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    common.emit(
        dict(
            method=f"vllm-{args.order}",
            rows=len(outputs),
            errors=errors,
            **common.token_totals(prompt, cached, output),
            startup_seconds=round(ready - common.STARTED, 3),
            run_seconds=round(done - ready, 3),
            engines=[{"cores": common.id_list(all_cores), "kv_cache_blocks": cache.num_gpu_blocks, "block_size": cache.block_size}],
        )
    )


if __name__ == "__main__":
    main()
