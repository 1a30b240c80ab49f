"""What every peer runner shares: its command line, the rows, the engine settings, its result line.

The runners run inside the peers' virtualenv (`make bench-peers`), not the product's, so this
module needs only the standard library and pyarrow. `prefixflow bench peers` (prefixflow/bench/peer_runs.py)
writes the input they read (columns id, prompt, max_tokens, min_tokens: the per-row lengths are
resolved there, once, for every method) and parses the one result line they print.

Everything that must be equal across methods lives here: the engine arguments (prefix caching on,
enforce_eager, the KV cache capped at `num_gpu_blocks_override` blocks per engine, the
engine-worker's max_model_len and max_num_seqs) and the CPU placement (vLLM's
`VLLM_CPU_OMP_THREADS_BIND`, as `prefixflow run` sets it for its replicas).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from versions import versions  # prefixflow/bench/peers/versions.py (this directory is on sys.path: runners run from it)

#: Prefix of the one line a runner prints its result on; anything else on stdout is noise
#: (vLLM, Ray and Daft all print their own lines).
RESULT_MARKER = "PEER_RESULT "

#: The process's start, before vLLM, Ray or Daft are imported: "wall with start-up" counts
#: from here, as `prefixflow run`'s counts from its own start.
STARTED = time.time()

#: Same defaults as the product's engine-worker (prefixflow/shared/process/config.py), so the engines match.
MAX_MODEL_LEN = 4096
MAX_NUM_SEQS = 256
KV_CACHE_SPACE_GIB = "2"


def parser(description: str) -> argparse.ArgumentParser:
    """The flags every runner takes (the method's own ones are added by the runner)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--input", required=True, help="Parquet with id, prompt, max_tokens, min_tokens")
    p.add_argument("--model", required=True, help="model directory")
    p.add_argument("--kv-cache-blocks", type=int, default=0, help="KV blocks per engine (num_gpu_blocks_override; 0: vLLM's own)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--max-num-seqs", type=int, default=MAX_NUM_SEQS)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-row sampling seed: seed + id (as prefixflow's --seed)")
    p.add_argument("--ignore-eos", action="store_true")
    return p


def read_rows(path: str) -> list[dict[str, Any]]:
    """The rows in file order: id, prompt, max_tokens, min_tokens."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["id", "prompt", "max_tokens", "min_tokens"]).to_pylist()


def engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM engine arguments, equal for every engine of every method."""
    out: dict[str, Any] = dict(
        enable_prefix_caching=True,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    if args.kv_cache_blocks:
        out["num_gpu_blocks_override"] = args.kv_cache_blocks
    return out


def sampling_kwargs(args: argparse.Namespace, row: dict[str, Any]) -> dict[str, Any]:
    """`SamplingParams` keyword arguments for one row."""
    seed = None if args.seed is None or not isinstance(row["id"], int) else args.seed + row["id"]
    return dict(
        max_tokens=row["max_tokens"], min_tokens=row["min_tokens"], temperature=args.temperature,
        top_p=args.top_p, seed=seed, ignore_eos=args.ignore_eos,
    )


def cores() -> list[int]:
    """The CPU ids this process may run on (its affinity mask, so a container's limit counts)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def id_list(ids: list[int]) -> str:
    """"0-1" for a contiguous run, "0,2" otherwise: vLLM's VLLM_CPU_OMP_THREADS_BIND syntax."""
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids))


def place_engine(core_ids: list[int]) -> None:
    """Pin the vLLM engine started next in this process (or its children) to `core_ids`,
    with the KV-cache budget `prefixflow run` gives each replica. Must run before vLLM
    reads its environment (it reads it at engine start)."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = id_list(core_ids)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_SPACE_GIB)


def emit(result: dict[str, Any]) -> None:
    """Print the result line (and flush: the engines' teardown may print after it)."""
    result = {**result, "versions": versions()}  # this interpreter's: the peers' venv
    print(RESULT_MARKER + json.dumps(result, sort_keys=True), flush=True)


def token_totals(prompt: int, cached: int, output: int) -> dict[str, Any]:
    return dict(
        prompt_tokens=prompt, cached_tokens=cached, output_tokens=output,
        hit_rate=round(cached / prompt, 4) if prompt else 0.0,
    )
