"""The `ingot` command's entry point: Ctrl-C anywhere in start-up ends quietly with 130."""

from __future__ import annotations

import pytest

from ingot.cli import launcher
from ingot.cli import main as cli


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def test_ctrl_c_while_building_the_parser_exits_130(monkeypatch, capsys):
    # build_parser imports the accuracy toolkit lazily, after the CLI module's own import: a
    # Ctrl-C there (seen in CI while `make run` started) must not print a traceback.
    monkeypatch.setattr(cli, "build_parser", _interrupt)
    assert launcher.main() == 130
    assert "Traceback" not in capsys.readouterr().err


def test_other_errors_still_propagate(monkeypatch):
    # Only Ctrl-C is swallowed: a bug in start-up still shows its traceback.
    def broken() -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(cli, "build_parser", broken)
    with pytest.raises(RuntimeError, match="bug"):
        launcher.main()
