"""``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, the ChatML
family's form (Hermes, Qwen2.5, ingot's chatml_tools template). Content is the text before the
first call; several calls follow one another."""

from __future__ import annotations

from ingot.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    ParseResult,
    ScannedCall,
    ToolParser,
    finalize_calls,
    held_back,
    scan_call_object,
    skip_ws,
    streamable,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParseResult:
        first = text.find(START)
        if first < 0:
            if final:
                return ParseResult(text)
            # Not yet sent: what may become the start tag, and trailing whitespace (it is
            # dropped if a call follows).
            keep = text[: len(text) - held_back(text, START)]
            return ParseResult(keep.rstrip())
        scanned: list[ScannedCall] = []
        i = first
        while i >= 0:
            j = skip_ws(text, i + len(START))
            if j >= len(text):
                break
            if text[j] != "{":
                scanned.append(ScannedCall(ParsedToolCall(None, ""), None, valid=False))
                break
            s = scan_call_object(text, j)
            scanned.append(s)
            if s.end is None:
                break
            i = text.find(START, s.end)
        content = text[:first].rstrip()
        if not final:
            return ParseResult(content, streamable(scanned))
        calls = finalize_calls(scanned)
        # No call parses: the text was content after all (as vLLM answers).
        return ParseResult(content, calls) if calls else ParseResult(text)

