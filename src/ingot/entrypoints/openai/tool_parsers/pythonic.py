"""``pythonic``: a Python list of calls, ``[get_weather(city="Paris"), ping()]`` (Llama 3.2 /
4's form). Keyword arguments must be literals; they become a JSON object. A call's arguments
are known only once the list closes, so each call streams as its name, then one fragment."""

from __future__ import annotations

import ast
import json

from ingot.entrypoints.openai.tool_parsers.base import ParsedToolCall, ParseResult, ToolParser


def _calls(source: str) -> list[ParsedToolCall] | None:
    try:
        tree = ast.parse(source.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        try:
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        except ValueError:
            return None
        calls.append(ParsedToolCall(name, json.dumps(kwargs, ensure_ascii=False), True))
    return calls


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> ParseResult:
        stripped = text.lstrip()
        if not stripped:
            return ParseResult(text if final else "")
        if not stripped.startswith("["):
            return ParseResult(text)
        calls = _calls(stripped) if stripped.rstrip().endswith("]") else None
        if calls:
            return ParseResult("", calls)
        return ParseResult(text if final else "")
