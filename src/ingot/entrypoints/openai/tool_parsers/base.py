"""What every tool-call parser shares: the parse result, a JSON scanner for partial text, and
the streamer that turns successive parses into OpenAI deltas.

A parser is one pure function of the text so far, ``parse(text, final)``, that returns the
content and the calls it can already vouch for. A streaming response calls it on the growing
text and sends only what is new; a whole response calls it once with ``final=True``. So the
streamed deltas concatenate to the whole response as long as each parse's content and each
call's arguments extend the previous parse's (every parser keeps that promise by holding back
text that could still turn out to be a tag, and by quoting arguments as raw text slices).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ParsedToolCall:
    name: str | None  # None until the name is complete
    arguments: str  # the raw argument text so far; grows by appending only
    complete: bool = False


@dataclass
class ParseResult:
    content: str  # text that is certainly content (grows by appending only)
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser:
    """Base class of ``--tool-call-parser`` parsers (and ``--tool-parser-plugin`` ones)."""

    name = "base"

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def parse(self, text: str, final: bool) -> ParseResult:  # pragma: no cover - abstract
        raise NotImplementedError


def held_back(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag`` (text that
    may still become the tag, so must not be sent as content yet)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_WS = " \t\r\n"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def scan_json_value(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at ``text[i]``, or None if the text ends
    first. Tracks strings and escapes; does not validate (json.loads does, at the end)."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    # number, true, false, null: ends at the first character that cannot continue it
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


@dataclass
class ScannedCall:
    call: ParsedToolCall
    end: int | None  # end of the object (exclusive) once complete
    valid: bool = True  # False: malformed (dropped from the final result)


def scan_call_object(
    text: str, i: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")
) -> ScannedCall:
    """Read ``{"name": ..., "arguments": {...}}`` from ``text[i] == "{"``, as far as the text
    goes. The arguments are the raw slice of their value (a call without them gets ``{}``);
    they stream only once the name is known, so arguments written before the name wait for
    the end of the object."""
    name: str | None = None
    args: str | None = None
    args_first = False
    complete = False
    valid = True
    end = None
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            break
        if text[j] == "}":
            complete, end = True, j + 1
            break
        key_end = scan_json_value(text, j) if text[j] == '"' else -1
        if key_end is None:
            break
        if key_end < 0:
            valid = False
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            valid = False
            break
        j = skip_ws(text, j + 1)
        value_end = scan_json_value(text, j)
        if key in arg_keys and args is None:
            args = text[j:value_end] if value_end is not None else text[j:].rstrip(_WS)
            args_first = name is None
        if value_end is None:
            break
        if key == "name":
            try:
                value = json.loads(text[j:value_end])
            except ValueError:
                value = None
            if not isinstance(value, str):
                valid = False
                break
            name = value
        j = skip_ws(text, value_end)
        if j < len(text) and text[j] == ",":
            j += 1
        elif j < len(text) and text[j] != "}":
            valid = False
            break
    if complete and name is None:
        valid = False
    if complete:
        arguments = "{}" if args is None else args
    else:
        arguments = "" if args is None or args_first else args
    return ScannedCall(ParsedToolCall(name, arguments, complete and valid), end, valid)


def streamable(scanned: list[ScannedCall]) -> list[ParsedToolCall]:
    """The calls a partial parse reports: those before the first malformed one."""
    out = []
    for s in scanned:
        if not s.valid:
            break
        out.append(s.call)
    return out


def finalize_calls(scanned: list[ScannedCall]) -> list[ParsedToolCall]:
    """The calls a final parse keeps: complete, named, with arguments that are valid JSON."""
    out = []
    for s in scanned:
        if not (s.valid and s.call.complete and s.call.name):
            continue
        try:
            json.loads(s.call.arguments)
        except ValueError:
            continue
        out.append(s.call)
    return out


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class _SentCall:
    id: str
    args_sent: int = 0


class ToolCallStreamer:
    """Turns successive parses of one choice's growing text into OpenAI deltas: content
    fragments, then per call the name once with its id, then argument fragments."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.content_sent = 0
        self.sent: list[_SentCall] = []

    def update(self, text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        result = self.parser.parse(text, final)
        content = result.content[self.content_sent :]
        self.content_sent = max(self.content_sent, len(result.content))
        deltas: list[dict[str, Any]] = []
        for index, call in enumerate(result.calls):
            if index >= len(self.sent):
                if call.name is None:
                    break  # calls are sent in order, each once its name is known
                self.sent.append(_SentCall(make_tool_call_id()))
                deltas.append({
                    "index": index, "id": self.sent[index].id, "type": "function",
                    "function": {"name": call.name, "arguments": ""},
                })
            sent = self.sent[index]
            fragment = call.arguments[sent.args_sent :]
            if fragment:
                deltas.append({"index": index, "function": {"arguments": fragment}})
                sent.args_sent = len(call.arguments)
        return content, deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)


def whole_tool_calls(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    """``message.tool_calls`` of a whole (not streamed) response."""
    return [
        {"id": make_tool_call_id(), "type": "function",
         "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]
