"""Gemma 3 (text): the Llama-family decoder with Gemma's differences, as HF's
``Gemma3ForCausalLM`` computes them.

- Norms scale by ``1 + weight`` (zero-centred weights), computed in float32 and cast once.
- Sandwich norms: the attention and MLP outputs are normed before they join the residual
  stream (``post_attention_layernorm``, ``post_feedforward_layernorm``), and the MLP's input by
  ``pre_feedforward_layernorm``.
- q/k RMSNorm per head, GeGLU (``gelu_pytorch_tanh``), scores scaled by
  ``query_pre_attn_scalar ** -0.5``, token embeddings scaled by sqrt(hidden).
- Local layers (``sliding_attention``) attend to the last ``sliding_window`` positions with
  their own rope base; every sixth layer is global (``config.layer_types``).
"""

from __future__ import annotations

from typing import Any

import torch

from ingot.model_executor.layers.bindable import Kernels
from ingot.model_executor.layers.layernorm import RMSNorm
from ingot.model_executor.models.llama import DecoderLayer, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """``x / rms(x) * (1 + weight)`` in float32, cast to the input's dtype at the end (HF's
    Gemma3RMSNorm; Llama's casts before the multiply). ``weight`` holds HF's zero-centred
    values: llama.cpp's files store ``1 + weight``, and the GGUF loader takes the 1 off. In bf16
    on CPU ingot's kernel takes ``1 + weight`` in float32, derived once when it is bound."""

    zero_centred = True

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        with torch.no_grad():
            self.weight.zero_()
        self.scale_f32: torch.Tensor | None = None

    def bind_kernels(self, kernels: Kernels) -> bool:
        if super().bind_kernels(kernels):
            self.scale_f32 = 1.0 + self.weight.detach().float()
        return self.cpu_kernels is not None

    def kernel_weight(self) -> torch.Tensor:
        assert self.scale_f32 is not None, "bind_kernels first"
        return self.scale_f32

    def _scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (h * (1.0 + self.weight.float())).to(dtype)


class Gemma3DecoderLayer(DecoderLayer):
    norm_cls = GemmaRMSNorm

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        config = args[0]
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        return (self.input_layernorm, self.pre_feedforward_layernorm,
                self.post_attention_layernorm, self.post_feedforward_layernorm)


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    layer_cls = Gemma3DecoderLayer

    def __init__(self, config: Any) -> None:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ValueError(f"Gemma 3 with {name}={getattr(config, name)} is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
        super().__init__(config)

    def _sliding_window(self, config: Any, layer: int) -> int | None:
        if config.layer_types[layer] == "sliding_attention":
            return int(config.sliding_window)
        return None

    def _embed_scale(self, config: Any) -> float | None:
        return float(config.hidden_size) ** 0.5
