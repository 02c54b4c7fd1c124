"""`ingot validate` (placeholder wiring; the accuracy toolkit fills it in)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_validate_parser(sub: argparse._SubParsersAction, add_engine_args: Callable) -> None:
    p = sub.add_parser("validate", help="check a model's logits against HF transformers")
    add_engine_args(p)

    def run(ns: argparse.Namespace) -> int:
        raise ValueError("ingot validate is not implemented yet")

    p.set_defaults(func=run)
