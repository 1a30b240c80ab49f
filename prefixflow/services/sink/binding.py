"""A job owns its output directory: the manifest `_job.json` binds a directory to one job.

Before the sink writes anything for a job it binds the job's `out_dir` (`bind`):

| what the directory holds              | overwrite off          | overwrite on                |
|---------------------------------------|------------------------|-----------------------------|
| nothing of ours (or does not exist)   | BIND: write manifest   | BIND                        |
| parts, no manifest (older sinks)      | ADOPT: write manifest  | REPLACE: delete, bind       |
| manifest naming this job              | OWNED: nothing to do   | OWNED (a resume)            |
| ... with another fingerprint          | REFUSE: the job fails  | REPLACE: delete, bind       |
| manifest naming another job           | REFUSE: the job fails  | REPLACE: delete, bind       |
| manifest that cannot be read          | REFUSE                 | REPLACE                     |

A manifest's fingerprint (what its job was asked to do: input and spec,
`prefixflow/shared/wire/fingerprint.py`) against the job's spec's: another one is another
job under the same id (the client refuses it first when the cluster still holds the old
spec). A manifest without one (written before fingerprints) is taken as the same job; an
OWNED one gets the job's fingerprint written into it.

`decide` is the pure rule (tests/unit/test_sink_binding.py); `inspect` reads a directory's
state and `apply` carries a decision out. No NATS here.

Crash safety: the manifest is written to a temporary name, fsynced and renamed (and the
directory fsynced), so it is either the old one or the new one. A REPLACE deletes the
old job's files first and its manifest last: a crash half-way leaves the old manifest, so
the restarted sink replaces again (it never adopts half of another job's parts).
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import structlog

from prefixflow.services.sink.growth import RECORD
from prefixflow.services.sink.store import OutputStore, open_store
from prefixflow.services.sink.writer import JobOutput
from prefixflow.shared.outputs import FILES_MANIFEST
from prefixflow.shared.wire.fingerprint import Fingerprint, decode, difference
from prefixflow.shared.wire.messages import JobSpec

log = structlog.get_logger()

MANIFEST = "_job.json"
"""The file that names the job owning a directory: {"job": id, "created_at": unix time,
"fingerprint": {"input": {...}, "spec": {...}}} (no fingerprint: written before them)."""
OUTPUT_GLOBS = ("*.parquet", ".part-*", "part-*.tmp", "*.parquet.tmp", "_summary.json", "_summary.json.tmp",
                "_job.json.tmp", RECORD, f".{RECORD}.tmp", FILES_MANIFEST)
"""Files of a job's output: parts (and whatever other Parquet the writer makes), their
temporary and hidden names (a merge's `.part-*.ready` would otherwise come back as a part
on the next open), the summary, the schema record. `_report/` (plots) goes too; the manifest goes last."""
OUTPUT_DIRS = ("_report",)


class Action(enum.Enum):
    BIND = "bind"
    """Nothing of a job's output here: write the manifest."""
    ADOPT = "adopt"
    """Parts written before manifests existed: they become this job's (resumed as usual)."""
    OWNED = "owned"
    """Already this job's (a resumed job or a reopened one): nothing to do."""
    REPLACE = "replace"
    """Another job's output and the spec says overwrite: delete it, then bind."""
    REFUSE = "refuse"
    """Another job's output and no overwrite: the job fails, nothing is written."""


@dataclass(frozen=True)
class DirState:
    """What a directory holds, as far as binding cares."""

    owner: str | None = None
    """The job its manifest names (None: no manifest, or one that cannot be read)."""
    unreadable: str | None = None
    """Why the manifest that is there cannot be read (None: absent or fine)."""
    has_output: bool = False
    """Any Parquet part, summary or report is there."""
    fingerprint: Fingerprint | None = None
    """What the manifest's job was asked to do (None: not recorded)."""


@dataclass(frozen=True)
class Decision:
    action: Action
    previous: str | None = None
    """The job whose output is replaced or refused over (None: unknown or none)."""
    error: str | None = None
    """REFUSE: the reason, as the job's status shows it."""


def refusal(out_dir: str, state: DirState) -> str:
    """The failed status text of a job refused over another job's directory."""
    if state.owner is not None:
        held = f"is bound to job {state.owner} (its {MANIFEST})"
    else:
        held = f"holds another job's output ({MANIFEST} unreadable: {state.unreadable})"
    return f"out_dir {out_dir} {held}; submit with --overwrite to replace that output, or choose another --out"


def decide(job: str, state: DirState, overwrite: bool, out_dir: str = "",
           fingerprint: Fingerprint | None = None) -> Decision:
    """What binding `job` to a directory in `state` does (`overwrite` and `fingerprint`:
    the job's spec's)."""
    if state.owner == job:
        if (diff := difference(state.fingerprint, fingerprint)) is None:
            return Decision(Action.OWNED)
        if overwrite:
            return Decision(Action.REPLACE)
        return Decision(Action.REFUSE, previous=job, error=(
            f"out_dir {out_dir} holds job {job}'s output for another input or spec ({diff}); submit with "
            "--overwrite to replace that output, or choose another --out"))
    claimed = state.owner is not None or state.unreadable is not None
    if not claimed:
        if not state.has_output:
            return Decision(Action.BIND)
        # NOTE: parts without a manifest are from a sink that predates manifests. Without
        # overwrite they are taken as this job's (a resume of an old job keeps its rows);
        # with overwrite the user asked for a fresh output, so they go.
        return Decision(Action.REPLACE) if overwrite else Decision(Action.ADOPT)
    if overwrite:
        return Decision(Action.REPLACE, previous=state.owner)
    return Decision(Action.REFUSE, previous=state.owner, error=refusal(out_dir, state))


def parse_manifest(raw: bytes | None) -> tuple[str | None, str | None, Fingerprint | None]:
    """(owner, why unreadable, fingerprint) of a manifest's bytes; (None, None, None) if
    there is none."""
    if raw is None:
        return None, None, None
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        return None, f"not JSON: {exc}", None
    job = doc.get("job") if isinstance(doc, dict) else None
    if not isinstance(job, str) or not job:
        return None, "no job named", None
    return job, None, decode(doc.get("fingerprint"))


def read_manifest(path: Path) -> tuple[str | None, str | None, Fingerprint | None]:
    """`parse_manifest` of the manifest file at `path`."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raw = None
    return parse_manifest(raw)


def inspect(out_dir: Path | OutputStore) -> DirState:
    """The binding state of an output (a directory that does not exist holds nothing)."""
    store = open_store(out_dir)
    if not store.exists():
        return DirState()
    owner, unreadable, fingerprint = parse_manifest(store.read_bytes(MANIFEST))
    return DirState(owner, unreadable, store.has_output(("_summary.json", *OUTPUT_DIRS)), fingerprint)


def write_manifest(out_dir: Path | OutputStore, job: str, fingerprint: Fingerprint | None = None) -> None:
    """Bind an output to `job` (asked `fingerprint`): the manifest, atomically (locally:
    tmp, fsync, rename, fsync dir; in an object store: one PUT)."""
    doc: dict = {"job": job, "created_at": round(time.time(), 3)}
    if fingerprint is not None:
        doc["fingerprint"] = msgspec.to_builtins(fingerprint)
    open_store(out_dir).put_bytes(MANIFEST, (json.dumps(doc) + "\n").encode())


def clear_output(out_dir: Path | OutputStore) -> list[str]:
    """Delete a job's output (parts, other Parquet files, summary, report), the manifest
    last; other files stay. Returns the names removed."""
    return open_store(out_dir).clear(OUTPUT_GLOBS, OUTPUT_DIRS, MANIFEST)


def bind(job: str, out_dir: Path | OutputStore, overwrite: bool, shown: str = "", fingerprint: Fingerprint | None = None) -> Decision:
    """Bind `out_dir` to `job`, asked `fingerprint` (blocking file I/O: run it in a
    thread). `shown`: the out_dir as the job's spec spells it (for the refusal text). A
    REFUSE writes nothing."""
    out_dir = open_store(out_dir)
    state = inspect(out_dir)
    decision = decide(job, state, overwrite, shown or out_dir.where, fingerprint)
    match decision.action:
        case Action.REFUSE:
            return decision
        case Action.OWNED:
            if state.fingerprint is None and fingerprint is not None:  # a manifest from before fingerprints
                write_manifest(out_dir, job, fingerprint)
                log.info("manifest given the job's fingerprint", job=job, out_dir=out_dir.where)
            return decision
        case Action.REPLACE:
            removed = clear_output(out_dir)
            log.warning("output replaced (overwrite)", job=job, out_dir=out_dir.where, previous_job=decision.previous,
                        removed=len(removed))
        case Action.ADOPT:
            log.info("output adopted (written before manifests)", job=job, out_dir=out_dir.where)
        case Action.BIND:
            pass
    write_manifest(out_dir, job, fingerprint)
    return decision


def open_bound(job: str, out_dir: Path | OutputStore, spec: JobSpec) -> tuple[Decision, JobOutput | None]:
    """Bind `out_dir` to `job`, then open its output (the ids and counts of the parts on
    disk); (decision, None) if the job is refused. Blocking: run it in a thread."""
    decision = bind(job, out_dir, spec.overwrite, spec.out_dir, spec.fingerprint)
    if decision.action is Action.REFUSE:
        return decision, None
    return decision, JobOutput(job, out_dir)
