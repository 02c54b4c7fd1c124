"""Engine flags derived from ``EngineArgs`` (vLLM's ``vllm/engine/arg_utils.py``).

Each ``EngineArgs`` field declares its flag in ``field(metadata=cli(...))`` (config.py): help,
choices, aliases, group. This module turns those into argparse arguments and a parsed namespace
back into ``EngineArgs``, for every command that runs an engine (``ingot serve``, ``generate``,
``chat``, ``bench``, ``compile``, ``validate``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import types
import typing
from typing import Any

from ingot.config import CLI_METADATA_KEY, CliFlag, EngineArgs

logger = logging.getLogger("ingot")


def cli_fields(cls: type = EngineArgs) -> list[tuple[dataclasses.Field, CliFlag]]:
    """The fields of ``cls`` that are flags, in declaration order. A field without CLI
    metadata is an error: each knob decides once whether it is a flag (``NOT_A_FLAG``)."""
    flagged = []
    for f in dataclasses.fields(cls):
        if CLI_METADATA_KEY not in f.metadata:
            raise TypeError(
                f"{cls.__name__}.{f.name} declares no command-line flag: give it "
                "field(metadata=cli(...)), or metadata=NOT_A_FLAG to keep it off the CLI"
            )
        spec = f.metadata[CLI_METADATA_KEY]
        if spec is not None:
            flagged.append((f, spec))
    return flagged


def _value_type(name: str, annotation: Any) -> type | None:
    """argparse's ``type`` from a field's annotation, ``None`` meaning "the string as typed"
    (str fields, and JSON fields that also accept a dict from Python)."""
    members = set(typing.get_args(annotation)) if isinstance(annotation, types.UnionType) \
        else {annotation}
    members.discard(type(None))
    if str in members:
        return None
    if members in ({int}, {float}, {bool}):
        return members.pop()
    raise TypeError(f"EngineArgs.{name}: no flag type for {annotation!r}; declare cli(type=...)")


def _add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    hints = typing.get_type_hints(cls)
    groups: dict[str, Any] = {}  # title -> argument group, created on first use
    for f, spec in cli_fields(cls):
        if spec.group not in groups:
            groups[spec.group] = parser.add_argument_group(spec.group)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": spec.help}
        value_type = spec.type or _value_type(f.name, hints[f.name])
        if spec.action is not None:
            kwargs["action"] = spec.action
        elif value_type is bool:
            # An off switch is enough for a flag that defaults off; the others get --no-x too.
            kwargs["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        elif value_type is not None:
            kwargs["type"] = value_type
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        flag = spec.flag or "--" + f.name.replace("_", "-")
        groups[spec.group].add_argument(*spec.aliases, flag, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineArgs`` field (vLLM's names), as its metadata declares."""
    _add_dataclass_args(parser, EngineArgs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """The ``EngineArgs`` in a parsed namespace (its other attributes are the command's own)."""
    names = EngineArgs.field_names()
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in names})


# ---- one-shot sizing ---------------------------------------------------------------------
# `generate`, `chat`, `validate` and single-request `bench` runs know their workload: one
# prompt (times --n) at a time. The engine's defaults are sized for a server (256 sequences:
# a KV cache of several GB, a warmup step per decode batch bucket up to 256 and per prefill
# bucket up to 2048), which made `ingot generate` spend most of a minute before its first
# token. These commands set the existing knobs to what they will run instead; a flag the user
# typed always wins. `serve` keeps the full grid and its warmup.
ONE_SHOT_MIN_TOKENS = 128  # the smallest prefill bucket (buckets.py)
ONE_SHOT_MAX_TOKENS = 2048  # the engine's default token budget: never raised above it


def prefill_budget_for(num_tokens: int) -> int:
    """The smallest power-of-two token budget (>= 128) that prefills ``num_tokens`` at once."""
    budget = ONE_SHOT_MIN_TOKENS
    while budget < min(num_tokens, ONE_SHOT_MAX_TOKENS):
        budget *= 2
    return budget


def size_one_shot(ns: argparse.Namespace, num_seqs: int, prompt_tokens: int | None) -> None:
    """Set max_num_seqs to the sequences the command runs at once and the token budget (hence
    the prefill buckets) to the longest prompt it expects, unless the user gave them. The KV
    cache follows: the worker never allocates more than max_num_seqs full-length sequences."""
    given: set[str] = getattr(ns, "given_flags", set())
    chosen = []
    if "max_num_seqs" not in given:
        ns.max_num_seqs = num_seqs
        chosen.append(f"max_num_seqs={num_seqs}")
    try:
        extra = EngineArgs._json_arg("additional_config", ns.additional_config)
    except ValueError:
        extra = {}  # reported by the engine config with its own message
    if (prompt_tokens is not None and "max_num_batched_tokens" not in given
            and ns.enable_chunked_prefill  # without chunking the budget must cover max_model_len
            and "num_batched_tokens_buckets" not in extra):
        ns.max_num_batched_tokens = max(prefill_budget_for(prompt_tokens), ns.max_num_seqs)
        chosen.append(f"max_num_batched_tokens={ns.max_num_batched_tokens}")
    if chosen:
        logger.info("sized for this command: %s (flags given on the command line win)",
                    ", ".join(chosen))
