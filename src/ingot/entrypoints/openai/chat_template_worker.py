"""A chat-template render process (``python -m ingot.entrypoints.openai.chat_template_worker
MEMORY_BYTES``), driven by ``ChatTemplateRenderer`` (chat_templates.py) over its stdin/stdout.

It renders with transformers' own ``render_jinja_template`` (the sandbox, filters and globals
``tokenizer.apply_chat_template`` uses), so prompts are the ones the model was trained on. Its
address space is capped at start-up (``RLIMIT_AS``): a template that builds a huge string
(``'x' * 10**10``) gets a MemoryError here instead of taking the server's memory. The parent
bounds the time by killing this process.

Frames are an 8-byte big-endian length and JSON, both ways: nothing here is unpickled.
Importing this module costs nothing (transformers is imported by ``main``), so the parent
shares the framing code.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import sys
from typing import IO, Any

_HEADER = struct.Struct(">Q")


def write_frame(stream: IO[bytes], obj: Any) -> None:
    # ASCII: a lone surrogate (valid in a JSON string) must not fail the encoding.
    data = json.dumps(obj, ensure_ascii=True).encode("ascii")
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def frame_length(header: bytes) -> int:
    return _HEADER.unpack(header)[0]


HEADER_SIZE = _HEADER.size


def _read_exact(stream: IO[bytes], size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def _render(request: dict[str, Any], render: Any, template_error: type) -> dict[str, Any]:
    # transformers drops None-valued message keys before rendering (apply_chat_template).
    messages = [{k: v for k, v in m.items() if v is not None} for m in request["messages"]]
    try:
        rendered, _ = render(
            [messages], tools=request.get("tools"), chat_template=request["template"],
            add_generation_prompt=request["add_generation_prompt"], **request["kwargs"],
        )
        text = rendered[0]
    except MemoryError:
        return {"error": "memory"}
    except template_error as exc:
        return {"error": "template", "message": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the template's own failure, reported to the client
        return {"error": "template", "message": f"{type(exc).__name__}: {exc}"}
    if len(text) > request["max_chars"]:
        return {"error": "output", "chars": len(text)}
    return {"text": text}


def main() -> int:
    memory_bytes = int(sys.argv[1])
    # Ctrl-C reaches the whole process group: the parent decides when this process ends (EOF).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The frames own stdout; anything a library prints goes to stderr (the server's log).
    frames_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    frames_in = sys.stdin.buffer

    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import render_jinja_template

    # What the interpreter and its imports use now, plus the render budget. (Without /proc,
    # not Linux, the cap is left off: the time limit still holds.)
    try:
        with open("/proc/self/statm") as statm:
            used = int(statm.read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (used + memory_bytes, used + memory_bytes))
    except OSError:
        pass
    write_frame(frames_out, {"ready": True})
    while True:
        header = _read_exact(frames_in, HEADER_SIZE)
        if header is None:
            return 0  # the server closed the pipe (or exited)
        body = _read_exact(frames_in, frame_length(header))
        if body is None:
            return 0
        try:
            reply = _render(json.loads(body), render_jinja_template, TemplateError)
        except MemoryError:
            reply = {"error": "memory"}
        write_frame(frames_out, reply)


if __name__ == "__main__":
    sys.exit(main())
