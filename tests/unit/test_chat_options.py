"""`ingot serve` chat flags: --chat-template, --enable-auto-tool-choice, --tool-call-parser,
--tool-parser-plugin, --reasoning-parser, resolved (or refused) before any model loads."""

from __future__ import annotations

import pytest

from ingot.cli.main import build_parser, chat_options_from
from ingot.entrypoints.openai.reasoning_parsers import DeepSeekR1ReasoningParser
from ingot.entrypoints.openai.serving import tools_chat_template
from ingot.entrypoints.openai.tool_parsers.hermes import HermesToolParser


def options(*flags):
    return chat_options_from(build_parser().parse_args(["serve", *flags]))


def test_defaults_and_resolution(tmp_path):
    default = options()
    assert default.tool_parser is None and not default.enable_auto_tool_choice
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    opts = options("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                   "--reasoning-parser", "deepseek_r1", "--chat-template", str(template))
    assert opts.tool_parser is HermesToolParser
    assert opts.reasoning_parser is DeepSeekR1ReasoningParser
    assert opts.chat_template == "{{ messages[0]['content'] }}"


@pytest.mark.parametrize("flags,message", [
    (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
    (["--tool-call-parser", "nope"], "'nope' is not known"),
    (["--reasoning-parser", "nope"], "'nope' is not known"),
    (["--chat-template", "/no/such/file"], "is not a file"),
    (["--tool-parser-plugin", "/no/such/plugin.py"], "is not a file"),
])
def test_bad_flags(flags, message):
    with pytest.raises(ValueError, match=message):
        options(*flags)


def test_shipped_tools_template_renders_tools_calls_and_results():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda v: __import__("json").dumps(v)
    text = env.from_string(tools_chat_template()).render(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "1", "content": "sunny"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather"}}],
        add_generation_prompt=True,
    )
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"}}\n</tools>' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
