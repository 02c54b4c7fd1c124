"""Every bad input gets OpenAI's error JSON with the right status, and the server keeps serving.

The server runs with an API key and a 64 KiB body limit."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import shutil
import signal
from pathlib import Path

import openai
import pytest
from server_utils import TINY_FLAGS, run_server, wait_until

KEY = "sekrit-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 64 * 1024
CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model with a tokenizer that declares model_max_length 128 (as real tokenizers
    do), so that transformers has a reason to warn about long prompts."""
    path = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_llama_dir, path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["model_max_length"] = 128
    config_path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module", params=["uni", "mp", "uni+async"])
def server(model_dir, tmp_path_factory, request):
    """Every error path, with the worker in the server's process and in a child process, and
    with async scheduling (the worker on its own thread, two steps in flight)."""
    backend, _, mode = request.param.partition("+")
    traces = tmp_path_factory.mktemp("traces")
    args = [str(model_dir), *TINY_FLAGS, "--api-key", KEY,
            "--max-request-body-bytes", str(LIMIT), "--served-model-name", "tiny",
            "--additional-config", json.dumps({"profiler": {"output_dir": str(traces)}}),
            "--enable-admin-routes", "--distributed-executor-backend", backend,
            "--async-scheduling" if mode == "async" else "--no-async-scheduling"]
    with run_server(args, tmp_path_factory.mktemp("logs")) as s:
        yield s


def assert_error(status: int, body: bytes, expected_status: int, *fragments: str) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    assert status == expected_status, body
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == expected_status and isinstance(err["type"], str) and err["message"]
    for fragment in fragments:
        assert fragment in err["message"], err["message"]
    return err


# (path, body, status, fragments of the message, param): one bad request each.
BAD_REQUESTS = [
    (CMPL, b"{not json", 400, ["not valid JSON"], None),
    (CMPL, b"", 400, ["empty"], None),
    (CMPL, b"[1, 2]", 400, ["JSON object"], None),
    (CMPL, b'{"prompt": "hi", "temperature": NaN}', 400, ["NaN"], "temperature"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -Infinity}', 400,
     ["-Infinity"], "top_p"),
    (CMPL, {"prompt": "hi", "bogus_field": 1}, 400, ["Unrecognized", "bogus_field"], "bogus_field"),
    (CMPL, {"max_tokens": 4}, 400, ["prompt is required"], "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": "5"}, 400, ["max_tokens", "integer"], "max_tokens"),
    (CMPL, {"prompt": "hi", "stream": 1}, 400, ["stream", "boolean"], "stream"),
    (CMPL, {"prompt": "hi", "temperature": "hot"}, 400, ["temperature"], "temperature"),
    (CMPL, {"prompt": 5}, 400, ["prompt", "wrong type", "expected one of"], "prompt"),
    (CMPL, {"prompt": [1, "a"]}, 400, ["prompt", "wrong type"], "prompt"),
    (CMPL, {"prompt": "hi", "stop": 3}, 400, ["stop"], "stop"),
    (CMPL, {"prompt": "hi", "temperature": -1}, 400, ["temperature must be >= 0"], "temperature"),
    (CMPL, {"prompt": "hi", "top_p": 0}, 400, ["top_p must be in (0, 1]"], "top_p"),
    (CMPL, {"prompt": "hi", "top_k": -5}, 400, ["top_k"], "top_k"),
    (CMPL, {"prompt": "hi", "min_p": 2.0}, 400, ["min_p must be in [0, 1]"], "min_p"),
    (CMPL, {"prompt": "hi", "presence_penalty": 3}, 400, ["presence_penalty"], "presence_penalty"),
    (CMPL, {"prompt": "hi", "repetition_penalty": 0}, 400, ["repetition_penalty"],
     "repetition_penalty"),
    (CMPL, {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens must be"], "max_tokens"),
    (CMPL, {"prompt": "hi", "n": 0}, 400, ["n"], "n"),
    (CMPL, {"prompt": "hi", "n": 100000}, 400, ["n", "128"], "n"),
    (CMPL, {"prompt": "hi", "seed": 2**70}, 400, ["seed"], "seed"),
    (CMPL, {"prompt": "hi", "top_k": 2**70}, 400, ["top_k"], "top_k"),
    (CMPL, {"prompt": "hi", "logprobs": 50}, 400, ["logprobs must be in [0, 20]"], "logprobs"),
    (CMPL, {"prompt": "hi", "min_tokens": 9, "max_tokens": 3}, 400, ["min_tokens"],
     "min_tokens"),
    (CMPL, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     ["stream_options", "stream is true"], "stream_options"),
    (CMPL, {"prompt": "hi", "logit_bias": {"5": 1.0}}, 400, ["logit_bias"], "logit_bias"),
    (CMPL, {"prompt": "hi", "echo": True}, 400, ["echo"], "echo"),
    (CMPL, {"prompt": "hi", "suffix": "x"}, 400, ["suffix"], "suffix"),
    (CMPL, {"prompt": "hi", "best_of": 3}, 400, ["best_of"], "best_of"),
    (CMPL, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, 400, ["prompt_logprobs"],
     "prompt_logprobs"),
    (CMPL, {"prompt": ""}, 400, ["empty"], "prompt"),
    (CMPL, {"prompt": []}, 400, ["empty"], "prompt"),
    (CMPL, {"prompt": ["hi", ""]}, 400, ["empty"], "prompt"),
    (CMPL, {"prompt": [5, 99999]}, 400, ["99999", "vocabulary"], "prompt"),
    (CMPL, {"prompt": [5, 99999], "stream": True}, 400, ["99999", "vocabulary"], "prompt"),
    (CMPL, {"prompt": "hi", "model": "gpt-4"}, 404, ["gpt-4", "does not exist"], "model"),
    (CMPL, {"prompt": "x" * 300}, 400, ["maximum context length is 256", "300"], "prompt"),
    (CMPL, {"prompt": "hi", "max_tokens": 1000}, 400, ["maximum context length", "max_tokens"],
     "max_tokens"),
    (CMPL, {"prompt": "x" * 300, "stream": True}, 400, ["maximum context length"], "prompt"),
    (CMPL, {"prompt": "hi", "temperature": -1, "stream": True}, 400, ["temperature"],
     "temperature"),
    (CHAT, {"messages": []}, 400, ["messages is empty"], "messages"),
    (CHAT, {"messages": "hi"}, 400, ["messages"], "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, ["messages[0].role is required"],
     "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, ["messages[0].content"],
     "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, ["only text parts"], "messages[0].content"),
    (CHAT, {"messages": MSGS, "top_logprobs": 3}, 400, ["top_logprobs needs logprobs"],
     "top_logprobs"),
    (CHAT, {"messages": MSGS, "logprobs": True, "top_logprobs": 99}, 400, ["top_logprobs"],
     "top_logprobs"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}]}, 400, ["tools[0].function needs"],
     "tools[0].function"),
    (CHAT, {"messages": MSGS, "tool_choice": "required"}, 400, ["tool_choice", "needs tools"],
     "tool_choice"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function"}], "parallel_tool_calls": True}, 400,
     ["tools[0]"], "tools[0].function"),
    (CHAT, {"messages": MSGS, "tools": []}, 400, ["tools is empty"], "tools"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     ["'g'", "not in tools"], "tool_choice"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     ["--enable-auto-tool-choice"], "tool_choice"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "bad name"}}],
            "tool_choice": "none"}, 400, ["tools[0].function.name"], "tools[0].function.name"),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": "required"}, 400, ["does not render tools"], "tools"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "xml"}}, 400,
     ["response_format.type"], "response_format"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "no-such-type"}}}, "stream": True}, 400,
     ["invalid structured_outputs.json", "no-such-type"], "response_format"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "pattern": "(("}}}}, 400,
     ["invalid structured_outputs.json"], "response_format"),
    (CHAT, {"messages": MSGS, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}, 400, ["send one"], "response_format"),
    (CHAT, {"messages": MSGS, "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     ["exactly one constraint kind", "regex, choice"], "structured_outputs"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"regex": "(("}, "stream": True}, 400,
     ["invalid structured_outputs.regex"], "structured_outputs"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"grammar": "root ::= nope"}}, 400,
     ["invalid structured_outputs.grammar"], "structured_outputs"),
    (CMPL, {"prompt": "hi", "structured_outputs": {"json": {"type": "object"}, "jsn": 1}}, 400,
     ["unknown structured_outputs field", "jsn"], "structured_outputs"),
    # xgrammar has no whitespace regex: refused, naming what to use instead
    (CMPL, {"prompt": "hi", "structured_outputs": {"json_object": True,
                                                   "whitespace_pattern": "[ ]?"}}, 400,
     ["whitespace_pattern is not supported", "disable_any_whitespace"], "structured_outputs"),
    (CHAT, {"messages": MSGS, "store": "yes"}, 400, ["store", "boolean"], "store"),
    (CHAT, {"messages": MSGS, "metadata": {"k": 1}}, 400, ["metadata"], "metadata.k"),
    (CHAT, {"messages": MSGS, "chat_template": "{% if %}"}, 400,
     ["chat template", "--trust-request-chat-template"], "chat_template"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, 400,
     ["chat_template_kwargs", "tokenize"], "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "max_completion_tokens": 5000}, 400,
     ["maximum context length", "reduce max_completion_tokens"], "max_completion_tokens"),
    (CHAT, {"messages": MSGS, "max_tokens": 5000}, 400, ["reduce max_tokens"], "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "x" * 300}]}, 400,
     ["maximum context length is 256"], "messages"),
    (CHAT, {"messages": MSGS, "model": "other"}, 404, ["other"], "model"),
    ("/tokenize", {"prompt": "a", "messages": MSGS}, 400, ["exactly one of"], "messages"),
    ("/tokenize", {}, 400, ["exactly one of"], "prompt"),
    ("/tokenize", {"text": "a"}, 400, ["Unrecognized", "text"], "text"),
    ("/detokenize", {"tokens": [1, -4]}, 400, ["-4", "vocabulary"], "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, ["tokens"], "tokens"),
]


@pytest.mark.parametrize(
    "path, body, status, fragments, param", BAD_REQUESTS,
    ids=[f"{i}-{p.rsplit('/', 1)[-1]}" for i, (p, *_rest) in enumerate(BAD_REQUESTS)],
)
def test_bad_request(server, path, body, status, fragments, param):
    code, headers, raw = server.request("POST", path, body, headers=AUTH)
    assert headers["content-type"] == "application/json"
    err = assert_error(code, raw, status, *fragments)
    assert err["param"] == param
    expected_type = {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert err["type"] == expected_type


# Every route but /health, /version and /metrics, in an order that works with the right key
# (the profiler is started before it is stopped).
KEYED_ROUTES = [
    ("POST", CMPL, {"prompt": "hi", "max_tokens": 2}),
    ("POST", CHAT, {"messages": MSGS, "max_tokens": 2}),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/tiny", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [1, 2]}),
    ("POST", "/start_profile", None),
    ("POST", "/stop_profile", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
]


def test_api_key_required_on_every_route_but_probes(server):
    for method, path, body in KEYED_ROUTES:
        code, _, raw = server.request(method, path, body)
        assert_error(code, raw, 401, "missing API key")
        code, _, raw = server.request(method, path, body,
                                      headers={"Authorization": "Bearer nope"})
        err = assert_error(code, raw, 401, "invalid API key")
        assert err["type"] == "authentication_error"
        code, _, raw = server.request(method, path, body, headers={"Authorization": KEY})
        assert_error(code, raw, 401)  # the key without "Bearer "
        code, _, raw = server.request(method, path, body, headers=AUTH)
        assert code == 200, (path, raw)
    # Health, metrics and version stay open for probes and scrapers, whatever key is sent.
    for path in ("/health", "/metrics", "/version"):
        assert server.request("GET", path)[0] == 200
        assert server.request("GET", path, headers={"Authorization": "Bearer nope"})[0] == 200


def test_openai_client_sees_typed_errors(server):
    good = openai.OpenAI(base_url=f"{server.base}/v1", api_key=KEY, max_retries=0, timeout=30)
    bad = openai.OpenAI(base_url=f"{server.base}/v1", api_key="wrong", max_retries=0, timeout=30)
    try:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            good.completions.create(model="missing-model", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            good.chat.completions.create(model="tiny", messages=MSGS, temperature=-3)
        with pytest.raises(openai.BadRequestError, match="maximum context length"):
            good.completions.create(model="tiny", prompt="y" * 400, max_tokens=2)
        assert good.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    finally:
        good.close()
        bad.close()


def test_body_size_limit(server):
    big = {"prompt": "a" * (LIMIT + 10)}
    code, _, raw = server.request("POST", CMPL, big, headers=AUTH)
    assert_error(code, raw, 413, str(LIMIT), "--max-request-body-bytes")
    # Without Content-Length (chunked): cut off while reading, not buffered whole.
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        payload = json.dumps(big).encode()
        chunks = (payload[i : i + 8192] for i in range(0, len(payload), 8192))
        conn.request("POST", CMPL, body=chunks, headers={**AUTH, "Content-Type": "application/json"},
                     encode_chunked=True)
        resp = conn.getresponse()
        assert_error(resp.status, resp.read(), 413, str(LIMIT))
    finally:
        conn.close()


def test_unknown_route_and_method(server):
    code, _, raw = server.request("GET", "/v2/nothing", headers=AUTH)
    assert_error(code, raw, 404, "/v2/nothing")
    code, _, raw = server.request("GET", "/v2/nothing")  # no key: refused before routing
    assert_error(code, raw, 401, "missing API key")
    code, _, raw = server.request("GET", CMPL, headers=AUTH)
    assert_error(code, raw, 405, "GET")


def test_server_survives_200_bad_requests(server):
    cycle = itertools.cycle(BAD_REQUESTS)
    for _ in range(200):
        path, body, status, _fragments, _param = next(cycle)
        code, _, raw = server.request("POST", path, body, headers=AUTH)
        assert code == status
        assert json.loads(raw)["error"]["code"] == status
    code, body = server.json("POST", CMPL, {"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                             headers=AUTH)
    assert code == 200 and body["usage"]["completion_tokens"] == 3
    assert server.request("GET", "/health")[0] == 200
    assert server.proc.poll() is None
    assert "Traceback" not in server.log()


def _worker_children(pid: int) -> list[int]:
    """Spawned worker processes under ``pid`` (multiprocessing's spawn_main children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmdline:
                found.append(int(child))
    return found


def test_a_killed_worker_process_turns_health_503_and_fails_requests(tiny_llama_dir, tmp_path):
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--distributed-executor-backend", "mp"]
    with run_server(args, tmp_path) as s:
        model = s.json("GET", "/v1/models")[1]["data"][0]["id"]
        (worker,) = _worker_children(s.proc.pid)
        os.kill(worker, signal.SIGKILL)
        assert wait_until(lambda: s.request("GET", "/health")[0] == 503, timeout=30)
        status, body = s.json("POST", "/v1/completions",
                              {"model": model, "prompt": "hi", "max_tokens": 2})
        assert status == 503 and "restart" in body["error"]["message"]
        # The worker's failure reaches clients as an error id, its details only the log.
        _, _, health = s.request("GET", "/health")
        for raw in (json.dumps(body), health.decode()):
            for leak in ("Traceback", 'File "', ".py", "/src/ingot"):
                assert leak not in raw, raw
        error_id = re.search(r"error id ([0-9a-f]{16})", body["error"]["message"]).group(1)
        assert error_id in health.decode()
        assert wait_until(lambda: f"engine failure {error_id}" in s.log())


def test_long_prompt_gets_ingot_error_without_tokenizer_warning(server):
    # 300 tokens: past the tokenizer's model_max_length (128) and max_model_len (256).
    code, _, raw = server.request("POST", CMPL, {"prompt": "x" * 300}, headers=AUTH)
    assert_error(code, raw, 400, "maximum context length is 256")
    code, _, _ = server.request("POST", "/tokenize", {"prompt": "y" * 300}, headers=AUTH)
    assert code == 200
    assert "Token indices sequence length" not in server.log()
