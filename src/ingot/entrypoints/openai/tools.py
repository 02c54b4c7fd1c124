"""The request side of tool calling: validating ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, and the JSON schema that enforces ``required`` and named choices.

``auto`` leaves the model free and parses its text with the server's ``--tool-call-parser``;
``required`` constrains the output to a JSON array of calls of the given tools, a named choice
to that function's arguments, so their arguments always validate against the tools' schemas.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ingot.entrypoints.openai.protocol import RequestValueError
from ingot.entrypoints.openai.tool_parsers.base import ToolParser
from ingot.entrypoints.openai.tool_parsers.forced import NamedToolParser, RequiredToolParser
from ingot.sampling_params import StructuredOutputsParams

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names


@dataclass
class ToolRequest:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # as the chat template sees them
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def render_tools(self) -> bool:
        """Tool definitions go into the prompt unless tool_choice is none."""
        return bool(self.tools) and self.mode != "none"

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        if self.mode == "named":
            return StructuredOutputsParams(json=_parameters(self._function(self.function)))
        return None

    def parser(self, auto_parser: type[ToolParser] | None, tokenizer: Any) -> ToolParser | None:
        if self.mode == "required":
            return RequiredToolParser()
        if self.mode == "named":
            assert self.function is not None
            return NamedToolParser(self.function)
        if self.mode == "auto" and auto_parser is not None:
            return auto_parser(tokenizer)
        return None

    def _function(self, name: str | None) -> dict[str, Any]:
        return next(t["function"] for t in self.tools if t["function"]["name"] == name)


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if params else {"type": "object", "properties": {}}


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A JSON array of one or more calls (one at most without parallel tool calls), each
    ``{"name": <a tool's name>, "parameters": <that tool's arguments>}`` (vLLM's form)."""
    branches = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"]["name"]]},
                "parameters": _parameters(t["function"]),
            },
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_tool_request(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
    auto_enabled: bool,
) -> ToolRequest:
    if tools is not None:
        if not tools:
            raise RequestValueError("tools is empty; give at least one tool or leave it out",
                                    "tools")
        for i, tool in enumerate(tools):
            _check_tool(i, tool)
        # Counted in one pass: names.count per name was quadratic (60k tools took minutes).
        counts = Counter(t["function"]["name"] for t in tools)
        dup = sorted(n for n, c in counts.items() if c > 1)
        if dup:
            raise RequestValueError(f"tools: duplicate function name(s) {dup}", "tools")
    tools = tools or []
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice in ("none", "auto", "required"):
        mode, function = tool_choice, None
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)
          and isinstance(tool_choice["function"].get("name"), str)):
        mode, function = "named", tool_choice["function"]["name"]
    else:
        raise RequestValueError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", '
            f'"function": {{"name": ...}}}}, got {tool_choice!r}', "tool_choice",
        )
    if mode != "none" and not tools:
        raise RequestValueError(f"tool_choice {mode!r} needs tools", "tool_choice")
    if mode == "named" and not any(t["function"]["name"] == function for t in tools):
        raise RequestValueError(f"tool_choice names function {function!r}, which is not in tools",
                                "tool_choice")
    if mode == "auto" and not auto_enabled:
        raise RequestValueError(
            '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
            '--tool-call-parser; or send tool_choice "required", "none" or a named function',
            "tool_choice",
        )
    return ToolRequest(mode, tools, function, parallel is not False)


def _check_tool(i: int, tool: Any) -> None:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise RequestValueError(f'{where} must be {{"type": "function", "function": {{...}}}}',
                                where)
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestValueError(f"{where}.function needs a name", f"{where}.function")
    if not _NAME.match(function["name"]):
        raise RequestValueError(
            f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-', got "
            f"{function['name']!r}", f"{where}.function.name",
        )
    params = function.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise RequestValueError(f"{where}.function.parameters must be a JSON schema object",
                                f"{where}.function.parameters")
