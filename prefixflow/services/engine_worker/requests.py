"""A prompt's sampling as vLLM's own parameters: `SamplingParams` with
`StructuredOutputsParams` for constrained output (xgrammar). The mapping is pure; vLLM is
imported by the caller's first request (only the vLLM engine uses this module)."""

from __future__ import annotations

from typing import Any

from prefixflow.shared.wire import messages as m

_sampling_decoder = m.sampling_decoder


def prompt_sampling(prompt: m.Prompt, job: m.SamplingSpec) -> m.SamplingSpec:
    """The row's own sampling when it has one (validated by the ingestor), else the job's."""
    return _sampling_decoder.decode(prompt.sampling) if prompt.sampling else job


def structured_kwargs(spec: m.StructuredSpec | None) -> dict[str, Any] | None:
    """`StructuredOutputsParams` keyword arguments of a structured-output form."""
    if spec is None:
        return None
    if spec.json_schema is not None:
        return {"json": spec.json_schema}
    if spec.regex is not None:
        return {"regex": spec.regex}
    if spec.choice is not None:
        return {"choice": list(spec.choice)}
    if spec.grammar is not None:
        return {"grammar": spec.grammar}
    return {"json_object": True}


def sampling_kwargs(spec: m.SamplingSpec, seed: int | None) -> dict[str, Any]:
    """`SamplingParams` keyword arguments (structured output still as a dict)."""
    kwargs: dict[str, Any] = {
        "max_tokens": spec.max_tokens,
        "min_tokens": spec.min_tokens,
        "temperature": spec.temperature,
        "top_p": spec.top_p,
        "top_k": max(0, spec.top_k),  # -1 and 0 both disable top-k
        "seed": seed,
        "ignore_eos": spec.ignore_eos,
        "stop": list(spec.stop) or None,
        "presence_penalty": spec.presence_penalty,
        "frequency_penalty": spec.frequency_penalty,
        "n": spec.n,
        "logprobs": spec.logprobs,
    }
    structured = structured_kwargs(spec.structured)
    if structured is not None:
        kwargs["structured_outputs"] = structured
    return kwargs


def sampling_params(spec: m.SamplingSpec, seed: int | None):
    """vLLM `SamplingParams` (final output only) for one prompt."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    kwargs = sampling_kwargs(spec, seed)
    if "structured_outputs" in kwargs:
        kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    return SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **kwargs)


def token_logprobs(token_ids, logprobs) -> list[dict[str, Any]]:
    """vLLM's per-token logprobs (a dict token id -> `Logprob` per position) as rows:
    the sampled token, its logprob, and the alternatives by rank."""
    if not logprobs:
        return []
    out = []
    for tid, pos in zip(token_ids, logprobs, strict=False):
        chosen = pos.get(tid)
        top = sorted((lp for t, lp in pos.items()), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
        out.append({
            "token": (chosen.decoded_token if chosen is not None else None) or "",
            "logprob": float(chosen.logprob) if chosen is not None else None,
            "top": [{"token": lp.decoded_token or "", "logprob": float(lp.logprob)} for lp in top],
        })
    return out
