"""Tool-call parsers, by ``--tool-call-parser`` name: ``hermes``, ``llama3_json``,
``pythonic``; ``--tool-parser-plugin FILE`` imports a file that registers more with
``@register_tool_parser("name")`` on a ``ToolParser`` subclass (see ``base.py``)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

from ingot.entrypoints.openai.tool_parsers.base import ToolParser
from ingot.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from ingot.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from ingot.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "pythonic": PythonicToolParser,
}


def register_tool_parser(name: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
    def register(cls: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
            raise TypeError(f"tool parser {name!r} must subclass ingot's ToolParser")
        TOOL_PARSERS[name] = cls
        return cls

    return register


def load_tool_parser_plugin(path: str) -> None:
    """Import ``path`` (a Python file) so that its ``@register_tool_parser`` classes exist."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin {path!r} is not a file")
    spec = importlib.util.spec_from_file_location(f"ingot_tool_parser_plugin_{file.stem}", file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path!r} cannot be imported as Python")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(
            f"--tool-call-parser {name!r} is not known; choose from "
            f"{', '.join(sorted(TOOL_PARSERS))} (or register one with --tool-parser-plugin)"
        )
    return TOOL_PARSERS[name]
