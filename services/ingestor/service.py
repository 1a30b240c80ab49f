"""Ingestor: validates and tokenizes user prompts, shards them to the node bucketers.

Loop: fetch a batch from `pfx.ingest.*` -> parse and validate each message -> tokenize
the good ones in one call -> publish prompt batches to `pfx.bucket.<node>` (node picked by
the prompt's first KV block) and error rows to `pfx.results.<job>` -> wait for every
publish ack -> ack the inputs. A message with no recoverable id goes to the dead-letter
stream. Several ingestors can share the work (one durable pull consumer).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import structlog
from nats.aio.msg import Msg

from shared.wire import messages as m
from shared.wire import subjects
from shared.prefix import tokens as tk
from shared.process.config import IngestorConfig
from shared.bus.jobs import JobCache
from shared.bus.pull import DurablePull
from shared.bus.connection import close, connect
from shared.bus.provision import provision
from shared.prefix.block_keys import first_block_key
from shared.bus.poison import deliveries, is_poison, quarantine
from shared.bus.publish import PublishError, ack_all, publish
from shared.prefix.sharding import Sharder
from shared.prefix.tokenize import load_tokenizer, model_max_len
from services.ingestor.validate import Record, Rejected, length_error, parse_many

log = structlog.get_logger()

MAX_PROMPTS_PER_MESSAGE = 512


class Ingestor:
    def __init__(self, cfg: IngestorConfig) -> None:
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg.model)
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.max_model_len = min(cfg.max_model_len, model_max_len(cfg.model, cfg.max_model_len))
        self.bucketers: dict[str, float] = {}  # node -> last heartbeat (monotonic)
        self.sharder = Sharder(epsilon=cfg.shard_epsilon)

    def live_nodes(self) -> list[str]:
        now = time.monotonic()
        nodes = sorted(n for n, seen in self.bucketers.items() if now - seen < 3.0)
        return nodes or [self.cfg.default_node]

    async def run(self, stop: asyncio.Event) -> None:
        nc = await connect(self.cfg.nats_url, "ingestor")
        js = nc.jetstream()
        await provision(js)
        self.js = js
        self.jobs = JobCache(await js.key_value(subjects.JOBS_KV))
        sub = DurablePull(js, subjects.ingestor_consumer())

        async def on_heartbeat(msg: Msg) -> None:
            try:
                hb = m.heartbeat_decoder.decode(msg.data)
            except Exception:  # noqa: BLE001 - a foreign message on our subject
                return
            self.bucketers[hb.node] = time.monotonic()

        await nc.subscribe(subjects.ALL_BUCKETER_HEARTBEATS, cb=on_heartbeat)
        log.info("ingestor ready", max_model_len=self.max_model_len)
        while not stop.is_set():
            msgs = await sub.fetch(self.cfg.fetch_batch, timeout=1.0)
            if not msgs:
                continue
            # Redelivered messages go one at a time: a poison message must not keep
            # failing the good messages fetched with it.
            fresh = [msg for msg in msgs if deliveries(msg) == 1]
            for group in ([fresh] if fresh else []) + [[msg] for msg in msgs if deliveries(msg) > 1]:
                await self.handle_safely(group)
        await close(nc, sub)

    async def handle_safely(self, msgs: list[Msg]) -> None:
        if len(msgs) == 1 and is_poison(msgs[0]):
            msg = msgs[0]
            rows = []
            try:
                job = subjects.job_from_subject(msg.subject)
                why = f"poison message: failed {deliveries(msg)} deliveries"
                rows = [(job, m.Result(r.id, getattr(r, "columns", b""), error=why, finish_reason=m.FinishReason.ERROR))
                        for r in parse_many(msg.data, msg.headers) if r.id is not None]
            except Exception:  # noqa: BLE001 - unparseable: dead letter only
                pass
            await quarantine(self.js, msg, "ingest failed repeatedly", rows)
            return
        try:
            await self.handle(msgs)
        except Exception:  # noqa: BLE001 - never die on one batch: it is redelivered
            log.exception("ingest batch failed; naked for redelivery")
            await asyncio.gather(*(msg.nak(delay=1.0) for msg in msgs), return_exceptions=True)

    async def handle(self, msgs: list[Msg]) -> None:
        t0 = time.perf_counter()
        # 1. Parse and validate; collect what to tokenize.
        good: list[tuple[str, Record, m.SamplingSpec]] = []
        errors: dict[str, list[m.Result]] = defaultdict(list)
        dead: list[tuple[Msg, str]] = []
        for msg in msgs:
            job = subjects.job_from_subject(msg.subject)
            try:
                records = parse_many(msg.data, msg.headers)
            except Exception as exc:  # noqa: BLE001 - one bad message must never stop the service
                dead.append((msg, f"unparseable message: {exc!r}"))
                continue
            lookup = await self.jobs.get(job)
            if lookup.spec is None:
                dead.append((msg, lookup.error or "unknown job"))
                continue
            for parsed in records:
                if isinstance(parsed, Rejected):
                    if parsed.id is None:
                        dead.append((msg, parsed.error))
                    else:
                        errors[job].append(m.Result(parsed.id, error=parsed.error, finish_reason=m.FinishReason.ERROR))
                    continue
                good.append((job, parsed, lookup.spec.sampling))
        # 2. Tokenize in one call (the Rust tokenizer runs the batch in parallel; the
        #    "fast" variant skips offsets we do not use). Pre-tokenized rows skip it.
        texts = [rec.prompt for _, rec, _ in good if rec.tokens is None]
        encoded = iter(self.tokenizer.encode_batch_fast(texts) if texts else [])
        packed = [rec.tokens if rec.tokens is not None else tk.pack(next(encoded).ids) for _, rec, _ in good]
        by_node: dict[str, list[m.Prompt]] = defaultdict(list)
        nodes = self.live_nodes()
        vocab = self.vocab_size
        for (job, rec, sampling), tokens in zip(good, packed):
            n = tk.count(tokens)
            err = length_error(n, sampling.max_tokens, self.max_model_len)
            if err is None and rec.tokens is not None and (top := tk.max_id(tokens)) >= vocab:
                err = f"token id {top} outside the model's vocabulary ({vocab})"
            if err is not None:
                errors[job].append(
                    m.Result(rec.id, rec.columns, error=err, prompt_tokens=n, finish_reason=m.FinishReason.ERROR)
                )
                continue
            node = self.sharder.pick(first_block_key(tokens, self.cfg.hash_block_size), nodes)
            by_node[node].append(m.Prompt(job, rec.id, tokens, rec.columns, sampling.max_tokens))
        # 3. Publish everything, wait for the acks, then ack the inputs.
        pubs = []
        for node, prompts in by_node.items():
            for run in m.chunked(prompts, m.prompt_size, MAX_PROMPTS_PER_MESSAGE):
                pubs.append(publish(self.js, subjects.bucket(node), m.encode(m.PromptBatch(run))))
        for job, rows in errors.items():
            for run in m.chunked(rows, m.result_size, MAX_PROMPTS_PER_MESSAGE):
                pubs.append(publish(self.js, subjects.results(job), m.encode(m.ResultBatch(job, run))))
        for msg, why in dict((id(msg), (msg, why)) for msg, why in dead).values():
            pubs.append(self.dead_letter(msg, why))
        try:
            await asyncio.gather(*pubs)
        except PublishError as exc:
            log.error("publish failed; inputs will be redelivered", error=str(exc))
            await asyncio.gather(*(msg.nak(delay=2.0) for msg in msgs), return_exceptions=True)
            return
        await ack_all(msgs)
        n_err = sum(len(v) for v in errors.values())
        log.debug(
            "ingested",
            messages=len(msgs),
            prompts=sum(len(v) for v in by_node.values()),
            errors=n_err,
            dead=len(dead),
            nodes=len(by_node),
            ms=round((time.perf_counter() - t0) * 1000, 1),
        )

    async def dead_letter(self, msg: Msg, why: str) -> None:
        log.warning("dead-lettered ingest message", subject=msg.subject, error=why)
        headers = {"Pfx-Error": why[:512], "Pfx-Subject": msg.subject}
        await publish(self.js, subjects.dead(msg.subject), msg.data, headers=headers)
