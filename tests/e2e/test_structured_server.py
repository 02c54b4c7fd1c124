"""Structured outputs over HTTP on the default model (SmolLM2), driven with the official
`openai` client: ``chat.completions.parse`` with a pydantic model, the beta streaming helper,
``structured_outputs`` in completions and chat, and the engine serving on after bad input."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field
from server_utils import run_server

pytestmark = pytest.mark.slow


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=20)
    country: Literal["France", "Italy", "Spain", "Other"]
    population_millions: int = Field(ge=0, le=100)
    landmarks: list[str] = Field(max_length=2)


MESSAGES = [{"role": "user", "content": "Describe Paris as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # No --model: the embedded default model.
    with run_server(["--max-model-len", "1024"], tmp_path_factory.mktemp("logs"),
                    startup_timeout=120) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_parse_returns_a_pydantic_object(client, model):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=model, messages=MESSAGES, response_format=City, temperature=1.0, seed=seed,
            max_tokens=200,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City), choice.message.content


def test_beta_stream_with_a_schema(client, model):
    with client.beta.chat.completions.stream(
        model=model, messages=MESSAGES, response_format=City, temperature=1.0, seed=7,
        max_tokens=200,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert "".join(deltas) == final.choices[0].message.content
    assert isinstance(final.choices[0].message.parsed, City)


def test_json_object_and_structured_outputs_fields(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, response_format={"type": "json_object"},
        temperature=1.0, seed=3, max_tokens=200,
    )

    assert isinstance(json.loads(resp.choices[0].message.content), dict)
    regex = r"(Paris|Rome), [0-9]{1,2} million"
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=1.0, seed=1, max_tokens=30,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    assert re.fullmatch(regex, chat.choices[0].message.content)
    cmpl = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=10, temperature=1.0, n=4,
        extra_body={"structured_outputs": {"choice": ["Paris", "Lyon"]}},
    )
    assert {c.text for c in cmpl.choices} <= {"Paris", "Lyon"}
    stream = client.completions.create(
        model=model, prompt="Pick:", max_tokens=10, stream=True,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) in ("yes", "no")


def test_bad_schema_is_a_400_and_the_server_serves_on(client, model):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, messages=MESSAGES, response_format=bad,
                                           stream=stream)
        assert info.value.body["param"] == "response_format"
    ok = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].message.content
