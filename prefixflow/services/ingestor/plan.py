"""What to do with a batch of ingest messages: pure logic, no I/O (tested on its own).

`plan_batch` parses and validates every message, tokenizes the good prompts in one call,
checks their length against the model and picks each prompt's bucketer node. The
service then publishes the plan and acks the inputs (`prefixflow/services/ingestor/service.py`).
Running the whole plan in a worker thread keeps the event loop free for heartbeats and
acks (the Rust tokenizer releases the GIL).
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixflow.services.ingestor.row import prepare_row
from prefixflow.services.ingestor.validate import Record, Rejected, length_error, parse_many
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import first_block_key
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire import subjects


@dataclass(frozen=True, slots=True)
class Incoming:
    """One ingest message as the plan needs it."""

    subject: str
    data: bytes
    headers: dict[str, str] | None = None
    seq: int = 0
    """Its stream sequence number (names the blob of a batch's kept fields)."""

    @property
    def job(self) -> str:
        return subjects.job_from_subject(self.subject)


@dataclass(frozen=True, slots=True)
class Model:
    """What the plan needs of the model."""

    encode_batch: Callable[[list[str]], Sequence[Sequence[int]]]
    vocab_size: int
    max_model_len: int
    hash_block_size: int
    render_chat: Callable[[object, str, dict], str] | None = None
    """Render a chat row's `messages` (conversation, job's template override, template
    kwargs) to prompt text (`prefixflow/services/ingestor/chat.py`); raises ValueError for bad input."""
    encode_chat_batch: Callable[[list[str]], Sequence[Sequence[int]]] | None = None
    """Tokenize rendered chat prompts without adding special tokens (vLLM's chat path);
    None: `encode_batch`."""
    names: frozenset[str] = frozenset()
    """Names of the base model (a row's `lora` naming it means no adapter)."""


@dataclass
class Plan:
    prompts: dict[str, list[m.Prompt]] = field(default_factory=lambda: defaultdict(list))
    """Node -> prompts for its bucketer."""
    errors: dict[str, list[m.Result]] = field(default_factory=lambda: defaultdict(list))
    """Job -> error rows."""
    dead: dict[int, str] = field(default_factory=dict)
    """Index of a message that cannot be processed at all -> why (dead-letter stream)."""
    failed_jobs: dict[str, str] = field(default_factory=dict)
    """Jobs that exist but cannot run -> why (their status says failed)."""
    kept: dict[str, list[bytes]] = field(default_factory=lambda: defaultdict(list))
    """Job -> the other fields (msgpack maps) of its rows published without a reference to
    kept input columns, in row order: the service stores them as the job's blob
    `in-<src>` (`src`: this batch's number) before it publishes anything that refers to them."""
    src: int = -1
    """This batch's blob number for `kept`."""

    @property
    def n_prompts(self) -> int:
        return sum(len(v) for v in self.prompts.values())

    @property
    def n_errors(self) -> int:
        return sum(len(v) for v in self.errors.values())


SRC_DIGEST_BITS = 32
"""Bits of a batch's blob number that come from the digest of its messages' sequences
(the other 24 from its first message's: `batch_src`)."""


def batch_src(seqs: Sequence[int]) -> int:
    """The number of a batch's blob of kept fields (`input_blob`), from the stream
    sequences of its messages: the first one's (low 24 bits) and a digest of all of them.

    NOTE: a row refers to its fields by (blob, position in the blob). After a crash the
    unacked messages come again, grouped by the next fetch as it happens: a batch may
    start with the same message and hold others. Named by its first message alone, such
    a batch overwrote the blob the earlier attempt's rows (already published) point into,
    and those rows came out with another row's fields (torture seed 7 round 53: a prompt
    swapped). Named by its composition, each grouping has its own blob, and the same
    grouping (a redelivery of the very same messages) the same one, with the same rows."""
    if not seqs:
        return m.INGEST_SRC_BASE
    digest = hashlib.blake2b(b"".join(s.to_bytes(8, "little") for s in seqs), digest_size=SRC_DIGEST_BITS // 8)
    return m.INGEST_SRC_BASE + ((seqs[0] & 0xFFFFFF) << SRC_DIGEST_BITS | int.from_bytes(digest.digest(), "little"))


def plan_batch(
    incoming: Sequence[Incoming],
    jobs: dict[str, m.JobLookup],
    model: Model,
    pick_node: Callable[[int], str],
) -> Plan:
    """Plan a batch. `jobs` holds the lookup of every job in it with a valid id (a lookup
    with no spec means: dead-letter its messages, and fail the job if it exists); a
    message whose subject names no valid job id (`subjects.job_id_error`: a raw publish on
    `pfx.ingest.bad:job`) is dead-lettered with the reason, and no job is failed, looked
    up or written for it. `pick_node(key)` chooses a bucketer node for a prompt's
    first-block key."""
    plan = Plan(src=batch_src([msg.seq for msg in incoming]))

    def ref(job: str, rec) -> dict[str, int]:
        """Where a row's input columns are: its own reference, or (its other fields kept
        by this batch) the batch's blob."""
        if rec.src >= 0 or not rec.columns:
            return {"src": rec.src, "row": rec.row}
        plan.kept[job].append(rec.columns)
        return {"src": plan.src, "row": len(plan.kept[job]) - 1}

    # 1. Parse and validate; collect what to tokenize.
    good: list[tuple[str, Record, m.SamplingSpec, bytes, str]] = []
    for i, msg in enumerate(incoming):
        job = msg.job
        if (why := subjects.job_id_error(job)) is not None:
            plan.dead[i] = why
            continue
        lookup = jobs[job]
        if lookup.spec is None:
            plan.dead[i] = lookup.error or "unknown job"
            if lookup.exists:
                plan.failed_jobs[job] = lookup.error or "job cannot run"
            continue
        try:
            records = parse_many(msg.data, msg.headers)
        except Exception as exc:  # noqa: BLE001 - one bad message must never stop the service
            plan.dead[i] = f"unparseable message: {exc!r}"
            continue
        for parsed in records:
            if isinstance(parsed, Rejected):
                if parsed.id is None:
                    plan.dead[i] = parsed.error
                else:
                    plan.errors[job].append(m.error_result(parsed.id, parsed.error, **ref(job, parsed)))
                continue
            try:  # chat rendering and the row's own sampling (`row.py`)
                parsed, sampling, row_spec, lora = prepare_row(parsed, lookup.spec, model.render_chat, model.names)
            except ValueError as exc:
                plan.errors[job].append(m.error_result(parsed.id, str(exc), **ref(job, parsed)))
                continue
            good.append((job, parsed, sampling, row_spec, lora))
    # 2. Tokenize in one call (chat prompts in another: no special tokens added).
    # Pre-tokenized rows skip it.
    texts = [g[1].prompt for g in good if g[1].tokens is None and g[1].messages is None]
    chats = [g[1].prompt for g in good if g[1].tokens is None and g[1].messages is not None]
    encoded = iter(model.encode_batch(texts) if texts else [])
    encoded_chat = iter((model.encode_chat_batch or model.encode_batch)(chats) if chats else [])
    # 3. Check lengths and vocabulary; shard by the first block.
    for job, rec, sampling, row_spec, lora in good:
        if rec.tokens is not None:
            tokens = rec.tokens
        else:
            tokens = tk.pack(next(encoded_chat if rec.messages is not None else encoded))
        n = tk.count(tokens)
        budget = 0 if jobs[job].spec.task == "embed" else sampling.max_tokens  # embeddings generate nothing
        err = length_error(n, budget, model.max_model_len)
        if err is not None and rec.messages is not None:
            err = f"conversation (rendered with the chat template): {err}"
        if err is None and rec.tokens is not None and (top := tk.max_id(tokens)) >= model.vocab_size:
            err = f"token id {top} outside the model's vocabulary ({model.vocab_size})"
        if err is not None:
            plan.errors[job].append(m.error_result(rec.id, err, prompt_tokens=n, **ref(job, rec)))
            continue
        node = pick_node(first_block_key(tokens, model.hash_block_size))
        # Its work counts every completion it asks for (`n`): load, routing and KV admission go by it.
        plan.prompts[node].append(m.Prompt(job, rec.id, tokens, b"", budget * sampling.n, row_spec, **ref(job, rec),
                                           lora=lora))
    return plan


def poison_rows(msg: Incoming, why: str) -> list[tuple[str, m.Result]]:
    """Error rows for every recoverable id of an ingest message that keeps failing (none
    for a message of an invalid job id: there is no job to write them for)."""
    if subjects.job_id_error(msg.job) is not None:
        return []
    try:
        records = parse_many(msg.data, msg.headers)
    except Exception:  # noqa: BLE001 - unparseable: dead letter only
        return []
    return [(msg.job, m.error_result(r.id, why, src=getattr(r, "src", -1), row=getattr(r, "row", -1)))
            for r in records if r.id is not None]
