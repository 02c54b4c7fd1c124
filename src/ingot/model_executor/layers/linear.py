"""Linear layers whose parameters know how to load their own checkpoint shards.

Each parameter carries a ``weight_loader(param, loaded_weight, shard_id=None)`` attribute, as in
vLLM, so fused projections (QKV, gate-up) take the separate checkpoint tensors without the model
loader knowing about the fusion.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded_weight)


def _set_loader(param: nn.Parameter | None, loader) -> None:  # noqa: ANN001
    if param is not None:
        param.weight_loader = loader


class LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        _set_loader(self.weight, default_weight_loader)
        _set_loader(self.bias, default_weight_loader)


class MergedLinear(LinearBase):
    """Several projections of one input fused on the output dim: shard ``i`` -> rows of part i."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        self.shard_offsets = [sum(output_sizes[:i]) for i in range(len(output_sizes))]
        _set_loader(self.weight, self._load_shard)
        _set_loader(self.bias, self._load_shard)

    def _shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def _load_shard(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: int | str | None = None
    ) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor
            default_weight_loader(param, loaded_weight)
            return
        i = self._shard_index(shard_id)
        rows = param.data.narrow(0, self.shard_offsets[i], self.output_sizes[i])
        default_weight_loader(rows, loaded_weight)


class QKVLinear(MergedLinear):
    """q, k and v projections fused; shard ids are ``"q"``, ``"k"``, ``"v"``."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False
    ) -> None:
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def _shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else int(shard_id)
