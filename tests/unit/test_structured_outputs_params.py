"""StructuredOutputsParams and --structured-outputs-config validation."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from ingot.config import StructuredOutputsConfig
from ingot.sampling_params import SamplingParams, StructuredOutputsParams


def test_exactly_one_kind():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one constraint kind.*got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="got choice, grammar"):
        StructuredOutputsParams(choice=["a"], grammar='root ::= "a"')
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


def test_field_validation():
    with pytest.raises(ValueError, match="json is not valid JSON"):
        StructuredOutputsParams(json="{oops")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex must be a non-empty string"):
        StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json_object=True, whitespace_pattern=r"\s?")


def test_pydantic_model_and_dicts():
    class Point(BaseModel):
        x: int

    p = StructuredOutputsParams(json=Point)
    assert p.json["properties"]["x"]["type"] == "integer"
    sp = SamplingParams(structured_outputs={"choice": ["a", "b"]})
    assert sp.structured_outputs.choice == ["a", "b"]
    assert sp.clone().structured_outputs == sp.structured_outputs
    with pytest.raises(ValueError, match="unknown structured_outputs field.*jsn"):
        SamplingParams(structured_outputs={"jsn": {}})
    # the schema keeps its property order: it is the order the model writes them in
    spec = StructuredOutputsParams(json={"properties": {"b": {}, "a": {}}}).spec
    assert spec.index('"b"') < spec.index('"a"')


def test_min_tokens_is_refused_with_a_constraint():
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    assert SamplingParams(min_tokens=2).min_tokens == 2


def test_structured_outputs_config():
    assert StructuredOutputsConfig.from_dict({}).backend == "xgrammar"
    assert StructuredOutputsConfig.from_dict({"backend": "auto"}).backend == "xgrammar"
    with pytest.raises(ValueError, match="backend 'outlines' is not supported"):
        StructuredOutputsConfig.from_dict({"backend": "outlines"})
    with pytest.raises(ValueError, match="unknown structured_outputs_config key.*bakend"):
        StructuredOutputsConfig.from_dict({"bakend": "xgrammar"})
    with pytest.raises(ValueError, match="compile_timeout_s"):
        StructuredOutputsConfig.from_dict({"compile_timeout_s": 0})
    with pytest.raises(ValueError, match="max_json_whitespace"):
        StructuredOutputsConfig.from_dict({"max_json_whitespace": 0})
    assert StructuredOutputsConfig.from_dict({"max_json_whitespace": None}).max_json_whitespace is None
    assert StructuredOutputsConfig.from_dict({}).compile_threads == 2
    assert StructuredOutputsConfig.from_dict({"compile_threads": 1}).compile_threads == 1
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="compile_threads must be a positive integer"):
            StructuredOutputsConfig.from_dict({"compile_threads": bad})
