"""Causal LMs as classifiers: ``--convert classify`` and HF's ``*ForSequenceClassification``
checkpoints of the Llama family. The decoder is reused unchanged (its prefill path, buckets
and graphs); the LM head gives way to a ``score`` head over the pooled (last-token) hidden
state, as in HF. (``--convert embed`` needs no adapter: the decoder's forward already returns
the final hidden states, which the pooler reads.)"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.linear import ReplicatedLinear


def as_classification_model(causal_cls: type[nn.Module]) -> type[nn.Module]:
    class ForSequenceClassification(causal_cls):  # type: ignore[valid-type,misc]
        pooling_task = "classify"
        default_pooling_type = "LAST"

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.num_labels = int(getattr(config, "num_labels", 2))
            self.lm_head = None  # never used: a classifier has no logits over the vocabulary
            self.score = ReplicatedLinear(config.hidden_size, self.num_labels)

        def classify(self, pooled: torch.Tensor) -> torch.Tensor:
            return self.score(pooled)

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            seen: set[str] = set()

            def body() -> Iterable[tuple[str, torch.Tensor]]:
                for name, tensor in weights:
                    seen.add(name)
                    if name != "lm_head.weight":
                        yield name, tensor

            try:
                return super().load_weights(body())
            except ValueError:
                if "score.weight" not in seen:
                    raise ValueError(
                        "the checkpoint has no classification head (score.weight): --convert "
                        "classify needs a *ForSequenceClassification checkpoint"
                    ) from None
                raise

    ForSequenceClassification.__name__ = causal_cls.__name__.replace(
        "ForCausalLM", "ForSequenceClassification"
    )
    ForSequenceClassification.__qualname__ = ForSequenceClassification.__name__
    return ForSequenceClassification
