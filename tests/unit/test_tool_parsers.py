"""Tool-call and reasoning parsers: whole responses, and streams split at every character
boundary whose deltas must concatenate to the whole response."""

from __future__ import annotations

import json

import pytest

import ingot.entrypoints.openai.tool_parsers.hermes as hermes_module
from ingot.entrypoints.openai.chat_output import ChatOutputParser, finish_reason
from ingot.entrypoints.openai.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)
from ingot.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    get_tool_parser,
    load_tool_parser_plugin,
)
from ingot.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from ingot.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ingot.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from ingot.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\\"is",'
    ' "days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
)


def stream(make, text, chunks):
    """Feed ``text`` cut at ``chunks`` (cumulative, as the engine's outputs are); returns the
    concatenated content and reasoning, the calls rebuilt from deltas, the name deltas."""
    parser = make()
    content, reasoning, calls, names = "", "", {}, []
    cuts = [*chunks, len(text)]
    for i, cut in enumerate(cuts):
        d = parser.update(text[:cut], final=i == len(cuts) - 1)
        content += d.content
        reasoning += d.reasoning
        for tc in d.tool_calls:
            call = calls.setdefault(tc["index"], {"name": None, "arguments": "", "id": None})
            fn = tc.get("function", {})
            if "name" in fn:
                assert call["name"] is None, "name sent twice"
                assert tc["id"] and tc["type"] == "function"
                call["name"], call["id"] = fn["name"], tc["id"]
                names.append(fn["name"])
            else:
                assert call["name"] is not None, "arguments before the name"
            call["arguments"] += fn.get("arguments", "")
    return content, reasoning, [calls[i] for i in sorted(calls)], names, parser.called_tools


def stream_problems(make, text):
    """Every split (character by character, and in two at each boundary) against the whole
    response; returns what differs (empty when the parser streams correctly)."""
    whole = make().message(text)
    want_calls = [(c["function"]["name"], c["function"]["arguments"])
                  for c in whole.get("tool_calls", [])]
    want_content = whole["content"] or ""
    problems = []
    splits = [list(range(1, len(text)))] + [[k] for k in range(1, len(text))]
    for chunks in splits:
        content, reasoning, calls, names, called = stream(make, text, chunks)
        got = [(c["name"], c["arguments"]) for c in calls]
        if (content, got, reasoning) != (want_content, want_calls, whole.get("reasoning") or ""):
            problems.append((chunks[:3], content, got, reasoning))
        if len(names) != len(want_calls) or called != bool(want_calls):
            problems.append((chunks[:3], "names", names))
    return problems


def tool_parser(cls, reasoning=None):
    return lambda: ChatOutputParser(reasoning() if reasoning else None, cls())


def test_hermes_whole_response():
    msg = ChatOutputParser(None, HermesToolParser()).message(HERMES)
    assert msg["content"] == "Let me check."
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": 'Par"is', "days": [1, 2]}
    assert calls[1]["function"]["arguments"] == "{}"
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"


@pytest.mark.parametrize("text", [
    HERMES,
    '<tool_call>{"name": "ping"}</tool_call>',  # parameterless, no arguments key: "{}"
    '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>',  # arguments first
    "No tools needed <tool here, just text.",
    "Broken <tool_call>{not json}</tool_call>",  # no call parses: it is all content
])
def test_hermes_streams_equal_the_whole_response(text):
    assert stream_problems(tool_parser(HermesToolParser), text) == []


def test_parameterless_tool_streams_braces():
    _, _, calls, names, _ = stream(tool_parser(HermesToolParser),
                                   '<tool_call>{"name": "ping"}</tool_call>', [5, 12, 20])
    assert names == ["ping"] and calls[0]["arguments"] == "{}"


def test_broken_holdback_is_caught(monkeypatch):
    """The stream check can fail: without holding back a possible start tag, "<tool_" leaks
    into the streamed content."""
    monkeypatch.setattr(hermes_module, "held_back", lambda text, tag: 0)
    assert stream_problems(tool_parser(HermesToolParser), HERMES)


@pytest.mark.parametrize("cls,text,calls,content", [
    (Llama3JsonToolParser,
     '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     [("f", '{"a": 1}'), ("g", "{}")], None),
    (Llama3JsonToolParser, "Just an answer.", [], "Just an answer."),
    (PythonicToolParser, '[get_weather(city="Paris", days=2), ping()]',
     [("get_weather", '{"city": "Paris", "days": 2}'), ("ping", "{}")], None),
    (PythonicToolParser, "[not a call", [], "[not a call"),
    (RequiredToolParser, '[{"name": "f", "parameters": {"q": "x"}}, {"name": "g", "parameters": {}}]',
     [("f", '{"q": "x"}'), ("g", "{}")], None),
])
def test_other_parsers(cls, text, calls, content):
    msg = ChatOutputParser(None, cls()).message(text)
    got = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])]
    assert got == calls and msg["content"] == content
    assert stream_problems(tool_parser(cls), text) == []


def test_named_tool_parser():
    text = ' {"city": "Paris"}\n'
    msg = ChatOutputParser(None, NamedToolParser("get_weather")).message(text)
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert stream_problems(lambda: ChatOutputParser(None, NamedToolParser("get_weather")), text) == []


@pytest.mark.parametrize("cls,text,reasoning,content", [
    (DeepSeekR1ReasoningParser, "I should add.\n</think>\n\nThe answer is 4.", "I should add.\n",
     "The answer is 4."),
    (DeepSeekR1ReasoningParser, "<think>hmm</think>ok", "hmm", "ok"),
    (DeepSeekR1ReasoningParser, "still thinking", "still thinking", ""),
    (Qwen3ReasoningParser, "<think>\nplan\n</think>\n\nDone.", "\nplan\n", "Done."),
    (Qwen3ReasoningParser, "No thinking here.", None, "No thinking here."),
])
def test_reasoning_parsers(cls, text, reasoning, content):
    make = lambda: ChatOutputParser(cls(), None)  # noqa: E731
    msg = make().message(text)
    assert msg["reasoning"] == reasoning and msg["content"] == content
    assert stream_problems(make, text) == []


def test_reasoning_then_tool_calls():
    text = "<think>call it</think>\n" + HERMES
    make = tool_parser(HermesToolParser, Qwen3ReasoningParser)
    msg = make().message(text)
    assert msg["reasoning"] == "call it" and msg["content"] == "Let me check."
    assert len(msg["tool_calls"]) == 2
    assert stream_problems(make, text) == []


def test_plugin_registers_a_parser(tmp_path):
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from ingot.entrypoints.openai.tool_parsers import register_tool_parser\n"
        "from ingot.entrypoints.openai.tool_parsers.base import ParsedToolCall, ParseResult, ToolParser\n"
        "@register_tool_parser('shout')\n"
        "class Shout(ToolParser):\n"
        "    def parse(self, text, final):\n"
        "        if text.startswith('CALL '):\n"
        "            return ParseResult('', [ParsedToolCall(text[5:].strip() or None, '{}', final)])\n"
        "        return ParseResult(text)\n"
    )
    try:
        load_tool_parser_plugin(str(plugin))
        msg = ChatOutputParser(None, get_tool_parser("shout")()).message("CALL ping")
        assert msg["tool_calls"][0]["function"]["name"] == "ping"
    finally:
        TOOL_PARSERS.pop("shout", None)
    with pytest.raises(ValueError, match="not known"):
        get_tool_parser("shout")
    with pytest.raises(ValueError, match="is not a file"):
        load_tool_parser_plugin(str(tmp_path / "missing.py"))
