"""`ingot serve` on the tiny model, driven with the official `openai` client: completions and
chat, streaming and not, n, logprobs, stop strings, usage, seeds, and greedy text equal to the
offline ``LLM`` for the same request."""

from __future__ import annotations

import math
from contextlib import contextmanager

import openai
import pytest
from server_utils import TINY_FLAGS, run_server

import ingot
from faults import child_env, fails
from ingot import LLM, SamplingParams

PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    """The offline engine with the server's flags: the reference for every text."""
    return LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256)


def test_models_health_version(server, client, tiny_llama_dir):
    models = client.models.list().data
    assert [m.id for m in models] == [tiny_llama_dir.name]
    assert models[0].model_extra["max_model_len"] == 256
    assert server.request("GET", "/health")[0] == 200
    status, body = server.json("GET", "/version")
    assert status == 200 and body["version"] == ingot.__version__


@contextmanager
def _broken_client(tiny_llama_dir, tmp_path, fault: str, **params):
    """A second server, every process of it running with ``fault`` (tests/faults.py)."""
    with (run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path, env=child_env(fault, **params))
          as s, openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0,
                              timeout=60) as c):
        yield c, c.models.list().data[0].id


def test_completion_greedy_matches_offline_llm(client, model, llm):
    _completion_matches_offline(client, model, llm)


@pytest.mark.slow
def test_server_vs_offline_twin_a_perturbed_weight_fails(tiny_llama_dir, tmp_path, llm):
    with (_broken_client(tiny_llama_dir, tmp_path, "weight", name="layers.1.mlp.down_proj")
          as (client, model), fails()):
        _completion_matches_offline(client, model, llm)


def _completion_matches_offline(client, model, llm) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    (ref,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))
    choice = resp.choices[0]
    assert choice.text == ref.outputs[0].text
    assert choice.finish_reason == ref.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.object == "text_completion" and resp.model == model


def test_completion_token_id_prompts_batch(client, model, llm):
    """A list of token-id prompts: one choice per prompt, in order, each equal to the LLM's."""
    prompts = [[5, 70, 80, 90], [100, 101, 102, 103, 104, 105, 106]]
    resp = client.completions.create(model=model, prompt=prompts, max_tokens=8, temperature=0)
    refs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.text for c in resp.choices] == [r.outputs[0].text for r in refs]
    assert resp.usage.prompt_tokens == 11
    assert resp.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in refs)


def test_completion_stream_equals_whole(client, model, llm):
    _completion_stream_equals_whole(client, model, llm)


@pytest.mark.slow
def test_streamed_vs_whole_twin_a_dropped_chunk_fails(tiny_llama_dir, tmp_path, llm):
    """Broken twin of both stream gates: the server loses each stream's second event."""
    with _broken_client(tiny_llama_dir, tmp_path, "stream_drops_a_chunk") as (client, model):
        with fails():
            _completion_stream_equals_whole(client, model, llm)
        with fails():
            _chat_stream_equals_whole(client, model, llm)


def _completion_stream_equals_whole(client, model, llm) -> None:
    (ref,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # streamed, not one block
    assert "".join(c.choices[0].text for c in text_chunks) == ref.outputs[0].text
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
    assert all(c.usage is None for c in chunks[:-1])  # usage only in the last chunk


def test_stream_without_include_usage_has_no_usage_chunk(client, model):
    chunks = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, stream=True
    ))
    assert chunks and all(c.choices and c.usage is None for c in chunks)


def test_chat_greedy_matches_offline_llm(server, client, model, llm):
    (ref,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20))
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_completion_tokens=20, temperature=0
    )
    msg = resp.choices[0].message
    assert msg.role == "assistant" and msg.content == ref.outputs[0].text
    assert resp.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert resp.object == "chat.completion"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # The prompt went through the model's chat template: /tokenize on the messages agrees.
    status, tok = server.json("POST", "/tokenize", {"messages": MESSAGES})
    assert status == 200 and tok["tokens"] == ref.prompt_token_ids
    assert tok["count"] == resp.usage.prompt_tokens


def test_chat_stream_equals_whole(client, model, llm):
    _chat_stream_equals_whole(client, model, llm)


def _chat_stream_equals_whole(client, model, llm) -> None:
    (ref,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    deltas = [c for c in chunks if c.choices]
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == ref.outputs[0].text
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_n2_choices_and_usage(client, model):
    resp = client.completions.create(
        model=model, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert resp.usage.completion_tokens == 16
    # Each choice has its own generator (seed + index): the two samples differ.
    assert resp.choices[0].text != resp.choices[1].text

    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in chat.choices) == [0, 1]
    assert chat.usage.completion_tokens == 12


def test_n2_chat_stream(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=3,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    ))
    texts = {0: "", 1: ""}
    finished = set()
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    whole = client.chat.completions.create(
        model=model, messages=MESSAGES, n=2, max_tokens=6, temperature=1.0, seed=3,
        extra_body={"ignore_eos": True},
    )
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == 12


def test_seed_reproducible_and_equal_to_offline(client, model, llm):
    knobs = dict(temperature=0.9, top_p=0.95, presence_penalty=0.5, frequency_penalty=0.3)
    extra = {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True}
    a, b, c = (
        client.completions.create(model=model, prompt=PROMPT, max_tokens=16, seed=seed,
                                  extra_body=extra, **knobs).choices[0].text
        for seed in (1234, 1234, 4321)
    )
    assert a == b
    assert a != c
    (ref,) = llm.generate(PROMPT, SamplingParams(max_tokens=16, seed=1234, **knobs, **extra))
    assert a == ref.outputs[0].text  # every sampling field reached the engine unchanged


def test_chat_logprobs(client, model, llm):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 6 == resp.usage.completion_tokens
    (ref,) = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                               logprobs=3))
    for entry, ref_lp, tid in zip(content, ref.outputs[0].logprobs, ref.outputs[0].token_ids,
                                  strict=True):
        assert len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(lp <= 0 for lp in tops)
        # Greedy: the chosen token is the most likely one.
        assert math.isclose(entry.logprob, tops[0], rel_tol=0, abs_tol=1e-6)
        assert math.isclose(entry.logprob, ref_lp[tid].logprob, abs_tol=1e-4)
        assert entry.bytes == list(entry.token.encode())


def test_completion_logprobs_stream_and_whole(client, model):
    whole = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token_lp, tops in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(tops) <= 3  # the top 2, plus the sampled token when it is not in them
        assert token_lp <= 0 and math.isclose(token_lp, max(tops.values()), abs_tol=1e-6)
    streamed = list(client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2, stream=True,
        extra_body={"ignore_eos": True},
    ))
    # With logprobs on every token is streamed, even one whose text is still held back.
    tokens = [t for c in streamed for t in c.choices[0].logprobs.tokens]
    values = [v for c in streamed for v in c.choices[0].logprobs.token_logprobs]
    assert tokens == lp.tokens
    assert values == pytest.approx(lp.token_logprobs, abs=1e-6)


def _stop_string(text: str) -> str:
    """Two printable characters from the middle of ``text`` (the tiny model writes random
    bytes; a replacement character would not make a meaningful stop string)."""
    for k in range(2, len(text) - 1):
        piece = text[k : k + 2]
        if piece.isprintable() and "\ufffd" not in piece:
            return piece
    raise AssertionError(f"no printable pair in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, model, stream):
    full = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=32, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text
    stop = _stop_string(full)
    expected = full[: full.index(stop)]
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "\x00zz"],
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].text for c in chunks)
        last = chunks[-1].choices[0]
    else:
        last = client.completions.create(**kwargs).choices[0]
        text = last.text
    assert text == expected
    assert last.finish_reason == "stop"
    assert last.model_extra["stop_reason"] == stop


def test_chat_stop_with_include_stop_str(client, model):
    full = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=32, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].message.content
    stop = _stop_string(full)
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=32, temperature=0, stop=stop,
        extra_body={"ignore_eos": True, "include_stop_str_in_output": True},
    )
    assert resp.choices[0].message.content == full[: full.index(stop) + len(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_max_tokens_defaults_to_the_room_left(client, model):
    """Chat without max_tokens may generate up to max_model_len - prompt tokens."""
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.usage.prompt_tokens + resp.usage.completion_tokens == 256
    assert resp.choices[0].finish_reason == "length"


def test_tokenize_detokenize_round_trip(server):
    status, tok = server.json("POST", "/tokenize", {"prompt": "héllo"})
    assert status == 200
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    status, detok = server.json("POST", "/detokenize", {"tokens": tok["tokens"]})
    assert status == 200 and detok["prompt"].endswith("héllo")
    status, plain = server.json("POST", "/tokenize",
                                {"prompt": "héllo", "add_special_tokens": False})
    assert plain["count"] == len("héllo".encode())  # byte-level: one token per byte


def test_prompt_logprobs_in_whole_responses(client, model, llm):
    prompt = [70, 71, 72, 73, 74]
    resp = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0,
                                     extra_body={"prompt_logprobs": 2})
    got = resp.choices[0].model_extra["prompt_logprobs"]
    (ref,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    assert got[0] is None and len(got) == len(prompt) == len(ref.prompt_logprobs)
    for pos, (entry, ref_entry) in enumerate(zip(got[1:], ref.prompt_logprobs[1:], strict=True),
                                             start=1):
        actual = entry[str(prompt[pos])]  # the prompt's own token is always included
        assert actual["logprob"] == pytest.approx(ref_entry[prompt[pos]].logprob, abs=1e-4)
        assert actual["rank"] >= 1 and 2 <= len(entry) <= 3
    # Sent twice: the second time its prefix is cached, yet every position still has an entry.
    probe = [{"role": "user", "content": "prompt logprobs probe"}]
    client.chat.completions.create(model=model, messages=probe, max_tokens=2)
    chat = client.chat.completions.create(model=model, messages=probe, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


def test_pooling_routes_need_a_pooling_model(server):
    """A generative model answers the pooling routes with a 400 that names --runner pooling."""
    for path, body in [("/v1/embeddings", {"input": "hi"}), ("/pooling", {"input": "hi"}),
                       ("/classify", {"input": "hi"}), ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]})]:
        status, err = server.json("POST", path, body)
        assert status == 400, (path, err)
        assert "--runner pooling" in err["error"]["message"]


def test_prompt_embeds_need_the_flag(server):
    status, err = server.json("POST", "/v1/completions", {"prompt_embeds": "AAAA", "max_tokens": 2})
    assert status == 400 and "--enable-prompt-embeds" in err["error"]["message"]
