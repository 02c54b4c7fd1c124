"""``llama3_json``: Llama 3.x's JSON tool calls, ``{"name": ..., "parameters": {...}}`` (or
``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``. A response
that does not start with one is plain content."""

from __future__ import annotations

from ingot.entrypoints.openai.tool_parsers.base import (
    ParseResult,
    ScannedCall,
    ToolParser,
    finalize_calls,
    held_back,
    scan_call_object,
    skip_ws,
    streamable,
)

BOT = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParseResult:
        start = skip_ws(text, 0)
        if text.startswith(BOT, start):
            start = skip_ws(text, start + len(BOT))
        elif not final and BOT.startswith(text[start:]):
            return ParseResult("")  # may still be the tag
        if start >= len(text):
            return ParseResult(text if final else "")
        if text[start] != "{":
            if final:
                return ParseResult(text)
            keep = text[: len(text) - held_back(text, BOT)]
            return ParseResult(keep)
        scanned: list[ScannedCall] = []
        i = start
        while i < len(text) and text[i] == "{":
            s = scan_call_object(text, i)
            scanned.append(s)
            if s.end is None:
                break
            i = skip_ws(text, s.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
        if not final:
            return ParseResult("", streamable(scanned))
        calls = finalize_calls(scanned)
        return ParseResult("", calls) if calls else ParseResult(text)
