"""Sampling of a job and of a row: structured-output forms, per-row overrides, validation.
Pure functions (no I/O, no NATS, no vLLM); the engine-worker maps the result onto vLLM's
`SamplingParams` / `StructuredOutputsParams` (`prefixflow/services/engine_worker/requests.py`).

Two levels of checking a structured-output form:
- `check_structured` (`prefixflow/shared/wire/structured.py`; every decode of a `StructuredSpec`): exactly one form, a JSON
  Schema that is valid against its meta-schema, a non-empty choice of strings. Cheap: it
  runs wherever a job spec is read.
- `compile_structured` (the client before it creates a job; the ingestor for a job spec
  and for every per-row form): compiles the form with xgrammar exactly as vLLM's
  `validate_xgrammar_grammar` does before it accepts a request, so a schema, regex or
  grammar that vLLM would refuse is refused at job creation (or becomes an error row)
  instead of failing inside an engine. xgrammar is imported on first use.

Strict where a user's input enters, lenient on the wire: `SamplingSpec` and
`StructuredSpec` ignore unknown fields (a newer peer may add one), so a user's parameters
go through `user_sampling`, which refuses a field neither struct knows (a typo stays an
error): the CLI's job sampling (`prefixflow/cli/main.py`) and every row's own sampling
(`row_sampling`: input rows, the batch API's request bodies).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import msgspec

from prefixflow.shared.wire.messages import SamplingSpec, StructuredSpec
from prefixflow.shared.wire.structured import FORMS, ROW_FIELDS, check_structured  # noqa: F401 (re-exported)


def refuse_unknown(raw: Mapping[str, Any], cls: type[msgspec.Struct], path: str = "$") -> None:
    """Raise msgspec.ValidationError (msgspec's own words) when `raw` names a field that
    `cls` does not have: the strict check of user input that the lenient wire structs skip."""
    for name in raw:
        if name not in cls.__struct_fields__:
            where = "" if path == "$" else f" - at `{path}`"
            raise msgspec.ValidationError(f"Object contains unknown field `{name}`{where}")


def user_sampling(raw: Mapping[str, Any]) -> SamplingSpec:
    """A user's sampling parameters (`SamplingSpec` fields, `structured` a `StructuredSpec`'s)
    as a `SamplingSpec`, strictly: an unknown field, a value of the wrong type or out of
    range raises msgspec.ValidationError."""
    refuse_unknown(raw, SamplingSpec)
    if isinstance(structured := raw.get("structured"), Mapping):
        refuse_unknown(structured, StructuredSpec, "$.structured")
    return msgspec.convert(raw, SamplingSpec)


def compile_structured(spec: StructuredSpec | None) -> None:
    """Raise ValueError when xgrammar (vLLM's structured-output backend) cannot compile
    the form; mirrors `vllm/v1/structured_output/backend_xgrammar.py`."""
    if spec is None or spec.json_object:
        return
    key = msgspec.json.encode(spec)
    error = _compile_error(key)
    if error is not None:
        raise ValueError(error)


@functools.lru_cache(maxsize=1024)
def _compile_error(key: bytes) -> str | None:
    import xgrammar as xgr

    spec = json.loads(key)
    try:
        if "json_schema" in spec:
            xgr.Grammar.from_json_schema(spec["json_schema"])
        elif "regex" in spec:
            xgr.Grammar.from_regex(spec["regex"])
        elif "choice" in spec:
            xgr.Grammar.from_ebnf(choice_grammar(spec["choice"]))
        elif "grammar" in spec:
            g = spec["grammar"]
            xgr.Grammar.from_ebnf(g) if "::=" in g else xgr.Grammar.from_lark(g)
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError with the reason
        form = next(iter(spec))
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return f"{form} does not compile: {reason.split(': ', 1)[-1] if '.cc:' in reason else reason}"
    return None


def choice_grammar(choice: list[str]) -> str:
    """vLLM's `choice_as_grammar`: an EBNF root that is one of the strings."""
    def escape(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"')

    return "root ::= " + " | ".join(f'"{escape(c)}"' for c in choice)


def from_response_format(rf: Any) -> dict[str, Any]:
    """OpenAI `response_format` -> structured-output fields (`{}` for plain text)."""
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise ValueError("response_format wants an object with a 'type'")  # noqa: TRY004 - a row error is a ValueError
    kind = rf["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise ValueError("response_format json_schema wants {'json_schema': {'name': ..., 'schema': {...}}}")
        return {"json_schema": js["schema"]}
    raise ValueError(f"unknown response_format type {kind!r} (want text, json_object or json_schema)")


def structured_fields(source: dict[str, Any]) -> dict[str, Any] | None:
    """The structured-output form in a dict of options (a row, a `sampling` column, an
    OpenAI request body); None when it has none."""
    out: dict[str, Any] = {}
    if source.get("response_format") is not None:
        out.update(from_response_format(source["response_format"]))
    for form in FORMS:
        if source.get(form) is not None:
            out[form] = source[form]
    if isinstance(out.get("json_schema"), str):  # a schema given as JSON text
        try:
            out["json_schema"] = json.loads(out["json_schema"])
        except ValueError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    return out or None


def row_sampling(job: SamplingSpec, row: dict[str, Any]) -> SamplingSpec | None:
    """The row's own sampling: the job's, overridden by the row's `sampling` column (an
    object of `SamplingSpec` fields; OpenAI's names `max_completion_tokens` and
    `response_format` are accepted) and by a structured-output form given as a column.
    None when the row overrides nothing. Raises ValueError for an unknown field, a value
    out of range or a structured-output form that does not compile."""
    over = row.get("sampling")
    if over is None:
        over = {}
    elif not isinstance(over, dict):
        raise ValueError("'sampling' must be an object of sampling parameters")
    else:  # None means "not given" (a Parquet struct column fills missing keys with None)
        over = {k: v for k, v in over.items() if v is not None}
    if "max_completion_tokens" in over:
        over.setdefault("max_tokens", over.pop("max_completion_tokens"))
    structured = structured_fields({**over, **{k: row[k] for k in ROW_FIELDS[1:] if k in row}})
    for k in ROW_FIELDS[1:]:
        over.pop(k, None)
    if not over and structured is None:
        return None
    merged = msgspec.to_builtins(job)
    merged.update(over)
    if structured is not None:
        merged["structured"] = structured
    try:
        spec = user_sampling(merged)
    except msgspec.ValidationError as exc:
        raise ValueError(f"bad sampling: {exc}") from None
    compile_structured(spec.structured)
    return spec


def job_structured(options: dict[str, Any]) -> dict[str, Any] | None:
    """Structured-output fields for a job from CLI-style options (`json_schema` may be a
    file path or JSON text, `choice` a list or comma-separated string)."""
    opts = {k: v for k, v in options.items() if v not in (None, False, "")}
    if isinstance(opts.get("choice"), str):
        opts["choice"] = [c for c in opts["choice"].split(",") if c]
    for key in ("json_schema", "response_format"):
        value = opts.get(key)
        if isinstance(value, str):
            from pathlib import Path

            text = Path(value).read_text() if not value.lstrip().startswith("{") and Path(value).is_file() else value
            try:
                opts[key] = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"{key} is not valid JSON: {exc}") from None
    if isinstance(opts.get("grammar"), str) and "::=" not in opts["grammar"]:
        from pathlib import Path

        if Path(opts["grammar"]).is_file():
            opts["grammar"] = Path(opts["grammar"]).read_text()
    return structured_fields(opts)
