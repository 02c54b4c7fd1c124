"""The `ingot` command's entry point: imports and runs the CLI (torch and all) inside one
handler, so a Ctrl-C at any point of start-up (importing, building the parser, which imports
more lazily) ends quietly with 130 like one during a command."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from ingot.cli.main import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
