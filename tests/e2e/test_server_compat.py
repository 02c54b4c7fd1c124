"""What real OpenAI / vLLM clients rely on beyond the basics, against real `ingot serve`
subprocesses on the tiny model, driven with the official `openai` client: the streamed chat's
first chunk only after the first token, fields accepted as no-ops, GET /v1/models/{model}, the
access log and request log, vLLM's metric names, and /metrics behind the API key."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import TINY_FLAGS, run_server, wait_until

KEY = "compat-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
STEP_DELAY = 0.5


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--served-model-name", "tiny", "--api-key", KEY,
            "--api-key-protect-metrics", "--metrics-name-prefix", "vllm",
            "--enable-log-requests"]
    with run_server(args, tmp_path_factory.mktemp("logs"), log_level="info") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def slow_server(tiny_llama_dir, tmp_path_factory):
    """Every engine step sleeps STEP_DELAY seconds first: nothing the model produces can reach
    a client sooner than that after its request. No access log (--disable-uvicorn-access-log);
    the request log is on (its lines mark how far the log has got)."""
    launcher = [sys.executable, str(Path(__file__).with_name("slow_step_cli.py"))]
    env = {**os.environ, "INGOT_TEST_STEP_DELAY": str(STEP_DELAY)}
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--disable-uvicorn-access-log",
            "--enable-log-requests"]
    with run_server(args, tmp_path_factory.mktemp("logs"), log_level="info", launcher=launcher,
                    env=env) as s:
        yield s


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_first_chunk_waits_for_the_first_token(slow_server, n):
    c = openai.OpenAI(base_url=f"{slow_server.base}/v1", api_key="unused", max_retries=0,
                      timeout=60)
    try:
        start = time.monotonic()
        stream = c.chat.completions.create(
            model=c.models.list().data[0].id, messages=MESSAGES, max_tokens=3, n=n,
            temperature=1.0, seed=1, stream=True, extra_body={"ignore_eos": True},
        )
        arrivals, chunks = [], []
        for chunk in stream:
            arrivals.append(time.monotonic() - start)
            chunks.append(chunk)
    finally:
        c.close()
    # The first token needs one (slowed) engine step; the old role-only chunk came in ms.
    assert arrivals[0] >= STEP_DELAY, arrivals
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content  # role with real content
    role_chunks = [ch.index for chunk in chunks for ch in chunk.choices if ch.delta.role]
    assert sorted(role_chunks) == list(range(n))  # the role exactly once per choice...
    for i in range(n):  # ...on that choice's first chunk
        mine = [ch for chunk in chunks for ch in chunk.choices if ch.index == i]
        assert mine[0].delta.role == "assistant"
        assert all(ch.delta.role is None for ch in mine[1:])


def test_uvicorn_access_log_can_be_disabled(slow_server):
    model = slow_server.json("GET", "/v1/models")[1]["data"][0]["id"]
    assert slow_server.request("GET", "/health")[0] == 200
    # An enabled access log writes /health's line as that request ends, before the server
    # reads the next one: the next request's own log line is the event to wait on.
    code, _ = slow_server.json("POST", "/v1/completions",
                               {"model": model, "prompt": [5, 6, 7], "max_tokens": 1})
    assert code == 200
    assert wait_until(lambda: re.search(r"request cmpl-\w+-0: 3 prompt tokens",
                                        slow_server.log()))
    log = slow_server.log()
    assert ' "GET /health" ' not in log and ' "GET /v1/models" ' not in log
    assert "ready: serving" in log  # info lines do reach this log


def test_noop_fields_are_accepted_and_change_nothing(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
    plain = client.chat.completions.create(**kwargs)
    extra = client.chat.completions.create(
        **kwargs, store=True, metadata={"team": "search"}, service_tier="auto", user="u-1",
        parallel_tool_calls=False,
    )
    assert extra.choices[0].message.content == plain.choices[0].message.content
    streamed = client.chat.completions.create(**kwargs, store=False, user="u-1", stream=True,
                                              parallel_tool_calls=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == plain.choices[0].message.content
    cmpl = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, user="u-1")
    assert cmpl.usage.completion_tokens >= 1


def test_auto_tools_need_the_server_flag(client):
    """Without --enable-auto-tool-choice the default tool_choice (auto) is a 400 that says so."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, parallel_tool_calls=True,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    assert info.value.body["param"] == "tool_choice"
    assert "--enable-auto-tool-choice" in info.value.body["message"]


def test_retrieve_model(server, client):
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.object == "model"
    assert card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")
    status, body = server.json("GET", "/v1/models/org/other", headers=AUTH)
    assert status == 404
    assert body["error"]["type"] == "not_found_error" and body["error"]["param"] == "model"
    assert body["error"]["code"] == 404 and "org/other" in body["error"]["message"]


ACCESS = re.compile(
    r'"(?P<method>[A-Z]+) (?P<path>\S+)" (?P<status>\d+) prompt_tokens=(?P<p>-|\d+) '
    r"completion_tokens=(?P<c>-|\d+) latency=(?P<lat>[0-9.]+)s"
)


def access_lines(server) -> list[dict[str, str]]:
    return [m.groupdict() for m in ACCESS.finditer(server.log())]


def test_access_log_one_line_per_request(server, client):
    before = len(access_lines(server))
    resp = client.completions.create(model="tiny", prompt="Once upon", max_tokens=5,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=4, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    ))
    server.request("GET", "/v1/models")  # no key: 401
    # A line is written once its response is out, so it may land just after the client has it.
    wait_until(lambda: len(access_lines(server)) >= before + 3)
    lines = access_lines(server)[before:]
    assert [(x["method"], x["path"], x["status"]) for x in lines] == [
        ("POST", "/v1/completions", "200"),
        ("POST", "/v1/chat/completions", "200"),
        ("GET", "/v1/models", "401"),
    ]
    assert (int(lines[0]["p"]), int(lines[0]["c"])) == (resp.usage.prompt_tokens, 5)
    usage = chunks[-1].usage
    assert (int(lines[1]["p"]), int(lines[1]["c"])) == (usage.prompt_tokens, 4)
    assert (lines[2]["p"], lines[2]["c"]) == ("-", "-")
    assert all(float(x["lat"]) > 0 for x in lines[:2])  # generation takes measurable time


def test_enable_log_requests(server, client):
    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, seed=42)
    assert re.search(r"request cmpl-\w+-0: 3 prompt tokens, SamplingParams\(.*seed=42",
                     server.log())


VLLM_FAMILIES = {
    # family name (as the parser reports it) -> type
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
}


def scrape(server) -> dict:
    status, _, raw = server.request("GET", "/metrics", headers=AUTH)
    assert status == 200
    return {f.name: f for f in text_string_to_metric_families(raw.decode())}


def sample(families: dict, name: str, **labels: str) -> float:
    family = name.removesuffix("_total").removesuffix("_count")
    for s in families[family].samples:
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((name, labels))


def test_vllm_metric_names_and_labels(server, client):
    before = scrape(server)
    for name, kind in VLLM_FAMILIES.items():
        assert before[name].type == kind, name
        for s in before[name].samples:
            assert s.labels["model_name"] == "tiny", s
    assert "ingot:num_requests_running" not in before  # renamed, not duplicated
    assert "ingot:num_seqs_padding" in before  # no vLLM counterpart: keeps its ingot name
    for reason in ("stop", "length", "abort"):
        sample(before, "vllm:request_success_total", finished_reason=reason)

    prompts = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26]]
    client.completions.create(model="tiny", prompt=prompts, max_tokens=3,
                              extra_body={"ignore_eos": True})
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 6
    assert delta("vllm:prompt_tokens_total") == 10
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 4
    assert delta("vllm:prefix_cache_queries_total") >= 10
    assert sample(after, "vllm:num_requests_running") == 0


def test_metrics_behind_the_key_when_protected(server):
    status, _, _ = server.request("GET", "/metrics")
    assert status == 401
    assert server.request("GET", "/metrics", headers={"Authorization": "Bearer nope"})[0] == 401
    assert server.request("GET", "/metrics", headers=AUTH)[0] == 200
    assert server.request("GET", "/health")[0] == 200
    assert server.request("GET", "/version")[0] == 200
