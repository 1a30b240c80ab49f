"""What one row (or one job) may ask of an engine: the bounds on sampling parameters whose
cost grows without limit, checked wherever a `SamplingSpec` or `StructuredSpec` is built
or decoded (`prefixflow/shared/wire/messages.py`), so a row over one is an error row
naming the limit and a job over one fails at creation. Pure: no NATS, no vLLM.

The table of every limit, with the ones msgspec's field constraints keep (`n`,
`max_tokens`, `logprobs`, ...), is docs/limits.md; keep the two in step.
"""

from __future__ import annotations

from typing import Any

DOC = "docs/limits.md"
"""Where a limit's error text sends the user."""

MAX_STOP = 4
"""Stop strings per row (OpenAI's limit). NOTE: vLLM checks every stop string against the
new text of every sequence at every step, so the cost grows with their number and length."""
MAX_STOP_CHARS = 1024
"""Characters of one stop string."""
MAX_STRUCTURED_BYTES = 64 << 10
"""Size of a structured-output form (its JSON text: schema, regex, choices or grammar).
NOTE: xgrammar compiles each distinct form (in the ingestor and again in the engine)
in time that grows faster than its size."""
MAX_CHOICES = 1024
"""Strings of a `choice` form."""
MAX_SCHEMA_DEPTH = 64
"""Nesting of objects and arrays in a `json_schema` form. NOTE: checking a schema
(jsonschema) and compiling it (xgrammar) recurse per level: a schema nested ~150 deep
raises RecursionError in the checker, which no row may make a service do."""


def over(what: str, got: int, limit: int, unit: str) -> str:
    """The error text of a value over a limit: names the limit and where it is documented."""
    return f"{what}: {got} {unit}, over the limit of {limit} ({DOC})"


def sampling_error(stop: list[str]) -> str | None:
    """Why a sampling's own fields (not its structured form) are over a limit; None if not."""
    if len(stop) > MAX_STOP:
        return over("stop", len(stop), MAX_STOP, "strings")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        return over("stop string", longest, MAX_STOP_CHARS, "characters")
    return None


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of objects and arrays in `value`, counted without recursion; stops
    counting once past `limit` (returns limit + 1)."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list | tuple):
            children = node
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return limit + 1
        stack.extend((child, depth + 1) for child in children)
    return deepest


def structured_error(json_schema: Any, choice: list[str] | None, size: int) -> str | None:
    """Why a structured-output form is over a limit (`size`: its JSON text's bytes); None
    if not. Checked before the form itself (a schema is validated recursively)."""
    if json_schema is not None and (depth := json_depth(json_schema, MAX_SCHEMA_DEPTH)) > MAX_SCHEMA_DEPTH:
        return over("json_schema", depth, MAX_SCHEMA_DEPTH, "levels of nesting (or more)")
    if choice is not None and len(choice) > MAX_CHOICES:
        return over("choice", len(choice), MAX_CHOICES, "strings")
    if size > MAX_STRUCTURED_BYTES:
        return over("structured output", size, MAX_STRUCTURED_BYTES, "bytes of JSON")
    return None


# --- a row's deadline -----------------------------------------------------------------

ROW_TIMEOUT = 1800.0
"""Seconds a row may take from its first admission to an engine until it is finished
(`JobSpec.row_timeout`, `--row-timeout`; 0: no deadline)."""
TIMED_OUT = "row timed out"
"""How the error row of a row past its deadline begins (the sink counts them by it)."""


def timeout_error(row_timeout: float) -> str:
    """The error row's text of a row past its deadline: names the limit."""
    return (f"{TIMED_OUT}: not finished {row_timeout:g} s after its first admission to an engine "
            f"(--row-timeout {row_timeout:g}; {DOC})")


def time_left(admitted_at: float, row_timeout: float, now: float) -> float | None:
    """Seconds a row admitted at `admitted_at` (Unix time) still has at `now`; None when
    the job sets no deadline. Zero or less: past it."""
    if not row_timeout or row_timeout <= 0:
        return None
    return admitted_at + row_timeout - now
