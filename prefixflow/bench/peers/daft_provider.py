"""Peer: Daft's `vllm-prefix-caching` provider, on Daft's native runner or on Ray.

The query is what Daft's documentation shows for `daft.functions.prompt`:

    daft.read_parquet(input).with_column("output", prompt(col("prompt"), provider="vllm-prefix-caching", ...))

The provider (daft/ai/vllm, daft/execution/vllm.py, installed version in the result) buckets the
prompts by prefix in Daft's streaming sink (`max_buffer_size`, `min_bucket_size`,
`prefix_match_threshold`; its defaults unless given here) and hands each bucket to a vLLM
`AsyncLLMEngine`: one in-process engine on the native runner (every core), or `concurrency` Ray
actors behind Daft's `PrefixRouter` (`load_balance_threshold`) on Ray, one actor per core set
(`--engines`, default one per core), pinned by daft_hook.py.

What the provider does not expose is measured around it:
- its engines' start-up (daft_hook.py records when each engine was ready): "run seconds" count
  from the last engine ready to the last row collected;
- tokens and hits: vLLM's own Prometheus counters (`vllm:prompt_tokens_by_source`,
  `vllm:prompt_tokens_cached`, `vllm:generation_tokens`, `vllm:request_success`) from every engine
  process, through prometheus_client's multiprocess mode (a fresh `PROMETHEUS_MULTIPROC_DIR`).
  `vllm:prompt_tokens_cached` adds up the same per-request `num_cached_tokens` that
  `RequestOutput` reports, so the hit rate is comparable with the other methods'.

The provider takes one `SamplingParams` for the whole query (`generate_args["sampling_params"]`):
per-row lengths cannot be given. When the rows' (max_tokens, min_tokens) differ, every row gets
their rounded means (same total output) and the result says so in `sampling_note`.
Prints one line `PEER_RESULT {json}` (common.emit).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import daft_hook

#: vLLM counters read after the query: name -> result field.
COUNTERS = {
    "vllm:prompt_tokens_by_source": "prompt_tokens",
    "vllm:prompt_tokens_cached": "cached_tokens",
    "vllm:generation_tokens": "output_tokens",
    "vllm:request_success": "requests",
}

#: The provider's bucketing and routing options this runner can set (Daft's defaults otherwise).
DAFT_OPTIONS = ("max_buffer_size", "min_bucket_size", "prefix_match_threshold", "load_balance_threshold", "batch_size")


def core_sets(cores: list[int], engines: int) -> list[str]:
    """Split the cores into `engines` contiguous sets ("0|1" for 2 on 2 cores), as `prefixflow
    run` divides them among its replicas; with more engines than cores, cores are shared."""
    n = len(cores)
    if engines >= n:
        return [str(cores[i % n]) for i in range(engines)]
    return [common.id_list(cores[i * n // engines : (i + 1) * n // engines]) for i in range(engines)]


def uniform_sampling(rows: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The one row whose lengths every row gets, and a note when the rows' own lengths differ."""
    lengths = {(r["max_tokens"], r["min_tokens"]) for r in rows}
    if len(lengths) <= 1:
        return rows[0], None
    mean_max = round(sum(r["max_tokens"] for r in rows) / len(rows))
    mean_min = min(mean_max, round(sum(r["min_tokens"] for r in rows) / len(rows)))
    note = (f"Daft's provider takes one SamplingParams: {len(lengths)} distinct per-row lengths replaced by "
            f"their means max_tokens={mean_max}, min_tokens={mean_min}")
    return {**rows[0], "max_tokens": mean_max, "min_tokens": mean_min}, note


def counter_totals(prom_dir: str) -> dict[str, int]:
    """Sum of each vLLM counter in `COUNTERS` over every label set and every process."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=prom_dir)
    totals = {field: 0 for field in COUNTERS.values()}
    for family in registry.collect():
        field = COUNTERS.get(family.name)
        if field is None:
            continue
        totals[field] += int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return totals


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--runner", choices=("native", "ray"), default="native")
    p.add_argument("--engines", type=int, default=0, help="Ray engine actors (the provider's concurrency; default: one per core)")
    for name in DAFT_OPTIONS:
        kind = float if name == "prefix_match_threshold" else int
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=None, help="the provider's option (default: Daft's)")
    args = p.parse_args()

    # 1. Before Daft, Ray or vLLM are imported: where engines and their counters go.
    run_dir = Path(tempfile.mkdtemp(prefix="pfx-daft-"))
    prom_dir = run_dir / "prometheus"
    prom_dir.mkdir()
    cores = common.cores()
    engines = 1 if args.runner == "native" else (args.engines or len(cores))
    sets = core_sets(cores, engines)
    here = str(Path(__file__).resolve().parent)
    env = {
        "PROMETHEUS_MULTIPROC_DIR": str(prom_dir),
        daft_hook.RUN_DIR: str(run_dir),
        daft_hook.CORES: "|".join(sets),
        "VLLM_CPU_KVCACHE_SPACE": common.KV_CACHE_SPACE_GIB,
        # Ray workers import daft_hook (their setup hook) from here.
        "PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])),
    }
    os.environ.update(env)

    import daft
    from daft.functions.ai import prompt
    from vllm import SamplingParams

    rows = common.read_rows(args.input)
    row, note = uniform_sampling(rows)
    sampling = SamplingParams(**common.sampling_kwargs(args, {**row, "id": None}))
    if args.runner == "ray":
        import ray

        ray.init(runtime_env={"env_vars": env, "worker_process_setup_hook": "daft_hook.setup"}, include_dashboard=False)
        daft.set_runner_ray()
    else:
        daft_hook.setup()
        daft.set_runner_native()
    options = {name: getattr(args, name) for name in DAFT_OPTIONS if getattr(args, name) is not None}

    # 2. The query, as a Daft user writes it.
    df = daft.read_parquet(args.input).with_column(
        "output",
        prompt(
            daft.col("prompt"),
            provider="vllm-prefix-caching",
            model=args.model,
            concurrency=engines,
            gpus_per_actor=0,
            engine_args=common.engine_args(args),
            generate_args={"sampling_params": sampling},
            **options,
        ),
    )
    out = df.select("id", "output").to_arrow()
    done = time.time()

    # 3. What the provider did not report.
    built = daft_hook.records(run_dir)
    if len(built) != engines:
        raise SystemExit(f"expected {engines} vLLM engines, {len(built)} were built: {built}")
    ready = built[-1]["ready"]
    totals = counter_totals(str(prom_dir))
    errors = out.num_rows - out.column("output").drop_null().__len__()
    result = dict(
        method=f"daft-{args.runner}",
        rows=out.num_rows,
        errors=errors,
        **common.token_totals(totals["prompt_tokens"], totals["cached_tokens"], totals["output_tokens"]),
        startup_seconds=round(ready - common.STARTED, 3),
        run_seconds=round(done - ready, 3),
        # On Ray the first engine may start work before the last one is ready: the bound on the other side.
        run_seconds_from_first_engine=round(done - built[0]["ready"], 3),
        engines=[{"cores": e["cores"], "startup_seconds": round(e["ready"] - e["started"], 3)} for e in built],
        options={**options, "concurrency": engines, "engine_args": common.engine_args(args)},
        vllm_requests=totals["requests"],
    )
    if note:
        result["sampling_note"] = note
    common.emit(result)
    if args.runner == "ray":
        import ray

        ray.shutdown()
    shutil.rmtree(run_dir, ignore_errors=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
