"""What one HTTP request may cost, and what the server trusts (docs/serving.md, "Security").

``ServerLimits`` declares the flags (as ``EngineArgs`` does, in field metadata); the checks on a
request's shape run on the parsed JSON before validation, so an oversized list is refused
before anything walks it item by item. Each refusal is a 400 that names the field, the limit
and the flag.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ingot.engine.arg_utils import cli
from ingot.entrypoints.openai.protocol import MAX_N, RequestValueError

SECURITY_GROUP = "security: request limits and trust (docs/serving.md#security)"


def _flag(help: str) -> dict[str, Any]:
    return cli(help, group=SECURITY_GROUP)


@dataclass(frozen=True)
class ServerLimits:
    """The server's request limits and trust switches (``ingot serve`` flags)."""

    # vLLM's flag: a request's own Jinja template is code the server would run.
    trust_request_chat_template: bool = field(default=False, metadata=_flag(
        "accept a chat request's own chat_template (Jinja run by the server; default: "
        "refused with a 400)"))
    enable_admin_routes: bool = field(default=False, metadata=_flag(
        "serve POST /reset_prefix_cache (default: 404)"))
    chat_template_timeout_s: float = field(default=5.0, metadata=_flag(
        "longest a chat template may take to render, in seconds (default: %(default)s)"))
    max_chat_template_output_chars: int = field(default=16 * 2**20, metadata=_flag(
        "longest text a chat template may render (default: %(default)s)"))
    max_sequences_per_request: int = field(default=2048, metadata=_flag(
        "prompts x n of one request (default: %(default)s)"))
    max_chat_messages: int = field(default=2048, metadata=_flag(
        "messages in one chat request (default: %(default)s)"))
    max_tools_per_request: int = field(default=128, metadata=_flag(
        "tools in one chat request (default: %(default)s, OpenAI's limit)"))
    max_stop_strings: int = field(default=16, metadata=_flag(
        "stop strings in one request (default: %(default)s)"))
    max_stop_string_length: int = field(default=256, metadata=_flag(
        "characters in one stop string (default: %(default)s)"))
    max_json_depth: int = field(default=64, metadata=_flag(
        "nesting depth of a request body's JSON (default: %(default)s)"))
    max_waiting_requests: int = field(default=4096, metadata=_flag(
        "sequences admitted but not yet started (prompts x n); past it new generation "
        "requests get 503 with Retry-After (default: %(default)s)"))
    # No vLLM equivalent: a stream's send waits while the client reads nothing.
    stream_idle_timeout: float = field(default=60.0, metadata=_flag(
        "drop a streaming client that has read nothing for this many seconds: its request "
        "is aborted, its KV blocks freed (default: %(default)s)"))

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                flag = "--" + f.name.replace("_", "-")
                raise ValueError(f"{flag} must be a positive number, got {value!r}")

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerLimits:
        return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)})


def over_limit(what: str, got: int, limit: int, flag: str, param: str, fix: str) -> None:
    """A 400 naming the field, the limit and the flag that sets it."""
    if got > limit:
        raise RequestValueError(
            f"{what} is {got}, over the server's limit of {limit} ({flag}); {fix}", param
        )


def _num_prompts(prompt: Any) -> int:
    """Prompts in a completion's ``prompt`` / pooling ``input``: one string or token-id list,
    or a list of them."""
    if not isinstance(prompt, list) or not prompt:
        return 1
    return len(prompt) if isinstance(prompt[0], str | list) else 1


def check_request_shape(data: dict[str, Any], limits: ServerLimits) -> None:
    """The list sizes of a parsed body, before validation walks them (wrong types are left to
    validation)."""
    messages = data.get("messages")
    if isinstance(messages, list):
        over_limit("the number of messages", len(messages), limits.max_chat_messages,
                   "--max-chat-messages", "messages", "send a shorter conversation")
    tools = data.get("tools")
    if isinstance(tools, list):
        over_limit("the number of tools", len(tools), limits.max_tools_per_request,
                   "--max-tools-per-request", "tools", "send fewer tools")
    stop = data.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
    over_limit("the number of stop strings", len(stops), limits.max_stop_strings,
               "--max-stop-strings", "stop", "send fewer stop strings")
    for s in stops:
        if isinstance(s, str):
            over_limit("the length of a stop string", len(s), limits.max_stop_string_length,
                       "--max-stop-string-length", "stop", "send shorter stop strings")
    n = data.get("n", 1)
    # An n out of its own range is validation's to refuse, with its own message.
    n = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= MAX_N else 1
    # Each prompt (pooling: input, document, text) is one engine request, times n.
    for name in ("prompt", "prompt_embeds", "input", "documents", "text_1", "text_2"):
        if name in data:
            num = _num_prompts(data[name])
            what = f"{name} x n ({num} x {n})" if n > 1 else f"the number of prompts in {name}"
            param = "n" if n > 1 and num <= limits.max_sequences_per_request else name
            over_limit(what, num * n, limits.max_sequences_per_request,
                       "--max-sequences-per-request", param, "split the request or lower n")
