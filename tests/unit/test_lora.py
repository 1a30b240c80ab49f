"""LoRA adapters per row (issue #27), the pure parts: adapter-keyed prefix chains, the KV
event translation under an adapter, the ingestor's reading of a row's adapter, OpenAI
batch lines naming one by `model`, the engine's `--lora-modules` and defaults, and the
router keeping an adapter's work on the replicas that run it (a property over random
bucket sequences)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixflow.client.openai_batch import output_lines, parse_line, read_batch
from prefixflow.services.engine_worker.kv_events import BlockStored, KeyTranslator
from prefixflow.services.engine_worker.lora import (
    BASE_STANDIN,
    adapter_rank,
    lora_args,
    split_lora_modules,
    unknown_adapter,
)
from prefixflow.services.ingestor.plan import Incoming, Model, plan_batch
from prefixflow.services.ingestor.row import model_names, row_lora
from prefixflow.services.router.adapters import Adapters, adapter_candidates
from prefixflow.services.router.fleet import Fleet
from prefixflow.services.router.policies import PrefixAware
from prefixflow.shared.prefix import tokens as tk
from prefixflow.shared.prefix.block_keys import block_hashes, first_block_key
from prefixflow.shared.wire import messages as m

pytestmark = pytest.mark.unit


# --- prefix keys ---------------------------------------------------------------------


def test_an_adapter_has_its_own_chain_and_the_base_chain_is_unchanged():
    tokens = tk.pack(list(range(40)))
    base = block_hashes(tokens, 8)
    assert base == block_hashes(tokens, 8, lora="")
    alpha, beta = block_hashes(tokens, 8, lora="alpha"), block_hashes(tokens, 8, lora="beta")
    assert len(alpha) == len(base) == 5
    assert not set(alpha) & set(base) and not set(alpha) & set(beta)  # no block shared across adapters
    # A longer prompt under the same adapter extends its chain.
    assert block_hashes(tk.pack(list(range(48))), 8, lora="alpha")[:5] == alpha
    assert first_block_key(tk.pack([1, 2]), 8, "alpha") != first_block_key(tk.pack([1, 2]), 8)


def test_kv_events_of_an_adapter_translate_to_its_keys_and_the_base_standin_to_base_keys():
    prompt = list(range(64))
    for name, lora in (("alpha", "alpha"), (None, ""), (BASE_STANDIN, "")):
        translator = KeyTranslator(max_nodes=100, hash_block_size=16)
        events = translator.apply([BlockStored(block_hashes=[11, 12, 13, 14], parent_block_hash=None, token_ids=prompt,
                                               block_size=16, lora_name=name)])
        assert translator.held() == set(block_hashes(tk.pack(prompt), 16, lora=lora)), name
        assert [op for op, _ in events] == [m.CacheOp.STORED]


# --- the ingestor ----------------------------------------------------------------------


def test_row_lora_reads_names_and_refuses_what_cannot_be_one():
    base = model_names(".prefixflow/models/tiny-llama")
    assert base == {".prefixflow/models/tiny-llama", "tiny-llama"}
    assert row_lora({"lora": "alpha"}, base) == "alpha"
    for none in ({}, {"lora": None}, {"lora": ""}, {"lora": "tiny-llama"}, {"lora": ".prefixflow/models/tiny-llama"}):
        assert row_lora(none, base) == "", none
    for bad in (3, ["alpha"], " alpha", "a\nb", "x" * 300):
        with pytest.raises(ValueError):
            row_lora({"lora": bad}, base)


def encode(texts):
    return [[ord(c) % 50 + 1 for c in t] for t in texts]


def test_plan_carries_each_rows_adapter_and_errors_a_bad_one():
    spec = m.JobSpec("j", "/out", model="models/tiny", sampling=m.SamplingSpec(max_tokens=8))
    rows = [{"id": 1, "prompt": "hello there", "lora": "alpha"}, {"id": 2, "prompt": "hello there"},
            {"id": 3, "prompt": "hello there", "lora": "tiny"}, {"id": 4, "prompt": "hello there", "lora": 7},
            {"id": 5, "prompt": "hello there", "lora": "beta", m.SRC_FIELD: 0, m.ROW_FIELD: 3}]
    incoming = [Incoming("pfx.ingest.j", json.dumps(rows).encode())]
    model = Model(encode_batch=encode, vocab_size=100, max_model_len=64, hash_block_size=4, names=model_names("m/base"))
    plan = plan_batch(incoming, {"j": m.JobLookup(spec)}, model, lambda key: "n0")
    got = {p.id: p.lora for p in plan.prompts["n0"]}
    assert got == {1: "alpha", 2: "", 3: "", 5: "beta"}  # "tiny": the job's model by its last name
    [error] = plan.errors["j"]
    assert error.id == 4 and "'lora' must be a string" in error.error


# --- OpenAI batch lines ----------------------------------------------------------------


def line(cid: str, model: str, url: str = "/v1/chat/completions") -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]} if url != "/v1/embeddings" else \
        {"model": model, "input": "hi"}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_a_batch_lines_model_becomes_its_lora_column_and_names_its_result(tmp_path):
    _, _, model, row = parse_line(1, line("a", "alpha"), set())
    assert model == "alpha" and row["lora"] == "alpha"
    _, _, _, row = parse_line(1, line("e", "tiny", "/v1/embeddings"), set(), "embed")
    assert "lora" not in row  # embeddings: no adapter
    path = tmp_path / "b.jsonl"
    path.write_text(line("a", "alpha") + "\n" + line("b", "tiny-llama") + "\n")
    batch = read_batch(path)
    rows = [{"id": "a", "lora": "alpha", "output": "x", "finish_reason": "stop", "prompt_tokens": 1, "cached_tokens": 0,
             "output_tokens": 1, "error": None},
            {"id": "b", "lora": "tiny-llama", "output": "y", "finish_reason": "stop", "prompt_tokens": 1,
             "cached_tokens": 0, "output_tokens": 1, "error": None}]
    ok, errors = output_lines(batch, rows, "tiny-llama")
    assert not errors and [o["response"]["body"]["model"] for o in ok] == ["alpha", "tiny-llama"]


# --- the engine's adapters ---------------------------------------------------------------


def test_lora_modules_are_taken_out_of_the_engine_arguments_with_vllms_parser():
    rest, modules = split_lora_modules(["--max-loras", "2", "--lora-modules", "a=/x/a", '{"name": "b", "path": "/x/b"}',
                                        "--dtype", "float32"])
    assert rest == ["--max-loras", "2", "--dtype", "float32"] and modules == {"a": "/x/a", "b": "/x/b"}
    assert split_lora_modules(["--dtype", "float32"]) == (["--dtype", "float32"], {})
    with pytest.raises(ValueError, match="twice"):
        split_lora_modules(["--lora-modules", "a=/x", "a=/y"])


def adapter(tmp_path, name: str, r: int) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "lora_alpha": r, "target_modules": ["q_proj"]}))
    return str(d)


def test_engine_defaults_fit_the_adapters_and_explicit_arguments_win(tmp_path):
    modules = {"a": adapter(tmp_path, "a", 8), "b": adapter(tmp_path, "b", 12), "c": adapter(tmp_path, "c", 4)}
    args = lora_args(modules, {})
    assert args == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 3, "max_cpu_loras": 3}
    assert lora_args(modules, {"max_loras": 2})["max_loras"] == 2
    with_standin = lora_args(modules, {"max_loras": 2}, standin=True)
    assert with_standin["max_loras"] == 3 and with_standin["max_cpu_loras"] == 4
    assert lora_args({}, {}) == {}
    with pytest.raises(ValueError, match="cannot read"):
        adapter_rank(str(tmp_path / "missing"))
    assert "'zeta'" in unknown_adapter("zeta", ["a", "b"]) and "'a', 'b'" in unknown_adapter("zeta", ["a", "b"])


# --- routing -----------------------------------------------------------------------------


class R:
    def __init__(self, name: str, served=(), slots: int = 2, held=None) -> None:
        self.name = name
        self.adapters = Adapters(frozenset(served), slots, dict(held or {}))


def test_adapter_candidates_prefer_warm_then_free_slots_and_serving_replicas():
    def never(r) -> bool:
        return False

    a = R("a", "xyz", held={"x": 3, "y": 1})  # full: x and y
    b = R("b", "xyz", held={"z": 2})  # one slot free
    c = R("c", "xy", held={})  # serves no z
    assert adapter_candidates([a, b, c], "", never) == [a, b, c]
    assert adapter_candidates([a, b, c], "x", never) == [a]  # warm only
    assert adapter_candidates([a, b, c], "x", lambda r: r is c) == [a]  # no slot to spare in the fleet
    assert adapter_candidates([a, b, c], "x", lambda r: r is c, spare=1) == [a, c]  # plus a hungry one with a slot
    assert adapter_candidates([a, b, c], "z", never) == [b]
    assert adapter_candidates([a, c], "z", never) == [a]  # full, but the one that serves it
    assert adapter_candidates([c], "z", never) == [c]  # nobody serves it: the engines' error rows tell
    assert adapter_candidates([a, b], "w", never) == [b]  # unknown everywhere: a free slot still
    assert adapter_candidates([a], "y", never) == [a]


def ready_fleet(n: int, slots: int, adapters: list[str]) -> Fleet:
    fleet = Fleet(cap_tokens=1 << 40)
    for i in range(n):
        fleet.observe(f"r{i}", 0.0, ready=True, outstanding=0, done_tokens=0, kv_blocks=1000, window=64,
                      adapters=adapters, lora_slots=slots)
    return fleet


@given(buckets=st.lists(st.tuples(st.sampled_from(["", "a", "b", "c", "d"]), st.integers(0, 5), st.integers(1, 40)),
                        min_size=1, max_size=80))
def test_adapters_never_share_slots_beyond_the_fleets_while_there_is_room(buckets):
    """Two replicas of two slots, four adapters: however buckets of the adapters and the
    base model arrive, routing never puts a third adapter on a replica (never makes
    adapters take turns in a replica's slots) and keeps each adapter on one replica."""
    names = ["a", "b", "c", "d"]
    fleet = ready_fleet(2, 2, names)
    policy = PrefixAware()
    for lora, group, prompts in buckets:
        key = block_hashes(tk.pack([group] * 16), 4, lora=lora)
        chosen = policy.route(fleet, 0.0, prompts, prompts * 40, key, prompts * 8, lora)
        assert chosen
    held = {r.name: set(r.adapters.held) for r in fleet.replicas.values()}
    assert all(len(h) <= 2 for h in held.values()), held
    for name in names:
        assert sum(name in h for h in held.values()) <= 1, held


def test_an_adapter_spreads_once_its_replica_is_full_and_statuses_replace_what_was_routed():
    fleet = ready_fleet(2, 2, ["a"])
    policy = PrefixAware()
    first = policy.route(fleet, 0.0, 8, 320, block_hashes(tk.pack([1] * 16), 4, lora="a"), 64, "a")
    r0 = first[0][0]
    assert r0.adapters.held == {"a": 8}
    # r0 at its cap: the adapter's next bucket goes to the other replica, which has a slot.
    fleet.cap_tokens = r0.outstanding
    nxt = policy.route(fleet, 0.0, 8, 320, block_hashes(tk.pack([2] * 16), 4, lora="a"), 64, "a")
    assert nxt[0][0] is not r0 and nxt[0][0].adapters.held == {"a": 8}
    # A status says what the replica holds now.
    fleet.observe(r0.name, 1.0, ready=True, outstanding=0, done_tokens=r0.outstanding, kv_blocks=1000, window=64,
                  adapters=["a"], lora_slots=2, loras={})
    assert r0.adapters.held == {}


def test_status_and_parts_carry_adapters_on_the_wire():
    status = m.EngineStatus("r0", 1.0, adapters=["a", "b"], lora_slots=2, loras={"a": 3})
    back = msgspec.msgpack.decode(m.encode(status), type=m.EngineStatus)
    assert back.adapters == ["a", "b"] and back.lora_slots == 2 and back.loras == {"a": 3}
    req = m.RouteRequest("b", 4, 40, parts=[m.RoutePart(2, 20, [1], 8, "a"), m.RoutePart(2, 20, [2], 8, "")])
    assert [p.lora for p in m.route_request_decoder.decode(m.encode(req)).parts] == ["a", ""]
