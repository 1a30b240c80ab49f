"""`prefixflow bench router`: what one routing decision costs at fleet scale.

The router decides for the whole fleet on one core, so its cost per decision bounds the
fleet's bucket rate. This builds the router's `Fleet` in memory (no NATS, no engine):
N live, ready replicas fed through `Fleet.observe` as their status messages would be,
each reporting a KV cache of `--history-blocks` hash blocks in 16-token engine blocks,
and fills every replica's history to that budget with routed keys. A key is 2-4 hash
blocks: one of the pool's `--keys` shared 2-block prefixes, then 0-2 blocks of its own.
Each replica's keys come from a few neighbouring prefixes of the pool (where prefix
affinity leaves them), so decisions find matches on about two replicas each.

It then times `--decisions` decisions of the default `prefix-aware` policy: three in four
a single bucket (`route`), one in four a pooled batch of 2-4 parts (`route_parts`: each
part is ranked on its own). After each decision the chosen replicas report the new work
done (untimed), so loads, caps and hungry replicas stay as they started: replicas hold
between 0 and 2 engine windows of work, about half of them less than one (hungry). The
result is the median over `--rounds` rounds of the mean time per decision.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import Any

from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import make_policy
from prefixflow.shared.prefix.block_keys import HASH_BLOCK_SIZE

ENGINE_BLOCK_SIZE = 16
"""The engines' KV block (a GPU's): the router converts it to hash blocks."""
WINDOW = 256
PROMPT_TOKENS = 640
"""Work tokens per prompt (e.g. 512 prompt + 128 output)."""
PREFIX_BLOCKS = 2
NOW = 1.0


def random_blocks(rng: random.Random, n: int) -> list[int]:
    """Stand-ins for `block_hashes` values: random 63-bit ints never repeat, so every
    list of them is a hash chain."""
    return [rng.getrandbits(63) for _ in range(n)]


def make_key(rng: random.Random, pool: list[list[int]], index: int) -> list[int]:
    return pool[index] + random_blocks(rng, rng.randint(0, 2))


def build_fleet(replicas: int, history_blocks: int, keys: int, rng: random.Random) -> tuple[Fleet, list[list[int]]]:
    """A fleet of `replicas` live replicas whose histories hold `history_blocks` hash
    blocks each, and the pool of shared prefixes their keys start with."""
    fleet = Fleet(hash_block_size=HASH_BLOCK_SIZE)
    kv_blocks = history_blocks * HASH_BLOCK_SIZE // ENGINE_BLOCK_SIZE
    pool = [random_blocks(rng, PREFIX_BLOCKS) for _ in range(keys)]
    span = max(2, 2 * keys // replicas)  # prefixes per replica: each prefix on ~2 replicas
    for i in range(replicas):
        name = f"r{i:04d}"
        fleet.observe(
            name,
            NOW,
            ready=True,
            outstanding=rng.randrange(2 * WINDOW * PROMPT_TOKENS),
            done_tokens=0,
            kv_blocks=kv_blocks,
            engine_block_size=ENGINE_BLOCK_SIZE,
            window=WINDOW,
        )
        r = fleet.replicas[name]
        home = i * keys // replicas
        filled = 0
        while filled < history_blocks:  # no prompts, no tokens: only the history grows
            key = make_key(rng, pool, (home + rng.randrange(span)) % keys)
            fleet.assign(r, 0, 0, key)
            filled += len(key)
    return fleet, pool


def make_work(rng: random.Random, pool: list[list[int]], decisions: int) -> list[tuple[int, int, list[int]] | list]:
    """Decisions to time: a bucket (prompts, tokens, key), or a pooled batch (a list of
    such parts) one time in four."""

    def bucket() -> tuple[int, int, list[int]]:
        prompts = rng.randint(1, 16)
        return prompts, prompts * PROMPT_TOKENS, make_key(rng, pool, rng.randrange(len(pool)))

    return [[bucket() for _ in range(rng.randint(2, 4))] if rng.random() < 0.25 else bucket() for _ in range(decisions)]


def bench_router(replicas: int, history_blocks: int, keys: int = 0, decisions: int = 1000, rounds: int = 5, seed: int = 0) -> dict[str, Any]:
    rng = random.Random(seed)
    keys = keys or 4 * replicas
    fleet, pool = build_fleet(replicas, history_blocks, keys, rng)
    kv_blocks = history_blocks * HASH_BLOCK_SIZE // ENGINE_BLOCK_SIZE
    base = {name: r.outstanding for name, r in fleet.replicas.items()}
    policy = make_policy("prefix-aware")
    per_round: list[float] = []
    refused = 0
    for _ in range(rounds):
        work = make_work(rng, pool, decisions)
        elapsed = 0.0
        for item in work:
            start = time.perf_counter()
            if isinstance(item, list):
                out = policy.route_parts(fleet, NOW, item)
            else:
                out = policy.route(fleet, NOW, *item)
            elapsed += time.perf_counter() - start
            if out is None:
                refused += 1
                continue
            for r, _ in out:  # the replica reports the new work done (untimed)
                fleet.observe(
                    r.name,
                    NOW,
                    ready=True,
                    outstanding=0,
                    done_tokens=r.done_tokens + max(0, r.outstanding - base[r.name]),
                    kv_blocks=kv_blocks,
                    engine_block_size=ENGINE_BLOCK_SIZE,
                    window=WINDOW,
                )
        per_round.append(elapsed / decisions * 1e6)
    return {
        "replicas": replicas,
        "history_blocks": history_blocks,
        "keys": keys,
        "decisions": decisions,
        "rounds": rounds,
        "us_per_decision": round(statistics.median(per_round), 1),
        "us_per_decision_rounds": [round(x, 1) for x in per_round],
        "refused": refused,
    }


def cmd_router(args) -> None:
    result = bench_router(args.replicas, args.history_blocks, args.keys, args.decisions, args.rounds, args.seed)
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{result['replicas']} replicas, {result['history_blocks']} hash blocks of history each, "
        f"{result['keys']} shared prefixes: {result['us_per_decision']} us per decision "
        f"(median of {result['rounds']} rounds of {result['decisions']}: {result['us_per_decision_rounds']})"
    )


def add_router_parser(sub) -> None:
    p = sub.add_parser("router", help="the router's cost per routing decision at fleet scale (in memory, no NATS)")
    p.add_argument("--replicas", type=int, default=1024)
    p.add_argument("--history-blocks", type=int, default=64, help="hash blocks of history per replica (its KV budget)")
    p.add_argument("--keys", type=int, default=0, help="shared prefixes in the key pool (default 4 per replica)")
    p.add_argument("--decisions", type=int, default=1000, help="timed decisions per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds; the median round is reported")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(fn=cmd_router)
