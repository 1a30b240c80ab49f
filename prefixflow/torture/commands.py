"""`prefixflow torture`'s arguments (what it does: `prefixflow/torture/runner.py`)."""

from __future__ import annotations

import argparse

from prefixflow.torture.entries import ENTRIES

DESCRIPTION = """Seeded torture rounds on real processes (docs/torture.md). Each round draws, from
the seed and its number alone, an entry point (run: `prefixflow run --engine echo`;
submit: `prefixflow submit` to a local echo cluster the harness keeps and supervises;
raw: publishing on pfx.ingest.<job>; batch: the OpenAI Batch API, `prefixflow serve api`
beside that cluster, driven with the openai client), a dataset (random Arrow schemas
and values, ids of mixed types, empty and huge values, malformed messages, bad
sampling/chat/structured rows, bad and duplicate batch lines, another input into the
same --out) and faults (SIGKILL or SIGSTOP of any process, nats-server and the engine
included; a restart of the batch API; a full disk on a small tmpfs when run as root).
Then it checks: each id exactly once (a generated row or an error row; a batch's
custom_ids once in its output or error file), every input column byte-exact, the exit
code (a batch's status and request_counts) and the job's status agree, every process
alive, a clean job after. A failure prints its seed and the command that replays it; the report
is WORKDIR/torture.json. Exit code 1 if a round failed (other than a known failure)."""


def entry_list(text: str) -> str:
    names = [e for e in text.split(",") if e]
    bad = [e for e in names if e not in ENTRIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"entries are {','.join(ENTRIES)}; got {text!r}")
    return text


def add_parser(sub, *, minutes: float | None = None) -> None:
    """`prefixflow torture` (and, with `minutes`, `prefixflow bench torture`: the long run)."""
    p = sub.add_parser("torture", help="seeded torture rounds on real processes, checked against the contract"
                       + (f" (the long run: {minutes:g} minutes by default)" if minutes else ""),
                       description=DESCRIPTION)
    p.add_argument("--seed", type=int, default=0, help="the seed every round draws from (default 0)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds to play (default: 10, or as many as --minutes allows)")
    p.add_argument("--minutes", type=float, default=minutes,
                   help=f"play rounds until this many minutes have passed (default {minutes or 'none'})")
    p.add_argument("--round", type=int, default=0, metavar="R",
                   help="the first round's number (a replay: --seed S --round R --rounds 1) (default 0)")
    p.add_argument("--entries", type=entry_list, default=",".join(ENTRIES),
                   help=f"entry points to draw from, comma-separated (default {','.join(ENTRIES)})")
    p.add_argument("--max-rows", type=int, default=200, help="rows of a dataset, at most (default 200)")
    p.add_argument("--workdir", default=None,
                   help="inputs, outputs, logs of every round and torture.json (default: a new temporary directory)")
    p.add_argument("--model", default="", help="model whose tokenizer the echo engines use (default: the local one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON at the end")

    def run(args: argparse.Namespace) -> None:
        from prefixflow.torture.runner import main

        main(args)

    p.set_defaults(fn=run)
