"""Every vLLM engine argument, through vLLM's own definitions (`AsyncEngineArgs.add_cli_args`,
the parser behind `vllm serve`), not a hand-copied subset.

The engine-worker takes them after its own flags (`prefixflow serve engine-worker
--replica r0 --max-num-batched-tokens 512 --dtype float32`, or after `--`), or in
`--engine-args` / `PFX_ENGINE_ARGS` as one shell-quoted string. They are parsed by vLLM's
parser when the worker starts (a bad one fails at once, with vLLM's message) and laid
over prefixflow's defaults: prefix caching on, priority scheduling (prefix groups), the
worker's `--model`, `--max-model-len`, `--max-num-seqs`, `--kv-cache-blocks`, and the
placement's (`placement_defaults`): CUDA graphs on GPUs (`enforce_eager` only without
one), tensor parallel over the replica's GPUs, float32 on a CPU without native 16-bit floats. An argument given explicitly wins over those defaults, and
`--no-enable-prefix-caching` is honoured (the router then finds no cache to exploit).
`--lora-modules NAME=PATH ...` (vLLM's server flag) starts the engine with those LoRA
adapters (`lora.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import Any

from prefixflow.shared.outcomes import Exit


def visible_gpus(environ: dict[str, str]) -> int | None:
    """GPUs `CUDA_VISIBLE_DEVICES` gives this process; None when it is not set (then ask
    torch). An empty value or -1 hides every GPU."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    ids = [v for v in value.split(",") if v.strip()]
    if ids and ids[0].strip() == "-1":
        return 0
    return len(ids)


NATIVE_HALF = frozenset({"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "bf16", "fphp"})
"""CPU flags of native 16-bit float arithmetic (x86: AVX-512 BF16/FP16, AMX; Arm: the
BF16 and FP16 features), as /proc/cpuinfo names them."""


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, Arm `Features`); empty where unreadable."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def cpu_dtype(flags: frozenset[str]) -> str | None:
    """The dtype a model runs in on this CPU by default: "float32" where the CPU has no
    native 16-bit float arithmetic (bf16 and fp16 are emulated there: the tiny local model
    ran 5.5x slower in bf16 than in float32 on an AVX2 EPYC, docs/architecture.md), None
    (the model's own) where it has. Unknown flags (none read): None."""
    return "float32" if flags and not flags & NATIVE_HALF else None


def placement_defaults(gpus: int, enforce_eager: bool | None = None,
                       flags: frozenset[str] | None = None) -> dict[str, Any]:
    """Engine defaults that follow the replica's devices: without a GPU, eager mode (graph
    capture would only cost start-up time) and float32 on a CPU without native 16-bit
    floats (`cpu_dtype`); on GPUs, CUDA graphs and tensor parallel over all of the
    replica's GPUs. An explicit `enforce_eager` wins, and so does an explicit `--dtype`."""
    out: dict[str, Any] = {
        "enforce_eager": (gpus == 0) if enforce_eager is None else enforce_eager,
        "tensor_parallel_size": max(gpus, 1),
    }
    if gpus == 0 and (dtype := cpu_dtype(cpu_flags() if flags is None else flags)) is not None:
        out["dtype"] = dtype
    return out


def split(engine_args: str, extra: list[str] | None = None) -> list[str]:
    """The worker's vLLM arguments: the `--engine-args` string, then the loose ones."""
    argv = shlex.split(engine_args) if engine_args else []
    return argv + [a for a in extra or [] if a != "--"]  # a bare `--` is only a separator


def vllm_parser(prog: str = "vLLM engine arguments") -> argparse.ArgumentParser:
    """vLLM's own engine-argument parser (imports vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog=prog, add_help=False)
    AsyncEngineArgs.add_cli_args(parser)
    return parser


def explicit(argv: list[str]) -> dict[str, Any]:
    """`AsyncEngineArgs` fields given in `argv`, parsed by vLLM's parser (only those
    given: every default is suppressed). Exits with vLLM's message on a bad argument.
    `--lora-modules` is left to `lora.py` (it is not an engine argument in vLLM)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    from prefixflow.services.engine_worker.lora import split_lora_modules

    argv, _ = split_lora_modules(argv)
    if not argv:
        return {}
    parser = vllm_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    ns = parser.parse_args(argv)
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    unknown = set(vars(ns)) - fields
    return {k: v for k, v in vars(ns).items() if k not in unknown}


def build(defaults: dict[str, Any], argv: list[str]):
    """`AsyncEngineArgs`: prefixflow's defaults, then the arguments given."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**{**defaults, **explicit(argv)})


class HelpWithEngineArgs(argparse.Action):
    """`-h/--help` of `serve engine-worker`: the worker's flags, then vLLM's."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        parser.print_help()
        print("\nvLLM engine arguments (vLLM's own definitions, as for `vllm serve`; after the flags above,\n"
              "after `--`, or in --engine-args; they override prefixflow's engine defaults), and vLLM's\n"
              "`--lora-modules NAME=PATH ...` (LoRA adapters rows may name in their `lora` column):\n")
        print(vllm_parser(prog=parser.prog).format_help())
        sys.exit(Exit.OK)
