"""`ingot serve --data-parallel-size 2`: one API server in front of two engine-core processes
serves the official `openai` client with DP=1's greedy output, balances 100 requests between the
replicas (counted from its per-rank metrics), and when one replica's process is killed the
in-flight request fails with an error within 30 s and /health turns 503, instead of hanging."""

from __future__ import annotations

import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from server_utils import TINY_FLAGS, metric, run_server, wait_until

pytestmark = pytest.mark.slow  # two servers, one with two engine processes

PROMPTS = ["Once upon a time", "The quick brown fox", "Hello", "In a hole in the ground"]
MESSAGES = [{"role": "user", "content": "Tell me a story"}]


def _client(server) -> openai.OpenAI:  # noqa: ANN001
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def _answers(server) -> dict:  # noqa: ANN001
    client = _client(server)
    model = client.models.list().data[0].id
    completion = client.completions.create(model=model, prompt=PROMPTS, max_tokens=16,
                                           temperature=0)
    chat = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16,
                                          temperature=0)
    stream = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=16,
                                       temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    client.close()
    return {"texts": [c.text for c in completion.choices], "chat": chat.choices[0].message.content,
            "stream": streamed}


@pytest.fixture(scope="module")
def dp1_answers(tiny_llama_dir, tmp_path_factory):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path_factory.mktemp("dp1"),
                    startup_timeout=120) as server:
        return _answers(server)


@pytest.fixture(scope="module")
def dp2(tiny_llama_dir, tmp_path_factory):
    with run_server([str(tiny_llama_dir), *TINY_FLAGS, "--data-parallel-size", "2"],
                    tmp_path_factory.mktemp("dp2"), startup_timeout=120) as server:
        yield server


def _routed(server) -> list[float]:  # noqa: ANN001
    samples = server.metrics()
    return [metric(samples, "ingot:dp_requests_routed_total", dp_rank=str(r)) for r in (0, 1)]


def test_greedy_output_equals_dp1(dp2, dp1_answers):
    answers = _answers(dp2)
    assert len(set(dp1_answers["texts"])) == len(PROMPTS)  # an order mix-up would show
    assert answers == dp1_answers
    assert answers["stream"] == dp1_answers["texts"][1]
    assert min(_routed(dp2)) > 0  # both replicas served some of them


def test_routes_by_queue_length(dp2):
    """One request at a time, the replicas take turns exactly (equal queues: round robin).
    100 at once, 16 in flight, go to the replica with fewer unfinished requests, so each one's
    share follows its speed: both serve a large part. (A 50 +- 20% band on that split failed at
    38/62 while another test process had the second CPU: the slower replica was given fewer,
    as the rule intends; a speed-dependent band is not what this checks.)"""
    client = _client(dp2)
    model = client.models.list().data[0].id

    def one(i: int) -> str:
        return client.completions.create(model=model, prompt=f"request {i}", max_tokens=4,
                                         temperature=0).choices[0].text

    before = _routed(dp2)
    for i in range(10):
        one(i)
    assert [a - b for a, b in zip(_routed(dp2), before, strict=True)] == [5, 5]

    before = _routed(dp2)
    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(one, range(100)))
    client.close()
    assert len(texts) == 100
    counts = [a - b for a, b in zip(_routed(dp2), before, strict=True)]
    assert sum(counts) == 100
    assert min(counts) >= 20, counts


def test_constraints_are_checked_on_a_replica(dp2):
    """The server's check before a response starts compiles the constraint on a replica (the
    front end keeps no grammar compiler): a bad one is a 400 naming the field, a good one
    constrains the output."""
    status, err = dp2.json("POST", "/v1/completions", {
        "prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "(("}})
    assert status == 400 and "invalid structured_outputs.regex" in err["error"]["message"]
    assert err["error"]["param"] == "structured_outputs"
    for _ in range(2):  # a replica's cache, then the other replica (or the cache again)
        status, body = dp2.json("POST", "/v1/completions", {
            "prompt": "hi", "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}})
        assert status == 200 and body["choices"][0]["text"] in ("yes", "no"), body


def _engine_pids(server_pid: int) -> list[int]:
    """The server's spawned engine-core processes (multiprocessing's spawn_main children)."""
    pids = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                pids.append(int(child))
    return sorted(pids)


def test_killed_replica_fails_the_request_and_health(dp2):
    # Last in this module: it takes the server down.
    engines = _engine_pids(dp2.proc.pid)
    assert len(engines) == 2, engines
    client = _client(dp2)
    model = client.models.list().data[0].id
    streams = [client.completions.create(model=model, prompt=p, max_tokens=200, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
               for p in PROMPTS[:2]]  # one on each replica
    for stream in streams:
        next(iter(stream))
    os.kill(engines[1], signal.SIGKILL)
    start = time.monotonic()
    for stream in streams:
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
    assert time.monotonic() - start < 30
    assert wait_until(lambda: dp2.request("GET", "/health")[0] == 503, timeout=30)
    client.close()


def test_two_node_launch_on_localhost(tiny_llama_dir, tmp_path, dp1_answers):
    """vLLM's multi-node recipe on one machine: the API server's "node" runs replica 0 and a
    --headless "node" replica 1, meeting over TCP at --data-parallel-rpc-port. Stopping the
    server shuts the other node's replica down, and its launcher exits cleanly."""
    import subprocess
    import sys

    from server_utils import free_port

    rpc = ["--data-parallel-size", "2", "--data-parallel-size-local", "1",
           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(free_port(2))]
    env = {**os.environ, "INGOT_RPC_SECRET": secrets.token_hex(32)}  # both nodes share it
    with open(tmp_path / "headless.log", "w") as log:
        headless = subprocess.Popen(
            [sys.executable, "-m", "ingot.cli.main", "serve", str(tiny_llama_dir),
             *TINY_FLAGS, *rpc, "--data-parallel-start-rank", "1", "--headless"],
            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        with run_server([str(tiny_llama_dir), *TINY_FLAGS, *rpc], tmp_path,
                        startup_timeout=120, env=env) as server:
            assert _answers(server) == dp1_answers
            assert min(_routed(server)) > 0  # the other node served some of them
        assert headless.wait(timeout=30) == 0, (tmp_path / "headless.log").read_text()
    finally:
        if headless.poll() is None:
            headless.kill()
            headless.wait()
