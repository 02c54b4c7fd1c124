"""An EAGLE3 draft head (``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM`` checkpoints
and the speculators format): one Llama decoder layer that reads the target's hidden states.

* Initial pass: the target's auxiliary hidden states (the inputs of three of its layers,
  concatenated, [T, 3 x target hidden]) go through ``fc`` to the head's width.
* Recurrent pass: the previous draft row's pre-norm output ([T, hidden]) is the state.

The layer attends over ``[input_layernorm(token embedding), hidden_norm(state)]`` (its q/k/v
take 2 x hidden) with the state as the residual; the head returns the normed output (for its
logits) and the pre-norm sum (the next recurrent state). Its logits cover ``draft_vocab_size``
tokens; ``d2t`` maps a draft token to the target's id (``target = draft + d2t[draft]``).
Without an ``embed_tokens`` tensor of its own it shares the target's embedding.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ingot.model_executor.layers.attention import AttentionMetadata
from ingot.model_executor.layers.layernorm import RMSNorm
from ingot.model_executor.layers.linear import (
    ReplicatedLinear,
    default_weight_loader,
    load_into,
)
from ingot.model_executor.layers.rotary import RotaryEmbedding, rope_parameters_of
from ingot.model_executor.models.llama import DecoderAttention, DecoderMLP, head_dim_of

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def eagle3_config(path: str) -> Any:
    """The head's config from its directory: a Llama config (the first layout), or the
    speculators format's ``transformer_layer_config`` with its EAGLE3 fields."""
    from transformers import AutoConfig, LlamaConfig

    raw = json.loads((Path(path) / "config.json").read_text())
    if "transformer_layer_config" in raw:
        config = LlamaConfig(**raw["transformer_layer_config"])
        config.draft_vocab_size = raw.get("draft_vocab_size", config.vocab_size)
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None:
            config.eagle_aux_hidden_state_layer_ids = list(ids)
        if raw.get("target_hidden_size") is not None:
            config.target_hidden_size = raw["target_hidden_size"]
        config.architectures = ["Eagle3LlamaForCausalLM"]
        return config
    config = AutoConfig.from_pretrained(path)
    eagle = getattr(config, "eagle_config", None) or {}
    if isinstance(eagle, dict) and "eagle_aux_hidden_state_layer_ids" in eagle:
        config.eagle_aux_hidden_state_layer_ids = list(eagle["eagle_aux_hidden_state_layer_ids"])
    return config


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The original's default: inputs of layers 2, N // 2 and N - 3."""
    n = num_target_layers
    return (2, n // 2, n - 3)


class Eagle3DecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = DecoderAttention(config, rotary, False, (bias, bias),
                                          qkv_input_size=2 * hidden)
        self.mlp = DecoderMLP(config)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, state: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(state)], dim=-1)
        h = self.self_attn(positions, x, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, state)
        return self.mlp(h, meta), residual


class Eagle3LlamaForCausalLM(nn.Module):
    """The head; ``forward(input_ids, positions, kv_caches, meta, state)`` with
    ``kv_caches`` its one layer's cache (a list of one)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        if int(getattr(config, "num_hidden_layers", 1)) != 1:
            raise ValueError(
                f"an EAGLE3 head has exactly one decoder layer, this one has "
                f"{config.num_hidden_layers}"
            )
        self.config = config
        hidden = config.hidden_size
        target_hidden = int(getattr(config, "target_hidden_size", None) or hidden)
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.embed_tokens.weight.requires_grad_(False)
        self.embed_tokens.weight.weight_loader = default_weight_loader
        self.fc = ReplicatedLinear(3 * target_hidden, hidden)
        rotary = RotaryEmbedding(head_dim_of(config), config.max_position_embeddings,
                                 rope_parameters_of(config))
        self.layer = Eagle3DecoderLayer(config, rotary)
        self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = ReplicatedLinear(hidden, self.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        #: No embedding in the checkpoint: the target's is used (set by the proposer).
        self.shares_target_embedding = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata, state: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``state``: [T, 3 x target hidden] (initial pass) or [T, hidden] (recurrent).
        Returns (normed output, pre-norm output = the next state)."""
        if state.shape[-1] != self.config.hidden_size:
            state = self.fc(state, meta.kernel_rows)
        h, residual = self.layer(positions, self.embed_tokens(input_ids), state, kv_caches[0],
                                 meta)
        return self.norm(h, residual)

    def compute_logits(self, hidden: torch.Tensor, kernel_rows: int = 0) -> torch.Tensor:
        return self.lm_head(hidden, kernel_rows)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj", ".qkv_proj", "q"), (".k_proj", ".qkv_proj", "k"), (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0), (".up_proj", ".gate_up_proj", 1),
    )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            for old in ("midlayer.", "layers.0."):  # the two layouts' names of the one layer
                if name.startswith(old):
                    name = "layer." + name[len(old):]
            if name == "t2d" or "rotary_emb.inv_freq" in name:
                continue  # t2d: the reverse map, unused
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
                loaded.add(name)
                continue
            loaded.add(load_into(params, name, tensor, self.stacked_params, "the EAGLE3 head"))
        self.shares_target_embedding = "embed_tokens.weight" not in loaded
        missing = set(params) - loaded - {"embed_tokens.weight"}
        if missing:
            raise ValueError(f"the EAGLE3 checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded
