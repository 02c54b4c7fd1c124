"""The HF transformers reference: fp32 ground truth and the same model in the engine's dtype.

The reference is built from the checkpoint alone, never from the engine's config: ``--hf-overrides``
changes what ingot builds, and the point of validation is to measure that change against what
the checkpoint really is.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ingot.engine.model_resolution import resolve_model_path

logger = logging.getLogger("ingot")


def load_hf_model(model: str | None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An HF ``AutoModelForCausalLM`` for an HF directory or a GGUF file (default: the embedded
    default model), in ``dtype``, in eval mode, on the CPU."""
    from transformers import AutoModelForCausalLM

    path, fmt = resolve_model_path(model)
    if fmt == "hf":
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        from ingot.model_executor.loader.gguf_loader import load_gguf

        gguf = load_gguf(path)
        hf = AutoModelForCausalLM.from_config(copy.deepcopy(gguf.config), dtype=dtype)
        # Tied embeddings are stored once; from_config already ties lm_head to embed_tokens.
        missing, unexpected = hf.load_state_dict(dict(gguf.weights(dtype)), strict=False)
        missing = [
            m for m in missing if not (m == "lm_head.weight" and hf.config.tie_word_embeddings)
        ]
        if missing or unexpected:
            raise ValueError(
                f"the GGUF weights do not fit the transformers model: missing {missing[:4]}, "
                f"unexpected {unexpected[:4]}"
            )
    return hf.eval()


@dataclass
class ReferenceRun:
    """One prompt's teacher data: the fp32 greedy tokens and the logits at each of them."""

    prompt_ids: list[int]
    tokens: list[int]  # reference continuation, argmax of baseline_logits
    baseline_logits: torch.Tensor  # [T, V] fp32 HF
    expected_logits: torch.Tensor | None  # [T, V] HF in the engine dtype, teacher-forced

    @property
    def sequence(self) -> list[int]:
        """The tokens whose forward produces the T logits: prompt + tokens[:-1]."""
        return self.prompt_ids + self.tokens[:-1]


class HFReference:
    """fp32 HF model (baseline) and, for three-way mode, a copy in the engine's dtype."""

    def __init__(self, baseline: nn.Module, expected: nn.Module | None = None) -> None:
        self.baseline = baseline
        self.expected = expected

    @classmethod
    def load(cls, model: str | None, dtype: torch.dtype | None) -> HFReference:
        """``dtype`` None or float32 gives a two-way reference (no expected model)."""
        baseline = load_hf_model(model, torch.float32)
        expected = None
        if dtype is not None and dtype != torch.float32:
            # The same fp32 weights rounded to dtype: exactly what ingot loads in that dtype.
            expected = copy.deepcopy(baseline).to(dtype)
        return cls(baseline, expected)

    @torch.no_grad()
    def logits(self, token_ids: list[int], model: nn.Module | None = None) -> torch.Tensor:
        """[S, V] float32 logits of one full forward (no cache)."""
        model = model or self.baseline
        out = model(torch.tensor([token_ids]), use_cache=False)
        return out.logits[0].float()

    @torch.no_grad()
    def _greedy(self, prompt: list[int], n: int) -> list[int]:
        """Greedy continuation with HF's KV cache, ignoring EOS."""
        tokens: list[int] = []
        if n <= 0:
            return tokens
        out = self.baseline(torch.tensor([prompt]), use_cache=True)
        for i in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            if i + 1 < n:
                out = self.baseline(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        return tokens

    def run(self, prompt_ids: list[int], num_tokens: int) -> ReferenceRun:
        """Reference tokens and teacher-forced logits for one prompt.

        The cached greedy loop and one full forward can break a near-tie differently; the full
        forward's logits are what validation compares against, so its argmax must equal the
        tokens. On a mismatch the continuation is regenerated from the full-forward token.
        """
        tokens = self._greedy(prompt_ids, num_tokens)
        for _ in range(num_tokens + 1):
            logits = self.logits(prompt_ids + tokens[:-1])[len(prompt_ids) - 1 :]
            argmax = logits.argmax(-1).tolist()
            mismatch = next(
                (i for i, (a, t) in enumerate(zip(argmax, tokens, strict=True)) if a != t), None
            )
            if mismatch is None:
                break
            logger.debug(
                "reference near-tie at token %d: regenerating from the full forward", mismatch
            )
            head = tokens[:mismatch] + [argmax[mismatch]]
            tokens = head + self._greedy(prompt_ids + head, num_tokens - len(head))
        expected = None
        if self.expected is not None:
            expected = self.logits(prompt_ids + tokens[:-1], self.expected)[len(prompt_ids) - 1 :]
        return ReferenceRun(list(prompt_ids), tokens, logits, expected)

    @torch.no_grad()
    def kv_cache(
        self, token_ids: list[int], model: nn.Module | None = None
    ) -> list[tuple[Any, Any]]:
        """Per layer (K, V) of one forward, each [S, num_kv_heads, head_dim] float32.

        HF's cache holds K after RoPE and the un-repeated GQA heads, as ingot's paged cache does.
        """
        model = model or self.baseline
        out = model(torch.tensor([token_ids]), use_cache=True)
        layers = []
        for layer in out.cache.layers:
            k = layer.keys[0].transpose(0, 1).float()
            v = layer.values[0].transpose(0, 1).float()
            layers.append((k, v))
        return layers
