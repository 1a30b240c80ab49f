"""Structured output and per-row sampling: forms, validation (at job creation and per
row), and the mapping onto vLLM's own `SamplingParams` / `StructuredOutputsParams`."""

from __future__ import annotations

import msgspec
import pytest

from prefixflow.cli.main import parse_args, sampling_from
from prefixflow.services.engine_worker.requests import prompt_sampling, sampling_kwargs
from prefixflow.shared.wire import messages as m
from prefixflow.shared.wire.sampling import from_response_format, row_sampling

pytestmark = [pytest.mark.unit, pytest.mark.timeout(300)]

JOB = m.SamplingSpec(max_tokens=16, temperature=0.7)
SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "enum": ["x", "y"]}}, "required": ["a"]}


def test_row_without_overrides_uses_the_job():
    assert row_sampling(JOB, {"prompt": "hi", "label": 3}) is None


def test_row_overrides_merge_over_the_job():
    spec = row_sampling(JOB, {"sampling": {"temperature": 0.0, "stop": ["."], "max_completion_tokens": 5, "seed": None}})
    assert (spec.max_tokens, spec.temperature, spec.stop, spec.top_p) == (5, 0.0, ["."], 1.0)


@pytest.mark.parametrize(
    "row,structured",
    [
        ({"json_schema": SCHEMA}, m.StructuredSpec(json_schema=SCHEMA)),
        ({"json_schema": '{"type": "integer"}'}, m.StructuredSpec(json_schema={"type": "integer"})),
        ({"regex": "[0-9]+"}, m.StructuredSpec(regex="[0-9]+")),
        ({"choice": ["a", "b"]}, m.StructuredSpec(choice=["a", "b"])),
        ({"grammar": 'root ::= "a" | "b"'}, m.StructuredSpec(grammar='root ::= "a" | "b"')),
        ({"response_format": {"type": "json_object"}}, m.StructuredSpec(json_object=True)),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
         m.StructuredSpec(json_schema=SCHEMA)),
        ({"sampling": {"choice": ["a"]}}, m.StructuredSpec(choice=["a"])),
    ],
)
def test_structured_forms(row, structured):
    assert row_sampling(JOB, row).structured == structured


@pytest.mark.parametrize(
    "row,error",
    [
        ({"sampling": {"temperature": -0.5}}, "temperature"),
        ({"sampling": {"top_p": 1.5}}, "top_p"),
        ({"sampling": {"max_tokens": 0}}, "max_tokens"),
        ({"sampling": {"presence_penalty": 3}}, "presence_penalty"),
        ({"sampling": {"temprature": 1}}, "unknown field `temprature`"),
        ({"sampling": "hot"}, "'sampling' must be an object"),
        ({"json_schema": {"type": "objectx"}}, "invalid JSON schema"),
        ({"json_schema": "{not json"}, "json_schema is not valid JSON"),
        ({"regex": "a(b"}, "regex does not compile"),
        ({"grammar": 'root ::= "a'}, "grammar does not compile"),
        ({"choice": []}, "choice wants a non-empty list"),
        ({"choice": ["a"], "regex": "b"}, "exactly one of"),
        ({"response_format": {"type": "xml"}}, "unknown response_format type"),
    ],
)
def test_bad_rows_raise_with_a_reason(row, error):
    with pytest.raises(ValueError) as info:
        row_sampling(JOB, row)
    assert error in str(info.value)


def test_job_spec_with_an_invalid_schema_does_not_decode():
    raw = b'{"job": "j", "out_dir": "/o", "sampling": {"structured": {"json_schema": {"type": 5}}}}'
    with pytest.raises(msgspec.ValidationError, match="invalid JSON schema"):
        m.job_spec_decoder.decode(raw)


def test_cli_refuses_an_invalid_schema_before_creating_the_job():
    with pytest.raises(SystemExit, match="bad sampling parameters: invalid JSON schema"):
        sampling_from(parse_args(["submit", "x.jsonl", "--out", "o", "--json-schema", '{"type": "objectx"}']))
    with pytest.raises(SystemExit, match="regex does not compile"):
        sampling_from(parse_args(["submit", "x.jsonl", "--out", "o", "--regex", "a(b"]))
    spec = sampling_from(parse_args(["submit", "x.jsonl", "--out", "o", "--choice", "yes,no", "--stop", "!"]))
    assert spec.structured == m.StructuredSpec(choice=["yes", "no"]) and spec.stop == ["!"]


def test_response_format_text_is_free_text():
    assert from_response_format({"type": "text"}) == {}


def test_prompt_carries_its_own_sampling():
    own = row_sampling(JOB, {"choice": ["a", "b"]})
    p = m.Prompt("j", 1, b"\0\0\0\1", sampling=m.encode(own))
    assert prompt_sampling(p, JOB) == own
    assert prompt_sampling(m.Prompt("j", 2, b"\0\0\0\1"), JOB) is JOB


@pytest.mark.parametrize(
    "structured",
    [
        m.StructuredSpec(json_schema=SCHEMA),
        m.StructuredSpec(regex="[a-z]{3}"),
        m.StructuredSpec(choice=["yes", "no"]),
        m.StructuredSpec(grammar='root ::= "a" | "b"'),
        m.StructuredSpec(json_object=True),
    ],
)
def test_maps_onto_vllms_own_params_and_vllm_accepts_them(structured):
    """The kwargs build vLLM's `SamplingParams`, and vLLM's xgrammar validation (what it
    runs before accepting a request) passes for every form we accept."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    spec = msgspec.structs.replace(JOB, structured=structured, stop=["x"])
    kwargs = sampling_kwargs(spec, seed=3)
    kwargs["structured_outputs"] = StructuredOutputsParams(**kwargs["structured_outputs"])
    params = SamplingParams(**kwargs)
    assert (params.max_tokens, params.temperature, params.seed, params.stop) == (16, 0.7, 3, ["x"])
    validate_xgrammar_grammar(params)


@pytest.mark.parametrize("form", [{"regex": "a(b"}, {"grammar": 'root ::= "a'}, {"json_schema": {"type": "objectx"}}])
def test_what_we_refuse_vllm_refuses_too(form):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    with pytest.raises(ValueError):
        row_sampling(JOB, form)
    key = "json" if "json_schema" in form else next(iter(form))
    with pytest.raises((VLLMValidationError, ValueError)):
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(**{key: next(iter(form.values()))})))
