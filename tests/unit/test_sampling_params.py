"""Validation and normalisation of SamplingParams."""

from __future__ import annotations

import pytest

from ingot.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"frequency_penalty": -3.0}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"stop": ""}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_stop_string_normalised_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams().stop == []
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]


def test_top_k_minus_one_disables() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_valid_edges_accepted() -> None:
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        min_p=1.0,
        max_tokens=None,
        min_tokens=3,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        logprobs=0,
        stop_token_ids=[2, 3],
    )
    assert p.all_stop_token_ids == {2, 3}
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.0, seed=1).sampling_type == SamplingType.GREEDY
    assert SamplingParams().sampling_type == SamplingType.RANDOM
    assert SamplingParams(seed=1).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("y")
    q.all_stop_token_ids.add(9)
    assert p.stop == ["x"] and p.all_stop_token_ids == {1}
