"""The `ingot` command's entry point: imports the CLI (torch and all) inside a handler, so a
Ctrl-C while Python is still importing ends quietly with 130 like one during a command."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from ingot.entrypoints.cli import main as cli_main
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return cli_main()
