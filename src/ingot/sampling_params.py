"""Sampling parameters, with vLLM's field names and defaults.

Every field is validated in ``__post_init__``; an invalid value raises ``ValueError`` naming the
field and saying what would be accepted, so the HTTP layer can turn it into a 400.
"""

from __future__ import annotations

import copy
import json as _json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

_SAMPLING_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class RequestOutputKind(IntEnum):
    """What each ``RequestOutput`` of a request carries (vLLM's enum). CUMULATIVE: everything
    so far, every step (O(T) per step); DELTA: only what is new since the last output (the
    server's streams); FINAL_ONLY: one output, when the request finishes (``LLM`` and the
    server's whole responses)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


# The constraint kinds of StructuredOutputsParams; a request sets exactly one of them.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's fields), enforced with a grammar mask.

    ``json``: a JSON schema (dict, JSON text, or a pydantic model class); ``regex``: the text
    fully matches it; ``choice``: the text is one of these strings; ``grammar``: an EBNF (GBNF)
    grammar; ``json_object``: any JSON object; ``structural_tag``: xgrammar's structural tag
    (JSON text or dict). ``disable_any_whitespace``: JSON without free whitespace;
    ``disable_additional_properties``: objects without ``additionalProperties`` allow none
    (xgrammar's strict mode, on by default for ingot as for vLLM's xgrammar backend, so the flag
    only confirms it); ``whitespace_pattern`` is an outlines option that xgrammar has no
    equivalent for, so it is rejected rather than ignored.
    """

    json: str | dict[str, Any] | Any | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    #: Set by the server's --reasoning-parser: the constraint starts once the output contains
    #: this token sequence (the end of the reasoning, "</think>"); before it, tokens are free.
    reasoning_end_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()  # a pydantic model class
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _json.dumps(self.structural_tag)
        kinds = self.kinds
        if len(kinds) != 1:
            named = ", ".join(kinds) if kinds else "none"
            raise ValueError(
                "structured_outputs needs exactly one constraint kind of "
                f"{', '.join(STRUCTURED_OUTPUT_KINDS)}; got {named}"
            )
        if isinstance(self.json, str):
            try:
                _json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
        elif self.json is not None and not isinstance(self.json, dict | bool):
            raise ValueError(
                "structured_outputs.json must be a JSON schema (object or JSON text), got "
                f"{type(self.json).__name__}"
            )
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (
            not isinstance(self.choice, list | tuple)
            or not self.choice
            or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        if self.choice is not None:
            self.choice = list(self.choice)
        ends = self.reasoning_end_token_ids
        if ends is not None and (
            not isinstance(ends, list | tuple) or not ends
            or not all(isinstance(t, int) and t >= 0 for t in ends)
        ):
            raise ValueError("structured_outputs.reasoning_end_token_ids must be a non-empty "
                             "list of token ids")
        if self.whitespace_pattern is not None:
            raise ValueError(
                "structured_outputs.whitespace_pattern is not supported by the xgrammar backend "
                "(its JSON grammars allow free whitespace, capped by max_json_whitespace, or "
                "none; not a pattern): use disable_any_whitespace=true for compact JSON, or a "
                "regex constraint"
            )

    @property
    def kinds(self) -> list[str]:
        """The constraint kinds that are set (json_object only when true)."""
        return [
            k for k in STRUCTURED_OUTPUT_KINDS
            if (getattr(self, k) is True if k == "json_object" else getattr(self, k) is not None)
        ]

    @property
    def kind(self) -> str:
        return self.kinds[0]

    @property
    def spec(self) -> str:
        """The constraint as text: what compiles, and part of the compiled-grammar cache key.
        A schema keeps its key order (properties are generated in that order)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            return _json.dumps(value)
        if self.kind == "choice":
            return _json.dumps(value)
        return "" if self.kind == "json_object" else str(value)


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Filled by the engine from the model's generation config, not by users.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.structured_outputs, dict):
            fields = set(StructuredOutputsParams.__dataclass_fields__)
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise ValueError(
                    f"unknown structured_outputs field(s): {', '.join(unknown)}; known: "
                    f"{', '.join(sorted(fields))}"
                )
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        # Kept when given: params decoded from another process (distributed/wire.py) carry
        # the ids the engine added.
        self.all_stop_token_ids = set(self.stop_token_ids) | set(self.all_stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {value!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "an integer >= 1")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not self.temperature >= 0.0:
            raise bad("temperature", self.temperature, ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "an integer >= 0 (0 or -1 disables it)")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, value, "an integer >= 0 or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "a list of non-negative integers")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", self.structured_outputs,
                      "a StructuredOutputsParams, a dict of its fields, or None")
        if self.structured_outputs is not None and self.min_tokens > 0:
            # min_tokens masks EOS, the grammar may allow nothing else: no token would be left.
            raise ValueError("min_tokens cannot be combined with structured_outputs: the "
                             "grammar decides where the output ends; drop min_tokens")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", self.output_kind, "a RequestOutputKind")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True; use stop_token_ids instead.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
