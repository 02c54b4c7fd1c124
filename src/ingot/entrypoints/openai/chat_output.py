"""One chat choice's text as OpenAI message parts: reasoning (``--reasoning-parser``), then
content and tool calls (the request's tool parser) in what follows the reasoning.

``update`` is called with the growing text of a streamed choice and returns only what is new;
``message`` parses a whole response. Both run the same parsers on the same text, so a stream's
deltas concatenate to the whole response."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ingot.entrypoints.openai.reasoning_parsers import ReasoningParser
from ingot.entrypoints.openai.tool_parsers.base import (
    ToolCallStreamer,
    ToolParser,
    whole_tool_calls,
)


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._streamer = ToolCallStreamer(tools) if tools is not None else None
        self._reasoning_sent = 0
        self._content_sent = 0

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.reasoning is None:
            return "", text
        return self.reasoning.parse(text, final)

    def update(self, text: str, final: bool) -> ChatDelta:
        reasoning, content = self._split(text, final)
        delta = ChatDelta(reasoning=reasoning[self._reasoning_sent :])
        self._reasoning_sent = max(self._reasoning_sent, len(reasoning))
        if self._streamer is None:
            delta.content = content[self._content_sent :]
            self._content_sent = max(self._content_sent, len(content))
        else:
            delta.content, delta.tool_calls = self._streamer.update(content, final)
        return delta

    @property
    def called_tools(self) -> bool:
        return self._streamer is not None and self._streamer.called

    def message(self, text: str) -> dict[str, Any]:
        """The whole ``message`` of a finished choice."""
        reasoning, content = self._split(text, True)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.tools is not None:
            result = self.tools.parse(content, True)
            if result.calls:
                message["content"] = result.content or None
                message["tool_calls"] = whole_tool_calls(result.calls)
        if self.reasoning is not None:
            message["reasoning"] = reasoning or None
        return message


def finish_reason(engine_reason: str | None, called_tools: bool) -> str | None:
    """OpenAI's finish_reason: a response that called tools and stopped ends in tool_calls."""
    if called_tools and engine_reason == "stop":
        return "tool_calls"
    return engine_reason
