"""Scores of text pairs, shared by ``LLM.score`` and the /score and /rerank routes.

Two kinds of model score a pair: a cross-encoder (a classifier with one label, e.g.
``BertForSequenceClassification``) reads both texts at once, segment A and B told apart by
token type ids, and its sigmoid is the score; an embedding model (a bi-encoder) embeds each text
and the score is the cosine of the two vectors. Pairing follows vLLM: one ``text_1`` against N
``text_2`` (broadcast), or N against N one to one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ingot.config import ModelConfig


def pair_up(text_1: str | Sequence[Any], text_2: str | Sequence[Any]) -> list[tuple[Any, Any]]:
    """vLLM's pairing: 1 x N broadcasts, N x N pairs one to one, anything else is an error."""
    left = [text_1] if isinstance(text_1, str) else list(text_1)
    right = [text_2] if isinstance(text_2, str) else list(text_2)
    if not left or not right:
        raise ValueError("text_1 and text_2 must each hold at least one input")
    if len(left) == 1:
        left = left * len(right)
    elif len(left) != len(right):
        raise ValueError(
            f"text_1 has {len(left)} inputs and text_2 {len(right)}: give one text_1 (scored "
            "against every text_2) or as many text_1 as text_2"
        )
    return list(zip(left, right, strict=True))


def is_cross_encoder(model_config: ModelConfig) -> bool:
    pooler = model_config.pooler_config
    return pooler is not None and pooler.task == "classify"


def check_can_score(model_config: ModelConfig) -> None:
    """A cross-encoder must give one score per pair (one label)."""
    if not model_config.is_pooling:
        raise ValueError(
            f"{model_config.architecture} is served as a generative model; scoring needs a "
            "pooling model (start it with --runner pooling)"
        )
    labels = int(getattr(model_config.hf_config, "num_labels", 1))
    if is_cross_encoder(model_config) and labels != 1:
        raise ValueError(
            f"scoring needs a cross-encoder with one label; {model_config.architecture} has "
            f"{labels} (use classify for its label scores)"
        )


def cross_encoder_prompt(
    tokenizer: Any, text_1: str, text_2: str, truncate_prompt_tokens: int | None,
    max_model_len: int,
) -> dict[str, Any]:
    """Both texts in one input ([CLS] a [SEP] b [SEP]) with their token type ids."""
    if tokenizer is None:
        raise ValueError("scoring text pairs needs a tokenizer")
    if not isinstance(text_1, str) or not isinstance(text_2, str):
        raise ValueError("a cross-encoder scores text pairs; give strings")
    k = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    enc = tokenizer(text_1, text_2, truncation=k is not None, max_length=k)
    prompt: dict[str, Any] = {"prompt_token_ids": list(enc["input_ids"])}
    if "token_type_ids" in enc:
        prompt["token_type_ids"] = list(enc["token_type_ids"])
    return prompt


def cosine(u: Sequence[float], v: Sequence[float]) -> float:
    dot = sum(a * b for a, b in zip(u, v, strict=True))
    norm = math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v))
    return dot / norm if norm > 0 else 0.0
