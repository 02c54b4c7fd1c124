"""Mixture-of-experts decoders of the Llama family: Qwen3-MoE and Mixtral (HF layouts).

Attention, norms, embedding and head are the Llama family's (llama.py); only the feed-forward
block of the sparse layers differs (layers/fused_moe.py: replicated router, top-k routing,
stacked experts, TP of experts by default, EP when enabled). The checkpoint's per-expert
tensors land in the stacked weights through their ``weight_loader(param, t, shard, expert)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ingot.distributed.parallel_state import get_dp_group, get_ep_size
from ingot.model_executor.layers.fused_moe import FusedMoE
from ingot.model_executor.models.llama import MistralForCausalLM, Qwen3ForCausalLM

# ``<prefix>.mlp.experts.<e>.<projection>.weight`` -> (prefix, expert, projection)
_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(\w+)\.weight$")
# HF transformers 5's fused layout: ``<prefix>.mlp.experts.gate_up_proj`` / ``down_proj``
_FUSED = re.compile(r"^(.*\.mlp)\.experts\.(gate_up_proj|down_proj)$")


class _MoEMixin:
    """What the two architectures share: the expert loaders. (The CPU decode program does not
    build for them: its kernel sequence is the dense MLP's.)"""

    #: Why the layers run eagerly (config.py reads it): the expert grouping's per-expert
    #: token counts are data-dependent shapes, which a full-graph compile cannot take.
    eager_only = "MoE expert grouping has data-dependent shapes"

    #: checkpoint projection name -> (our stacked parameter, shard id)
    expert_projections: dict[str, tuple[str, int]] = {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)  # type: ignore[misc]
        for name, module in self.named_modules():  # type: ignore[attr-defined]
            if isinstance(module, FusedMoE) and (missing := module.missing_pieces()):
                raise ValueError(f"checkpoint is missing expert tensors of {name}: "
                                 f"{missing[:8]} (expert, projection)")
        return loaded

    def _load_expert_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        match = _EXPERT.match(name)
        if match is not None:
            prefix, expert, proj = match.groups()
            if proj not in self.expert_projections:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            stacked, shard_id = self.expert_projections[proj]
            target = f"{prefix}.{stacked}"
            expert_id, shard = int(expert), shard_id
        else:
            match = _FUSED.match(name)
            if match is None:
                return None
            prefix, proj = match.groups()
            target = f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}"
            expert_id = shard = None
        if target not in params:
            raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
        param = params[target]
        param.weight_loader(param, tensor, shard, expert_id)
        return target


def _moe_block(config: Any, num_experts: int, intermediate: int, renormalize: bool) -> FusedMoE:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act {act!r} is not supported; only 'silu' is")
    return FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, intermediate,
                    renormalize, ep_size=get_ep_size(), dp_group=get_dp_group())


class Qwen3MoeForCausalLM(_MoEMixin, Qwen3ForCausalLM):
    """Qwen3 attention (q/k norm) with sparse layers: softmax over all experts, top k,
    renormalised iff ``norm_topk_prob``. A layer is dense (the Llama MLP of
    ``intermediate_size``) when it is in ``mlp_only_layers`` or ``(i + 1) %
    decoder_sparse_step != 0``."""

    expert_projections = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1),
                          "down_proj": ("w2", 2)}

    def _mlp_factory(self) -> Callable[[int], nn.Module | None]:
        config = self.config
        dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        experts = config.num_experts

        def make(i: int) -> nn.Module | None:
            if i in dense or experts <= 0 or (i + 1) % step:
                return None
            return _moe_block(config, experts, config.moe_intermediate_size,
                              bool(config.norm_topk_prob))

        return make


class MixtralForCausalLM(_MoEMixin, MistralForCausalLM):
    """Mistral attention with every layer sparse: softmax over the top-k router logits (the
    same as softmax over all, top k, renormalised). The checkpoint's ``block_sparse_moe`` block
    is our ``mlp``; w1 gate, w3 up, w2 down."""

    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_projections = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 2)}

    def _mlp_factory(self) -> Callable[[int], nn.Module | None]:
        config = self.config
        return lambda i: _moe_block(config, config.num_local_experts, config.intermediate_size,
                                    True)
