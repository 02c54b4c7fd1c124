"""Pooling parameters (vLLM's ``PoolingParams``): what a pooling request (embed, classify,
score, encode) may ask for. Validated in ``__post_init__`` like ``SamplingParams``; the engine
fills the task and the model's defaults (``InputProcessor.resolve_pooling_params``)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

POOLING_TASKS = ("embed", "classify", "score", "encode")


@dataclass
class PoolingParams:
    #: Keep at most this many prompt tokens (-1: max_model_len); None: no truncation (a prompt
    #: over max_model_len is an error).
    truncate_prompt_tokens: int | None = None
    #: Matryoshka models only: the first ``dimensions`` components, re-normalised.
    dimensions: int | None = None
    #: L2-normalise the embedding; None: the model's pooler config.
    normalize: bool | None = None
    #: classify/score: softmax (sigmoid for one label) over the logits; None: on.
    activation: bool | None = None
    #: Set by the entry point (LLM.embed, /v1/embeddings, ...), not by users.
    task: str | None = None

    def __post_init__(self) -> None:
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}.")
        d = self.dimensions
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ValueError(f"dimensions must be an integer >= 1, got {d!r}.")
        for name in ("normalize", "activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be true or false, got {value!r}.")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}.")

    def clone(self) -> PoolingParams:
        return copy.copy(self)
