"""RMSNorm, computed in float32 like the HF reference, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import CpuKernels, rms_norm_bf16
from ingot.model_executor.layers.linear import default_weight_loader


class RMSNorm(KernelBindable, nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.cpu_kernels: CpuKernels | None = None  # one C call instead of nine ops (bf16)

    def bind_kernels(self, kernels: Kernels) -> bool:
        if self.weight.dtype == torch.bfloat16:
            self.cpu_kernels = kernels.dense_bf16
        return self.cpu_kernels is not None

    #: Gemma's norms (models/gemma3.py) scale by 1 + weight; ingot's kernels take either kind.
    zero_centred = False

    def kernel_weight(self) -> torch.Tensor:
        """What ingot's kernels read as the weight (Gemma's: 1 + weight in float32)."""
        return self.weight

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.cpu_kernels is not None and x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return rms_norm_bf16(self.cpu_kernels, x, self.kernel_weight(), self.eps, residual,
                                 zero_centred=self.zero_centred)
        if residual is not None:
            x = x + residual
            residual = x
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self._scale(h, x.dtype)
        return out if residual is None else (out, residual)

    def _scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The normalised rows (float32) times the weight, in ``dtype``: Llama's rounds first."""
        return self.weight * h.to(dtype)
