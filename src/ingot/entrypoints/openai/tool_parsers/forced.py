"""The outputs of ``tool_choice: "required"`` and a named ``tool_choice``, which a JSON schema
built from the tools constrains (``schema.py``), so they parse without a model-specific
parser: a JSON array ``[{"name": ..., "parameters": {...}}, ...]`` for required, the
arguments object itself for a named function."""

from __future__ import annotations

from ingot.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    ScannedCall,
    ToolParser,
    finalize_calls,
    scan_call_object,
    skip_ws,
    streamable,
)


class RequiredToolParser(ToolParser):
    name = "required"

    def parse(self, text: str, final: bool) -> ParseResult:
        i = skip_ws(text, 0)
        if i >= len(text) or text[i] != "[":
            return ParseResult(text if final else "")
        scanned: list[ScannedCall] = []
        i = skip_ws(text, i + 1)
        while i < len(text) and text[i] == "{":
            s = scan_call_object(text, i)
            scanned.append(s)
            if s.end is None:
                break
            i = skip_ws(text, s.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
        return ParseResult("", finalize_calls(scanned) if final else streamable(scanned))


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str) -> None:
        super().__init__()
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParseResult:
        # Surrounding whitespace is not part of the arguments (held back while streaming).
        call = ParsedToolCall(self.function_name, text.strip(), final)
        return ParseResult("", [call])
