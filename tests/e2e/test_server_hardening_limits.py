"""Issue #31, the HTTP front door: request-supplied chat templates (item 2), unbounded request
shapes and the waiting queue (item 5), leaks in responses (item 9) and the admin routes (item
4, in part), against real `ingot serve` subprocesses on the tiny model.

Each attack gets its error within 10 s while /health answers within 2 s throughout, and the
server gives the same greedy answer afterwards with nothing left running; each limit is shown
refusing one past it and accepting one at it. ``server`` runs with small limits (and trusts
request templates, so the render limits themselves are exercised); ``default_server`` with
every default."""

from __future__ import annotations

import http.client
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from server_utils import (
    TINY_FLAGS,
    HealthWatch,
    assert_client_error,
    assert_recovered,
    greedy_answer,
    metric,
    run_server,
    wait_until,
)

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
MSGS = [{"role": "user", "content": "hi"}]
TIMEOUT_S = 2  # --chat-template-timeout-s of `server`
OUTPUT_CHARS = 200  # --max-chat-template-output-chars
LIMITS = ["--trust-request-chat-template", "--chat-template-timeout-s", str(TIMEOUT_S),
          "--max-chat-template-output-chars", str(OUTPUT_CHARS),
          "--max-sequences-per-request", "8", "--max-chat-messages", "8",
          "--max-tools-per-request", "4", "--max-stop-strings", "4",
          "--max-stop-string-length", "8", "--max-json-depth", "16",
          "--max-waiting-requests", "4"]
NESTED_LOOP = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
               "{% endfor %}")


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    """Small limits, one running sequence at a time, every step 20 ms (so a queue can be
    built), profiling and admin routes on; "boom" prompts fail inside the server
    (hardening_cli.py)."""
    launcher = [sys.executable, str(Path(__file__).with_name("hardening_cli.py"))]
    env = {**os.environ, "INGOT_TEST_STEP_DELAY": "0.02"}
    traces = tmp_path_factory.mktemp("traces")
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--max-num-seqs", "1", *LIMITS,
            "--profiler-dir", str(traces), "--enable-admin-routes"]
    with run_server(args, tmp_path_factory.mktemp("logs"), launcher=launcher, env=env,
                    log_level="info") as s:
        s.baseline = greedy_answer(s)
        s.traces = traces
        yield s


@pytest.fixture(scope="module")
def default_server(tiny_llama_dir, tmp_path_factory):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_TORCH_PROFILER_DIR"}
    with run_server([str(tiny_llama_dir), *TINY_FLAGS], tmp_path_factory.mktemp("logs"),
                    env=env) as s:
        s.baseline = greedy_answer(s)
        yield s


def attack(server: Any, path: str, body: Any, *fragments: str,
           headers: dict[str, str] | None = None) -> dict:
    """The issue's bar: a 4xx OpenAI error that leaks nothing, within 10 s, /health within
    2 s throughout, then the same greedy answer and nothing running."""
    with HealthWatch(server) as watch:
        start = time.monotonic()
        status, _, raw = server.request("POST", path, body, headers=headers, timeout=30)
        elapsed = time.monotonic() - start
        time.sleep(0.3)  # a poll or two after the answer too
    err = assert_client_error(status, raw, *fragments)
    assert elapsed < 10, f"the attack took {elapsed:.1f}s"
    watch.assert_healthy()
    assert_recovered(server, server.baseline)
    return err


def chat(server: Any, **fields: Any) -> tuple[int, Any]:
    return server.json("POST", CHAT, {"messages": MSGS, "max_tokens": 2, **fields})


# ---- item 2: chat templates ---------------------------------------------------------------


def test_request_chat_template_refused_without_the_flag(default_server):
    err = attack(default_server, CHAT, {"messages": MSGS, "chat_template": "{{ 'x' }}"},
                 "--trust-request-chat-template")
    assert err["param"] == "chat_template"
    assert chat(default_server)[0] == 200  # the model's own template still renders


@pytest.mark.slow
def test_template_loop_is_stopped_at_the_time_limit(server):
    err = attack(server, CHAT, {"messages": MSGS, "chat_template": NESTED_LOOP},
                 f"limit of {TIMEOUT_S} s", "--chat-template-timeout-s")
    assert err["param"] == "chat_template"
    # The killed render process is replaced: chats render again (the model's template and a
    # request's).
    assert chat(server)[0] == 200
    status, body = chat(server, chat_template="{{ messages[0]['content'] }}")
    assert status == 200 and body["usage"]["prompt_tokens"] == 2


def test_template_memory_bomb_is_refused(server):
    err = attack(server, CHAT, {"messages": MSGS, "chat_template": "{{ 'x' * 10**10 }}"},
                 "memory")
    assert err["param"] == "chat_template"


def test_template_output_limit(server):
    # At the limit: 200 characters (200 byte tokens) pass and generate.
    status, body = chat(server, chat_template=f"{{{{ 'a' * {OUTPUT_CHARS} }}}}")
    assert status == 200 and body["usage"]["prompt_tokens"] == OUTPUT_CHARS
    # One past it: refused, naming the limit and its flag.
    over = f"{{{{ 'a' * {OUTPUT_CHARS + 1} }}}}"
    attack(server, CHAT, {"messages": MSGS, "chat_template": over},
           f"rendered {OUTPUT_CHARS + 1} characters", f"limit of {OUTPUT_CHARS}",
           "--max-chat-template-output-chars")


def test_template_work_under_the_time_limit_passes(server):
    # A loop of the sandbox's largest range renders well inside the time limit.
    template = "{% for i in range(100000) %}{% endfor %}{{ messages[0]['content'] }}"
    assert chat(server, chat_template=template)[0] == 200


def test_template_errors_are_400s_naming_the_template(server):
    status, body = chat(server, chat_template="{% if %}")
    assert status == 400 and body["error"]["param"] == "chat_template"
    assert "the chat template failed" in body["error"]["message"]
    status, body = chat(server, chat_template="{{ raise_exception('roles must alternate') }}")
    assert status == 400 and "roles must alternate" in body["error"]["message"]


@pytest.mark.slow
def test_renderer_matches_apply_chat_template(tiny_llama_dir):
    """The render process gives what ``tokenizer.apply_chat_template`` gives (special tokens,
    tools, tool calls, None-valued keys dropped)."""
    import asyncio

    from transformers import AutoTokenizer

    from ingot.entrypoints.openai.chat_templates import ChatTemplateRenderer
    from ingot.entrypoints.openai.serving import tools_chat_template

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tools = [{"type": "function", "function": {"name": "get_weather",
                                                "parameters": {"type": "object"}}}]
    messages = [
        {"role": "system", "content": "be brief", "name": None},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "1", "content": "sunny"},
    ]
    bos = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}{% endfor %}"
    cases = [(None, None), (tools_chat_template(), tools), (bos, None)]
    renderer = ChatTemplateRenderer(timeout_s=60, max_chars=10**6, num_processes=1)

    async def render_all() -> list[str]:
        return [await renderer.render(tok.get_chat_template(t, tl), messages,
                                      add_generation_prompt=True, tools=tl,
                                      kwargs=dict(tok.special_tokens_map), param="messages")
                for t, tl in cases]

    try:
        rendered = asyncio.run(render_all())
    finally:
        renderer.close()
    expected = [tok.apply_chat_template(messages, chat_template=t, tools=tl, tokenize=False,
                                        add_generation_prompt=True) for t, tl in cases]
    assert rendered == expected
    assert rendered[2].startswith("<s>")


# ---- item 5: request shapes -----------------------------------------------------------------


def test_prompts_times_n(server):
    prompts = [[5, 6]] * 4
    status, body = server.json("POST", CMPL, {"prompt": prompts, "n": 2, "max_tokens": 1})
    assert status == 200 and len(body["choices"]) == 8  # at the limit (8)
    _, _, raw = server.request("POST", CMPL, {"prompt": prompts, "n": 3, "max_tokens": 1})
    err = assert_client_error(400, raw, "12", "limit of 8", "--max-sequences-per-request")
    assert err["param"] == "n"
    err = attack(server, CMPL, {"prompt": [[5]] * 20000, "n": 128, "max_tokens": 1},
                 "limit of 8")
    assert err["param"] == "prompt"


def test_tools_per_request(server):
    def tools(k: int) -> list[dict]:
        return [{"type": "function", "function": {"name": f"f{i}"}} for i in range(k)]

    assert chat(server, tools=tools(4), tool_choice="none")[0] == 200
    err = attack(server, CHAT, {"messages": MSGS, "tools": tools(5), "tool_choice": "none"},
                 "limit of 4", "--max-tools-per-request")
    assert err["param"] == "tools"
    attack(server, CHAT, {"messages": MSGS, "tools": tools(60000), "tool_choice": "none"},
           "limit of 4")


def test_duplicate_tool_names_found_in_one_pass():
    """60k tools with one name twice: named at once (the old check compared every pair)."""
    from ingot.entrypoints.openai.protocol import RequestValueError
    from ingot.entrypoints.openai.tools import parse_tool_request

    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(60000)]
    tools.append({"type": "function", "function": {"name": "f7"}})
    with pytest.raises(RequestValueError, match=r"duplicate function name\(s\) \['f7'\]"):
        parse_tool_request(tools, "none", None, False)


def test_stop_strings(server):
    ok = {"prompt": "hi", "max_tokens": 2}
    assert server.json("POST", CMPL, {**ok, "stop": ["abcdefgh"] * 4})[0] == 200
    assert server.json("POST", CMPL, {**ok, "stop": "abcdefgh"})[0] == 200
    err = attack(server, CMPL, {**ok, "stop": ["a"] * 5}, "limit of 4", "--max-stop-strings")
    assert err["param"] == "stop"
    attack(server, CMPL, {**ok, "stop": "abcdefghi"}, "limit of 8", "--max-stop-string-length")
    attack(server, CMPL, {**ok, "stop": ["x" * 50] * 100000}, "limit of 4")


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = [value]
    return value


def test_json_depth(server):
    # The body is level 1 and chat_template_kwargs level 2: 14 more lists reach 16.
    assert chat(server, chat_template_kwargs={"x": _nested(14)})[0] == 200
    err = attack(server, CHAT, {"messages": MSGS, "chat_template_kwargs": {"x": _nested(15)}},
                 "limit of 16", "--max-json-depth")
    assert err["param"] == "chat_template_kwargs"
    # Far deeper than Python's own stack: still a 400, not a 500.
    deep = b'{"prompt": "hi", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    attack(server, CMPL, deep, "--max-json-depth")


def test_messages_per_chat(server):
    assert chat(server, messages=MSGS * 8)[0] == 200
    err = attack(server, CHAT, {"messages": MSGS * 9}, "limit of 8", "--max-chat-messages")
    assert err["param"] == "messages"
    attack(server, CHAT, {"messages": [{"role": "user"}] * 200000}, "limit of 8")


def test_default_limits(default_server):
    """The defaults (docs/serving.md): at each limit passes, one past it is refused."""
    s = default_server
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert chat(s, tools=tools[:128], tool_choice="none")[0] == 200
    assert_client_error(*_post(s, CHAT, {"messages": MSGS, "tools": tools}), "limit of 128")
    stops = ["x" * 256] * 17
    assert s.json("POST", CMPL, {"prompt": "hi", "max_tokens": 2, "stop": stops[:16]})[0] == 200
    assert_client_error(*_post(s, CMPL, {"prompt": "hi", "stop": stops}), "limit of 16")
    assert_client_error(*_post(s, CMPL, {"prompt": "hi", "stop": "x" * 257}), "limit of 256")
    status, body = s.json("POST", "/tokenize", {"messages": MSGS * 2048})
    assert status == 200 and body["count"] > 2048
    assert_client_error(*_post(s, "/tokenize", {"messages": MSGS * 2049}), "limit of 2048")
    assert chat(s, chat_template_kwargs={"x": _nested(62)})[0] == 200
    assert_client_error(*_post(s, CHAT, {"messages": MSGS,
                                         "chat_template_kwargs": {"x": _nested(63)}}),
                        "limit of 64")
    assert_client_error(*_post(s, CMPL, {"prompt": [[5]] * 17, "n": 128}), "limit of 2048")


def _post(server: Any, path: str, body: Any) -> tuple[int, bytes]:
    status, _, raw = server.request("POST", path, body)
    return status, raw


def _stream_until_first_chunk(server: Any, body: dict) -> http.client.HTTPConnection:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", CMPL, body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")
    return conn


@pytest.mark.slow
def test_waiting_queue_limit(server):
    """One sequence runs (--max-num-seqs 1) and 4 may wait (--max-waiting-requests 4): with
    3 + 1 waiting the next request is a 503 with Retry-After; once the queue drains it runs."""
    def waiting() -> float:
        return metric(server.metrics(), "ingot:num_requests_waiting")

    results: list[int] = []

    def send(n: int) -> None:
        results.append(server.json("POST", CMPL, {"prompt": "hi", "n": n, "max_tokens": 1},
                                   timeout=120)[0])

    with HealthWatch(server) as watch:
        running = _stream_until_first_chunk(server, {"prompt": "long", "max_tokens": 200,
                                                     "ignore_eos": True})
        try:
            waiters = [threading.Thread(target=send, args=(3,))]
            waiters[0].start()
            assert wait_until(lambda: waiting() == 3)
            waiters.append(threading.Thread(target=send, args=(1,)))  # 3 + 1: at the limit
            waiters[1].start()
            assert wait_until(lambda: waiting() == 4)
            status, headers, raw = server.request("POST", CMPL, {"prompt": "hi",
                                                                 "max_tokens": 1})
            assert status == 503 and headers["retry-after"] == "1"
            err = json.loads(raw)["error"]
            assert err["type"] == "server_error" and err["code"] == 503
            assert "limit of 4" in err["message"] and "--max-waiting-requests" in err["message"]
        finally:
            running.close()  # the running stream's client leaves: its request is aborted
        for t in waiters:
            t.join(timeout=60)
    assert results == [200, 200]
    watch.assert_healthy()
    assert server.json("POST", CMPL, {"prompt": "hi", "max_tokens": 1})[0] == 200
    assert_recovered(server, server.baseline)


# ---- item 9: leaks ------------------------------------------------------------------------


def test_non_finite_numbers_are_refused(server):
    err = attack(server, CMPL, b'{"prompt": "hi", "repetition_penalty": 1e400}',
                 "repetition_penalty is 1e400", "finite")
    assert err["param"] == "repetition_penalty"
    body = (b'{"prompt": "hi", "structured_outputs": {"json": {"type": "number", '
            b'"maximum": -1e999}}}')
    err = attack(server, CMPL, body, "-1e999")
    assert err["param"] == "structured_outputs.json.maximum"
    # A finite value (1e-400 rounds to 0.0) is fine.
    status, _, _ = server.request("POST", CMPL, b'{"prompt": "hi", "max_tokens": 2, '
                                  b'"presence_penalty": 1e-400}')
    assert status == 200


def test_bodies_must_be_json(server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded",
                         "multipart/form-data; boundary=x"):
        err = attack(server, CMPL, {"prompt": "hi", "max_tokens": 2}, "application/json",
                     headers={"Content-Type": content_type})
        assert err["code"] == 415
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        status, _, _ = server.request("POST", CMPL, {"prompt": "hi", "max_tokens": 2},
                                      headers={"Content-Type": content_type})
        assert status == 200, content_type
    # The openai client's requests pass.
    client = openai.OpenAI(base_url=f"{server.base}/v1", api_key="x", max_retries=0)
    try:
        model = client.models.list().data[0].id
        assert client.completions.create(model=model, prompt="hi", max_tokens=2).choices
    finally:
        client.close()


def _no_leak(text: str) -> None:
    for leak in ("Traceback", 'File "', ".py", "/srv/secret", "/src/ingot"):
        assert leak not in text, f"the body leaks {leak!r}: {text[:500]}"


def test_internal_errors_carry_an_id_not_the_exception(server):
    status, _, raw = server.request("POST", CMPL, {"prompt": "boom"})
    assert status == 500
    _no_leak(raw.decode())
    err = json.loads(raw)["error"]
    error_id = re.search(r"error id ([0-9a-f]{16})", err["message"]).group(1)
    # The server log has the traceback under the id.
    assert wait_until(lambda: error_id in server.log())
    logged = server.log()[server.log().index(error_id):]
    assert "Traceback" in logged and "/srv/secret/ingot_internal.py" in logged
    # A failure inside a stream: an error event with an id, then [DONE].
    status, _, raw = server.request("POST", CMPL, {"prompt": "boom-stream", "stream": True,
                                                   "max_tokens": 4})
    assert status == 200
    _no_leak(raw.decode())
    events = [ln[6:] for ln in raw.decode().splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and re.search(r"error id [0-9a-f]{16}", err["message"])
    assert_recovered(server, server.baseline)


# ---- item 4 (part): admin routes ------------------------------------------------------------


def _bare_post(server: Any, path: str) -> tuple[int, bytes]:
    """``curl -X POST URL``: no body, no Content-Type."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_admin_and_profiling_routes_are_off_by_default(default_server):
    for path, flag in (("/start_profile", "--profiler-dir"), ("/stop_profile", "--profiler-dir"),
                       ("/reset_prefix_cache", "--enable-admin-routes")):
        status, raw = _bare_post(default_server, path)
        err = assert_client_error(status, raw, flag)
        assert status == 404 and err["type"] == "not_found_error"


def test_admin_and_profiling_routes_when_enabled(server):
    """--profiler-dir turns profiling on; /stop_profile names the trace relative to that
    directory (no server path). --enable-admin-routes serves /reset_prefix_cache."""
    assert _bare_post(server, "/start_profile")[0] == 200
    assert server.json("POST", CMPL, {"prompt": "hi", "max_tokens": 2})[0] == 200
    status, raw = _bare_post(server, "/stop_profile")
    body = json.loads(raw)
    assert status == 200 and not body["trace"].startswith("/")
    assert str(server.traces) not in raw.decode()
    assert (server.traces / body["trace"]).is_file()
    assert _bare_post(server, "/reset_prefix_cache") == (200, b'{"status":"reset"}')


def test_profiler_dir_sources(tiny_llama_dir, monkeypatch):
    """--profiler-dir, $VLLM_TORCH_PROFILER_DIR and --additional-config set one field:
    additional_config.profiler.output_dir (the explicit config wins over the environment;
    a flag that disagrees with it is an error)."""
    from ingot.engine.arg_utils import EngineArgs

    def output_dir(**kw: Any) -> str | None:
        profiler = EngineArgs(model=str(tiny_llama_dir), **kw).create_engine_config() \
            .additional_config.get("profiler")
        return None if profiler is None else profiler["output_dir"]

    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    assert output_dir() is None
    assert output_dir(profiler_dir="/tmp/a") == "/tmp/a"
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/tmp/env")
    assert output_dir() == "/tmp/env"
    assert output_dir(profiler_dir="/tmp/a") == "/tmp/a"
    config = {"profiler": {"output_dir": "/tmp/cfg", "max_iterations": 3}}
    assert output_dir(additional_config=config) == "/tmp/cfg"
    assert output_dir(additional_config={"profiler": {"max_iterations": 3}}) == "/tmp/env"
    with pytest.raises(ValueError, match="--profiler-dir '/tmp/a' and additional_config"):
        output_dir(profiler_dir="/tmp/a", additional_config=config)
