"""A job is what it was asked to do (issue 39): the fingerprint of its input and of its spec.

A job's identity is not its output directory: a job's spec (`JobSpec.fingerprint`, in the
jobs bucket) and its directory's manifest (`_job.json`, written by the sink) carry

- `input`: the input's fingerprint, by kind of source (`prefixflow/client/fingerprint.py`
  computes it: content, not where or when the file was written; a copy is the same job);
- `spec`: every spec field that changes the outputs (model, task, chat template and its
  variables, each sampling parameter, structured output), as canonical JSON text, a
  digest past `VALUE_CHARS`. A field at its default is left out, so a field added later
  with a default changes no earlier job's fingerprint.

The same fingerprint resumes a job or reports it done; another one into the same output
is refused (exit code 2) naming the difference (`difference`), unless `--overwrite`. A
fingerprint that is missing (a manifest or spec written before prefixflow recorded one)
or of another scheme is unknown: the job is taken as the same one, as before.
Pure: no I/O (the sink compares too, so this lives in `shared`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

SPEC_FIELDS = ("model", "task", "chat_template", "chat_template_kwargs")
"""The `JobSpec` fields (besides `sampling`, which is taken field by field) that change a
job's outputs. Not: `out_dir`, `overwrite`, `priority`, `expires_at`, `deliver`, times."""
VALUE_CHARS = 64
"""A spec value's JSON text longer than this is kept as a digest (a chat template, a
JSON schema): the manifest stays small and the difference still names the field."""


class Fingerprint(msgspec.Struct, omit_defaults=True):
    """What a job was asked to do: its input and its spec (see the module docstring)."""

    input: dict[str, Any] = msgspec.field(default_factory=dict)
    """{"kind": parquet|jsonl|csv|file|dataset, "scheme": n, "size": bytes, "digest": hex}
    (a dataset: also "files", how many)."""
    spec: dict[str, str] = msgspec.field(default_factory=dict)
    """Spec field (`sampling.max_tokens`, `model`, ...) -> its canonical text or digest."""


def canonical(value: Any) -> str:
    """A value's canonical JSON text (keys sorted), or `sha256:<hex>` of it when long."""
    text = msgspec.json.encode(value, order="sorted").decode()
    if len(text) <= VALUE_CHARS:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:32]


def not_default(struct: msgspec.Struct) -> dict[str, Any]:
    """A struct's fields whose value is not their default (by `==`: msgspec's own
    `omit_defaults` keeps a float equal to its default but not the same object)."""
    out = {}
    for field in msgspec.structs.fields(struct):
        if field.default is not msgspec.NODEFAULT:
            default = field.default
        elif field.default_factory is not msgspec.NODEFAULT:
            default = field.default_factory()
        else:
            default = msgspec.NODEFAULT
        if (value := getattr(struct, field.name)) != default:
            out[field.name] = value
    return out


def spec_fields(spec: Any) -> dict[str, str]:
    """The spec part of a job's fingerprint (`spec`: a `messages.JobSpec`, which holds a
    `Fingerprint`, so it is not imported here): each field that changes its outputs and is
    not at its default."""
    doc = not_default(spec)
    out = {name: canonical(doc[name]) for name in SPEC_FIELDS if name in doc}
    out.update((f"sampling.{name}", canonical(value)) for name, value in sorted(not_default(spec.sampling).items()))
    return out


def decode(value: Any) -> Fingerprint | None:
    """A fingerprint as a manifest or an older spec holds it (None: none, or unreadable)."""
    if not isinstance(value, dict) or not value:
        return None
    try:
        return msgspec.convert(value, Fingerprint)
    except msgspec.ValidationError:
        return None


def _input_kind(fp: dict[str, Any]) -> str:
    if fp.get("kind") == "dataset":
        return f"a dataset of {fp.get('files')} files"
    return f"a {fp.get('kind')} file"


def _input_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    if not old or not new or old.get("scheme") != new.get("scheme"):
        return None  # unknown (or computed another way): not a difference
    if (old.get("kind"), old.get("size"), old.get("digest")) == (new.get("kind"), new.get("size"), new.get("digest")):
        return None
    if (old.get("kind"), old.get("files")) != (new.get("kind"), new.get("files")):
        what = f"{_input_kind(new)}, not {_input_kind(old)}"
    elif old.get("size") != new.get("size"):
        what = f"{new.get('size')} bytes, not {old.get('size')}"
    else:
        what = "the same size, other content"
    return f"input: another input ({what})"


def _spec_difference(old: dict[str, str], new: dict[str, str]) -> str | None:
    changed = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, "default"), new.get(name, "default")
        if a == b:
            continue
        shown = f" {a} -> {b}" if not (a.startswith("sha256:") or b.startswith("sha256:")) else " (another value)"
        changed.append(name + shown)
    return "spec: " + ", ".join(changed) if changed else None


def difference(old: Fingerprint | None, new: Fingerprint | None) -> str | None:
    """What makes `new` another job than `old`, as "input: ..." and/or "spec: <field>
    <old> -> <new>, ..." (None: the same job, or either fingerprint unknown)."""
    if old is None or new is None:
        return None
    found = [p for p in (_input_difference(old.input, new.input), _spec_difference(old.spec, new.spec)) if p]
    return "; ".join(found) if found else None
