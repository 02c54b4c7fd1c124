"""`ingot serve -tp 2` (two worker processes over gloo) serves the official `openai` client
with the greedy text and logprobs of `-tp 1`; killing a worker process fails the in-flight
request and turns /health to 503 instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import openai
import pytest
from server_utils import TINY_FLAGS, run_server, wait_until

pytestmark = pytest.mark.slow  # two servers, one with two worker processes

PROMPTS = ["Once upon a time", "The quick brown fox"]
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def _client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _answers(server) -> dict:  # noqa: ANN001
    client = _client(server)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16,
                                           temperature=0, logprobs=2)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                          temperature=0)
    stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=16,
                                       temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    client.close()
    return {
        "texts": [c.text for c in completion.choices],
        "logprobs": [c.logprobs.token_logprobs for c in completion.choices],
        "chat": chat.choices[0].message.content,
        "stream": streamed,
    }


@pytest.fixture(scope="module")
def answers(tiny_llama_dir, tmp_path_factory):
    out = {}
    for tp in (1, 2):
        logs = tmp_path_factory.mktemp(f"tp{tp}")
        with run_server([str(tiny_llama_dir), *TINY_FLAGS, "-tp", str(tp)], logs,
                        startup_timeout=120) as server:
            out[tp] = _answers(server)
    return out


def test_greedy_text_equals_tp1(answers):
    assert answers[2]["texts"] == answers[1]["texts"]
    assert answers[2]["chat"] == answers[1]["chat"]
    assert answers[2]["stream"] == answers[1]["stream"] == answers[1]["texts"][0]


def test_logprobs_within_1e5_of_tp1(answers):
    _logprobs_within_1e5(answers[2], answers[1])


def _logprobs_within_1e5(got_answers: dict, ref_answers: dict) -> None:
    for got, ref in zip(got_answers["logprobs"], ref_answers["logprobs"], strict=True):
        assert got == pytest.approx(ref, abs=1e-5)


def test_tp_server_twin_a_perturbed_shard_on_one_rank_fails(answers, tiny_llama_dir, tmp_path):
    """Broken twin: the -tp 2 server's rank 1 loads its shard of one weight 5% off (rank 0's
    is right); the logprob gate against -tp 1 must see it."""
    from faults import child_env, fails

    env = child_env("weight", name="layers.0.self_attn.o_proj", scale=0.05, rank=1)
    with run_server([str(tiny_llama_dir), *TINY_FLAGS, "-tp", "2"], tmp_path,
                    startup_timeout=120, env=env) as server:
        broken = _answers(server)
    with fails():
        _logprobs_within_1e5(broken, answers[1])


def _worker_pids(server_pid: int) -> list[int]:
    """The server's spawned worker processes (multiprocessing's spawn_main children)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                pids.append(int(child))
    return sorted(pids)


def test_killed_worker_fails_the_request_and_health(tiny_llama_dir, tmp_path):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS, "-tp", "2"], tmp_path,
                    startup_timeout=120) as server:
        workers = _worker_pids(server.proc.pid)
        assert len(workers) == 2, workers
        client = _client(server)
        model = client.models.list().data[0].id
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=200,
                                           temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        os.kill(workers[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert time.monotonic() - start < 30
        assert wait_until(lambda: server.request("GET", "/health")[0] == 503, timeout=30)
        client.close()
