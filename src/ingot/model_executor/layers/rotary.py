"""Rotary position embeddings (NeoX "rotate half" layout, as HF Llama/Qwen) with the rope
scaling types default, linear, llama3 and yarn.

cos/sin are precomputed in float32 for every position up to ``max_position`` once, so a forward
step only gathers rows by position: no per-step trigonometry.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters_of(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of an HF config, old (``rope_scaling``) or new (``rope_parameters``).
    ``layer_type``: a layer's kind (``config.layer_types``), for configs whose
    ``rope_parameters`` holds one set per kind (Gemma 3: "sliding_attention", "full_attention")."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = dict(params[layer_type])
    else:
        for key, value in (getattr(config, "rope_scaling", None) or {}).items():
            params.setdefault(key, value)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(
    head_dim: int, params: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2] float32, attention scaling applied to cos and sin)."""
    rope_type = params["rope_type"]
    base = float(params["rope_theta"])
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "yarn":
        return _yarn_inv_freq(base, head_dim, params, max_position)
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base**exponent)
    if rope_type == "linear":
        inv_freq = inv_freq / params["factor"]
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, scaling = compute_inv_freq(head_dim, params, max_position)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Buffers, not parameters: they are derived from the config, never loaded. Computed in
        # float32, stored in the model dtype (HF casts cos/sin to it before use, so the values
        # are the same) with cos and sin side by side: one gather per step and layer.
        cos_sin = torch.stack((emb.cos() * scaling, emb.sin() * scaling), dim=1)
        self.register_buffer("cos_sin_cache", cos_sin.to(torch.get_default_dtype()), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]. Rotates q and k in one pass (NeoX
        "rotate half": x * cos + cat(-x2, x1) * sin)."""
        num_heads = q.shape[1]
        cos, sin = self.cos_sin_cache.index_select(0, positions).to(q.dtype).unbind(1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        qk = torch.cat((q, k), dim=1)
        x1, x2 = qk.chunk(2, dim=-1)
        out = qk * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out[:, :num_heads], out[:, num_heads:]
