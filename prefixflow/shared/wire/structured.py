"""The cheap check of a structured-output form, run on every decode of a `StructuredSpec`
(`prefixflow/shared/wire/messages.py`): exactly one form, a JSON Schema valid against its
meta-schema, a non-empty choice of strings. Compiling a form with xgrammar is
`prefixflow/shared/wire/sampling.py`'s job. The form's size limits (`limits.py`) come
first. Pure: imports neither the messages nor NATS."""

from __future__ import annotations

from typing import Any

import msgspec

from prefixflow.shared.wire.limits import structured_error

FORMS = ("json_schema", "regex", "choice", "grammar", "json_object")
"""Structured-output forms a job or row may give (at most one)."""
ROW_FIELDS = ("sampling", "response_format", *FORMS)
"""Row columns that set the row's own sampling."""


def check_structured(spec: Any) -> None:
    """Raise ValueError unless `spec` (a `StructuredSpec`) gives exactly one valid form."""
    given = [f for f in FORMS if getattr(spec, f) not in (None, False)]
    if len(given) != 1:
        raise ValueError(f"structured output wants exactly one of {', '.join(FORMS)} (got {', '.join(given) or 'none'})")
    # NOTE: the depth first: encoding (and checking) a deeply nested schema recurses.
    if (why := structured_error(spec.json_schema, spec.choice, 0)) is not None:
        raise ValueError(why)
    if (why := structured_error(None, None, len(msgspec.json.encode(spec)))) is not None:
        raise ValueError(why)
    if spec.json_schema is not None:
        from jsonschema import exceptions, validators

        try:
            validators.validator_for(spec.json_schema).check_schema(spec.json_schema)
        except exceptions.SchemaError as exc:
            raise ValueError(f"invalid JSON schema: {exc.message} (at {'/'.join(map(str, exc.path)) or 'the top'})") from None
    if spec.choice is not None and (not spec.choice or not all(isinstance(c, str) and c for c in spec.choice)):
        raise ValueError("choice wants a non-empty list of non-empty strings")
    if spec.regex is not None and (not spec.regex or "\x00" in spec.regex):
        raise ValueError("regex must be non-empty and hold no NUL character")
    if spec.grammar is not None and not spec.grammar.strip():
        raise ValueError("grammar is empty")
