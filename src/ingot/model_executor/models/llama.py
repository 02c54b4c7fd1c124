"""Llama-family decoder (Llama, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm; Gemma 3 in
gemma3.py is a subclass).

One implementation, switched by config: the architectures differ in biases, per-head q/k
RMSNorm, the MLP's activation, the attention scale, sliding-window attention and rope settings
per layer (Gemma 3 alternates local and global layers), and the norm and layer classes. Projections are fused (QKV and gate-up); the separate
checkpoint tensors land in their shard through each parameter's ``weight_loader``.

Tensor parallelism (spec §1): the layers size themselves from ``get_tp_group()`` when the model
is built. QKV, gate-up and the LM head are column-parallel, O and down row-parallel (one
all-reduce each), the embedding vocab-parallel; norms and RoPE are replicated. A rank holds
num_heads/TP query heads and its share of the KV heads (one, replicated, when TP > KV heads).
With one rank these are the plain layers. With ``sequence_parallel`` on, a prefill step runs
in sequence-parallel layout (distributed/sequence_parallel.py): the residual stream and the
norms on the rank's T/TP rows, an all-gather before attention and before the MLP, a
reduce-scatter after each row-parallel output, and one all-gather before the logits.

The MoE models (moe.py: Qwen3-MoE, Mixtral) are subclasses that give their sparse layers another
feed-forward block (``_mlp_factory``) and load their expert tensors (``_load_expert_weight``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ingot.distributed.parallel_state import get_sequence_parallel, get_tp_group
from ingot.distributed.sequence_parallel import gather_tokens, local_tokens, sequence_parallel
from ingot.model_executor.layers.attention import AttentionMetadata, KVScales
from ingot.model_executor.layers.attention_backend import (
    TORCH_ATTENTION,
    AttentionBackend,
    AttentionBindable,
)
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import (
    KERNEL_ACTIVATIONS,
    CpuKernels,
    act_mul_bf16,
)
from ingot.model_executor.layers.layernorm import RMSNorm
from ingot.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_into,
)
from ingot.model_executor.layers.rotary import RotaryEmbedding, rope_parameters_of
from ingot.model_executor.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# The MLP's activation by HF name (``hidden_activation`` in Gemma's configs, else ``hidden_act``).
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


def activation_of(config: Any) -> str:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"MLP activation {act!r} is not supported; supported: "
                         f"{', '.join(sorted(_ACTIVATIONS))}")
    return act


class DecoderAttention(AttentionBindable, nn.Module):
    def __init__(
        self, config: Any, rotary: RotaryEmbedding, qk_norm: bool, biases: tuple[bool, bool],
        qkv_input_size: int | None = None, norm_cls: type[RMSNorm] = RMSNorm,
    ) -> None:
        """``qkv_input_size``: the q/k/v projections' input width when it is not the hidden
        size (an EAGLE3 head attends over [token embedding, hidden state], 2 x hidden).
        ``norm_cls``: the q/k norms' class (Gemma's scales by 1 + weight)."""
        super().__init__()
        qkv_bias, o_bias = biases
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = head_dim_of(config)
        # Gemma scales scores by query_pre_attn_scalar ** -0.5 (the head dim for most sizes).
        self.scale = float(getattr(config, "query_pre_attn_scalar", None) or self.head_dim)**-0.5
        self.qkv_proj = QKVParallelLinear(
            qkv_input_size or config.hidden_size, self.head_dim, total_heads, total_kv_heads,
            bias=qkv_bias,
        )
        # This rank's heads (all of them without TP).
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, o_bias)
        self.rotary = rotary
        eps = config.rms_norm_eps
        self.q_norm = norm_cls(self.head_dim, eps) if qk_norm else None
        self.k_norm = norm_cls(self.head_dim, eps) if qk_norm else None
        self.sliding_window: int | None = None
        self.kv_scales = KVScales()
        # How attention runs: chosen once for the model (layers/attention_backend.py); plain
        # torch until binding hands over the chosen one.
        self.attn_backend: AttentionBackend = TORCH_ATTENTION

    def bind_attention(self, backend: AttentionBackend) -> None:
        self.attn_backend = backend

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden, meta.kernel_rows)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = self.attn_backend.attend(self, positions, q, k, v, kv_cache, meta)
        return self.o_proj(out, meta.kernel_rows)


class DecoderMLP(KernelBindable, nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = activation_of(config)
        self.cpu_kernels: CpuKernels | None = None  # act(gate) * up in one C call (bf16)

    def bind_kernels(self, kernels: Kernels) -> bool:
        self.cpu_kernels = kernels.dense_bf16 if self.act in KERNEL_ACTIVATIONS else None
        return self.cpu_kernels is not None

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """``meta``: the step's metadata (its ``kernel_rows`` choose the linears' kernels)."""
        rows = meta.kernel_rows if meta is not None else 0
        gate_up = self.gate_up_proj(x, rows)
        if self.cpu_kernels is not None and gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2:
            return self.down_proj(act_mul_bf16(self.cpu_kernels, gate_up, self.act), rows)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(_ACTIVATIONS[self.act](gate) * up, rows)


class DecoderLayer(nn.Module):
    #: The norms' class (every norm of the layer, the q/k norms included).
    norm_cls: type[RMSNorm] = RMSNorm

    def __init__(
        self, config: Any, rotary: RotaryEmbedding, qk_norm: bool, biases: tuple[bool, bool],
        mlp: nn.Module | None = None,
    ) -> None:
        """``mlp``: the feed-forward block when it is not the dense one (an MoE layer)."""
        super().__init__()
        self.self_attn = DecoderAttention(config, rotary, qk_norm, biases,
                                          norm_cls=self.norm_cls)
        self.mlp = mlp if mlp is not None else DecoderMLP(config)
        self.input_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, config.rms_norm_eps)

    def norms(self) -> tuple[RMSNorm, RMSNorm, RMSNorm | None, RMSNorm | None]:
        """The layer's norms by role, as forward and the CPU decode program run them: (before
        attention, before the MLP (it adds the residual), on the attention's output, on the
        MLP's output; None: the layer has none there)."""
        return self.input_layernorm, self.post_attention_layernorm, None, None

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In a sequence-parallel step ``hidden`` and ``residual`` are this rank's rows: the
        # norms run on them, attention and the MLP on every row (gathered), and their
        # row-parallel outputs come back reduce-scattered to this rank's rows.
        # In a sequence-parallel step ``hidden`` and ``residual`` are this rank's rows: the
        # norms run on them, attention and the MLP on every row (gathered), and their
        # row-parallel outputs come back reduce-scattered to this rank's rows. ``hidden`` is
        # the previous layer's output, not yet in the residual stream (this layer's first norm,
        # or the final norm, adds it); norms on the sublayers' outputs (Gemma's sandwich) apply
        # before they join it.
        before_attn, before_mlp, attn_out, mlp_out = self.norms()
        if residual is None:
            residual = hidden
            hidden = before_attn(hidden)
        else:
            hidden, residual = before_attn(hidden, residual)
        hidden = self.self_attn(positions, gather_tokens(hidden), kv_cache, meta)
        if attn_out is not None:
            hidden = attn_out(hidden)
        hidden, residual = before_mlp(hidden, residual)
        hidden = self.mlp(gather_tokens(hidden), meta)
        return (hidden if mlp_out is None else mlp_out(hidden)), residual


class DecoderModel(nn.Module):
    def __init__(
        self, config: Any, qk_norm: bool, biases: tuple[bool, bool],
        mlp_factory: Callable[[int], nn.Module | None] | None = None,
        layer_cls: type[DecoderLayer] = DecoderLayer, embed_scale: float | None = None,
    ) -> None:
        """``mlp_factory(layer_index)``: a layer's feed-forward block, None for the dense one
        (MoE models choose per layer). ``layer_cls``: the layers' class (Gemma's sandwich
        norms). ``embed_scale``: a factor on the token embeddings (Gemma: sqrt(hidden)), applied
        in the activations' dtype as HF does."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = embed_scale
        # One rotary table per layer type (Gemma 3: local layers rotate with another base).
        layer_types = getattr(config, "layer_types", None) or []
        rotaries: dict[str | None, RotaryEmbedding] = {}

        def rotary_of(i: int) -> RotaryEmbedding:
            kind = layer_types[i] if i < len(layer_types) else None
            if kind not in rotaries:
                rotaries[kind] = RotaryEmbedding(head_dim_of(config),
                                                 config.max_position_embeddings,
                                                 rope_parameters_of(config, kind))
            return rotaries[kind]

        self.layers = nn.ModuleList(
            layer_cls(config, rotary_of(i), qk_norm, biases,
                      mlp_factory(i) if mlp_factory is not None else None)
            for i in range(config.num_hidden_layers)
        )
        self.norm = layer_cls.norm_cls(config.hidden_size, config.rms_norm_eps)
        self.tp_group = get_tp_group()
        #: Prefill steps in sequence-parallel layout (additional_config.sequence_parallel_prefill;
        #: only with several TP ranks).
        self.sequence_parallel = get_sequence_parallel() and self.tp_group.world_size > 1

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        is_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sp = self.sequence_parallel and not meta.is_decode
        with sequence_parallel(self.tp_group, input_ids.shape[0]) if sp else nullcontext():
            hidden = self.embed_tokens(input_ids)  # SP: reduce-scattered to this rank's rows
            if self.embed_scale is not None:
                hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype)
            if inputs_embeds is not None:
                # Prompt embeddings: rows that are not token ids take the given embedding.
                assert is_token_ids is not None
                hidden = torch.where(local_tokens(is_token_ids)[:, None], hidden,
                                     local_tokens(inputs_embeds).to(hidden.dtype))
            residual = None
            aux = []
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                if i in self.aux_hidden_state_layers:  # the layer's input: the residual stream
                    aux.append(hidden if residual is None else hidden + residual)
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
            hidden, _ = self.norm(hidden, residual)
            if aux:
                self.aux_hidden_states = gather_tokens(torch.cat(aux, dim=-1))
            return gather_tokens(hidden)

    #: EAGLE3 speculation: the layers whose inputs the draft head reads; each forward leaves
    #: them concatenated in ``aux_hidden_states`` ([T, len(layers) * hidden]).
    aux_hidden_state_layers: tuple[int, ...] = ()
    aux_hidden_states: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """Also serves MistralForCausalLM; subclasses switch on Qwen's differences."""

    qk_norm = False
    supports_tensor_parallel = True
    #: The decoder layers' class (gemma3.py's has sandwich norms).
    layer_cls: type[DecoderLayer] = DecoderLayer

    # checkpoint name fragment -> (fused parameter fragment, shard id)
    stacked_params = (
        (".q_proj", ".qkv_proj", "q"),
        (".k_proj", ".qkv_proj", "k"),
        (".v_proj", ".qkv_proj", "v"),
        (".gate_proj", ".gate_up_proj", 0),
        (".up_proj", ".gate_up_proj", 1),
    )

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.qk_norm, self._biases(config), self._mlp_factory(),
                                  self.layer_cls, self._embed_scale(config))
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.sliding_window = self._sliding_window(config, i)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.tp_size = get_tp_group().world_size
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        if self.tie_word_embeddings:
            # One shared parameter (named_parameters reports it once, as the embedding), so the
            # head is an ordinary linear layer that can be packed like the others.
            self.lm_head.weight = self.model.embed_tokens.weight

    def _biases(self, config: Any) -> tuple[bool, bool]:
        """(bias on q/k/v, bias on o_proj)."""
        bias = bool(getattr(config, "attention_bias", False))
        return bias, bias

    def _sliding_window(self, config: Any, layer: int) -> int | None:
        """Layer ``layer``'s attention window (None: the whole context)."""
        return None

    def _embed_scale(self, config: Any) -> float | None:
        return None

    def _mlp_factory(self) -> Callable[[int], nn.Module | None] | None:
        """Per-layer feed-forward blocks (None: every layer dense); MoE models override."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        is_token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds`` [T, H] / ``is_token_ids`` [T]: a step with prompt embeddings
        (engine/prompt_embeds.py); given together or not at all."""
        return self.model(input_ids, positions, kv_caches, meta, inputs_embeds, is_token_ids)

    def compute_logits(self, hidden: torch.Tensor, kernel_rows: int = 0) -> torch.Tensor:
        """Logits over the whole vocabulary (gathered from the shards under TP).
        ``kernel_rows``: the rows the head chooses its kernel by (0: ``hidden``'s own)."""
        return self.lm_head.gather(self.lm_head(hidden, kernel_rows))

    def greedy_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """argmax of ``compute_logits(hidden)`` without gathering the logits (TP)."""
        return self.lm_head.greedy(self.lm_head(hidden))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the set of parameter names that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.endswith((".k_scale", ".v_scale")):
                self._load_kv_scale(name, tensor)
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # tied: the embedding is the head
            for ckpt_part, ours in self.checkpoint_renames:
                name = name.replace(ckpt_part, ours)
            expert_target = self._load_expert_weight(params, name, tensor)
            if expert_target is not None:
                loaded.add(expert_target)
                continue
            loaded.add(load_into(params, name, tensor, self.stacked_params))
        missing = set(params) - loaded
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded


    #: (checkpoint name fragment, ours) applied before a name is matched (Mixtral's MoE block).
    checkpoint_renames: tuple[tuple[str, str], ...] = ()

    def _load_expert_weight(
        self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor
    ) -> str | None:
        """MoE models load their expert tensors here; returns the filled parameter's name,
        or None when ``name`` is not an expert tensor (dense models: never)."""
        return None

    def _load_kv_scale(self, name: str, tensor: torch.Tensor) -> None:
        """FP8 KV scales stored in the checkpoint (vLLM's `...self_attn.k_scale` names)."""
        layer_idx = int(name.split("layers.")[1].split(".")[0])
        scales = self.model.layers[layer_idx].self_attn.kv_scales
        setattr(scales, name.rsplit(".", 1)[1], float(tensor.float().max()))
        self.kv_scales_from_checkpoint = True

    kv_scales_from_checkpoint = False


class MistralForCausalLM(LlamaForCausalLM):
    def _sliding_window(self, config: Any, layer: int) -> int | None:
        return getattr(config, "sliding_window", None)


class Qwen2ForCausalLM(LlamaForCausalLM):
    def _biases(self, config: Any) -> tuple[bool, bool]:
        return True, False

    def _sliding_window(self, config: Any, layer: int) -> int | None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("Qwen sliding-window attention (use_sliding_window) is not supported")
        return None


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    qk_norm = True

    def _biases(self, config: Any) -> tuple[bool, bool]:
        return LlamaForCausalLM._biases(self, config)
