"""BERT encoders: ``BertModel`` (embedders such as all-MiniLM-L6-v2) and
``BertForSequenceClassification`` (cross-encoder rerankers).

Encoder-only: attention is bidirectional within each request (layers/attention.py,
``encoder_attention``), positions are absolute (learned table), and a request's whole prompt
runs in one prefill step; the KV cache is never read or written. The forward has the decoder
models' signature so the runner, buckets and packed prefill serve both.

Token type ids (segment A / B of a cross-encoder pair) travel inside the input ids, as in vLLM:
``id | type << TOKEN_TYPE_SHIFT`` (``encode_token_type_ids``). The scheduler, the step contract
and the runner then carry them without knowing they exist; only the embedding layer splits
them apart again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from ingot.model_executor.layers.attention import AttentionMetadata, encoder_attention
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import (
    F32Kernels,
    add_layernorm_f32,
    bias_gelu_f32_,
)
from ingot.model_executor.layers.linear import QKVLinear, ReplicatedLinear, default_weight_loader

# Vocabularies are far below 2**30; the type sits above every token id (vLLM's constant).
TOKEN_TYPE_SHIFT = 30
_TOKEN_MASK = (1 << TOKEN_TYPE_SHIFT) - 1

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def encode_token_type_ids(token_ids: list[int], token_type_ids: list[int]) -> list[int]:
    """Pack each token's type into its id (see the module docstring)."""
    if len(token_ids) != len(token_type_ids):
        raise ValueError("token_type_ids must have one entry per token")
    return [t | (tt << TOKEN_TYPE_SHIFT) for t, tt in zip(token_ids, token_type_ids, strict=True)]


def _loaded(param: nn.Parameter) -> nn.Parameter:
    param.requires_grad_(False)
    param.weight_loader = default_weight_loader
    return param


def _layer_norm(size: int, eps: float) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps)
    _loaded(norm.weight)
    _loaded(norm.bias)
    return norm


class _FusedEpilogue(KernelBindable, nn.Module):
    """A BERT block whose linear can run without its bias (``LinearBase.matmul``) and hand the bias to
    one of ingot's fp32 CPU kernels with what follows it (GELU, or the residual add and
    LayerNorm): torch's addmm would first copy the bias into the output, then the add, the norm
    and GELU would each sweep the activations again. Measured at one thread: those passes were
    ~15% of an encoder step, beside ~80% in the GEMMs. Whether the kernels apply is decided
    once, at binding (after this block's linear packed), from the weights this block holds."""

    cpu_kernels: F32Kernels | None = None

    def bind_kernels(self, kernels: Kernels) -> bool:
        weight = self._kernel_weight()
        lib = kernels.f32
        applies = (lib is not None and weight.dtype == torch.float32
                   and weight.device.type == "cpu" and self._kernel_applies())
        self.cpu_kernels = lib if applies else None
        return applies

    def _kernel_weight(self) -> torch.Tensor:
        return self.dense.weight

    def _kernel_applies(self) -> bool:
        # dense.matmul runs a plain or a float32 oneDNN-packed weight (not bf16 oneDNN's:
        # oneDNN fuses the bias there, and the weight dtype check above leaves those out)
        return self.dense.weight.numel() > 0 or self.dense.packed_weight is not None


def _add_norm(kernels: F32Kernels, x: torch.Tensor, bias: torch.Tensor | None,
              residual: torch.Tensor | None, norm: nn.LayerNorm) -> torch.Tensor:
    """``norm(x + bias + residual)``, in place in x."""
    return add_layernorm_f32(kernels, x, bias, residual, norm.weight, norm.bias, norm.eps, out=x)


class BertEmbeddings(_FusedEpilogue):
    def __init__(self, config: Any) -> None:
        super().__init__()
        kind = getattr(config, "position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"BERT position_embedding_type {kind!r} is not supported; only 'absolute' is")
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        for emb in (self.word_embeddings, self.position_embeddings, self.token_type_embeddings):
            _loaded(emb.weight)
        self.LayerNorm = _layer_norm(config.hidden_size, config.layer_norm_eps)

    def _kernel_weight(self) -> torch.Tensor:
        return self.word_embeddings.weight

    def _kernel_applies(self) -> bool:
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        token_types = input_ids >> TOKEN_TYPE_SHIFT
        ids = input_ids & _TOKEN_MASK
        hidden = self.word_embeddings(ids) + self.position_embeddings(positions)
        if self.cpu_kernels is not None:
            return _add_norm(self.cpu_kernels, hidden, None,
                             self.token_type_embeddings(token_types), self.LayerNorm)
        return self.LayerNorm(hidden + self.token_type_embeddings(token_types))


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVLinear(
            config.hidden_size, self.head_dim, self.num_heads, self.num_heads, bias=True
        )

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).chunk(3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        return encoder_attention(q.reshape(shape), k.reshape(shape), v.reshape(shape), meta, self.scale)


class BertOutput(_FusedEpilogue):
    """dense -> residual add -> LayerNorm (post-norm, as BERT)."""

    def __init__(self, in_size: int, config: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(in_size, config.hidden_size, bias=True)
        self.LayerNorm = _layer_norm(config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return _add_norm(self.cpu_kernels, self.dense.matmul(hidden),
                             self.dense.bias, residual, self.LayerNorm)
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertOutput(config.hidden_size, config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, meta), hidden)


class BertIntermediate(_FusedEpilogue):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.intermediate_size, bias=True)
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"BERT hidden_act {act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
        self.act = _ACTIVATIONS[act]
        self.exact_gelu = act == "gelu"  # the kernel's activation

    def _kernel_applies(self) -> bool:
        return self.exact_gelu and super()._kernel_applies()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.cpu_kernels is not None:
            return bias_gelu_f32_(self.cpu_kernels, self.dense.matmul(hidden),
                                  self.dense.bias)
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertPooler(nn.Module):
    """HF's pooler: dense + tanh on the [CLS] row (classifiers build on it)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(cls_hidden))


# checkpoint fragment -> (fused parameter fragment, shard id)
_STACKED = (
    (".attention.self.query.", ".attention.self.qkv_proj.", "q"),
    (".attention.self.key.", ".attention.self.qkv_proj.", "k"),
    (".attention.self.value.", ".attention.self.qkv_proj.", "v"),
)


class BertModel(nn.Module):
    """Returns the last hidden states [T, H]; the pooler (layers/pooler.py) turns them into one
    vector per request. ``pooler.*`` weights (HF's dense + tanh) are loaded when present but only
    used by the classifier."""

    is_encoder_only = True
    pooling_task = "embed"  # a pooling model by architecture: runs with --runner pooling
    default_pooling_type = "CLS"  # vLLM's default; sentence-transformers configs override it

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, meta)
        return hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; returns the parameter names filled. A checkpoint without the
        HF pooler (many embedders drop it) keeps it unset: only classifiers need it."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = self._param_name(name)
            if name is None:
                continue
            for ckpt_part, fused_part, shard in _STACKED:
                if ckpt_part in name:
                    target = name.replace(ckpt_part, fused_part)
                    params[target].weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                params[name].weight_loader(params[name], tensor)
                loaded.add(name)
        missing = {p for p in set(params) - loaded if not self._optional(p)}
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {sorted(missing)[:8]}")
        return loaded

    def _param_name(self, name: str) -> str | None:
        if name.endswith("position_ids"):  # a buffer of old checkpoints, not a weight
            return None
        return name.removeprefix("bert.")

    def _optional(self, param: str) -> bool:
        return param.startswith("pooler.")


class BertForSequenceClassification(nn.Module):
    """Cross-encoder: BERT, HF's pooler on [CLS], then a linear classifier. The engine pools the
    [CLS] hidden state and calls ``classify`` on it."""

    is_encoder_only = True
    pooling_task = "classify"
    default_pooling_type = "CLS"

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.num_labels = int(getattr(config, "num_labels", 2))
        self.bert = BertModel(config)
        self.classifier = ReplicatedLinear(config.hidden_size, self.num_labels, bias=True)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        return self.bert(input_ids, positions, kv_caches, meta)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, H] pooled ([CLS]) hidden states -> [N, num_labels] logits."""
        return self.classifier(self.bert.pooler(pooled))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        head: list[tuple[str, torch.Tensor]] = []

        def body() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if name.startswith("classifier."):
                    head.append((name, tensor))
                else:
                    yield name, tensor

        loaded = {f"bert.{n}" for n in self.bert.load_weights(body())}
        if "bert.pooler.dense.weight" not in loaded:
            raise ValueError("checkpoint is missing the BERT pooler (bert.pooler.dense.*)")
        params = dict(self.classifier.named_parameters())
        for name, tensor in head:
            part = name.removeprefix("classifier.")
            params[part].weight_loader(params[part], tensor)
            loaded.add(name)
        if {"classifier.weight", "classifier.bias"} - loaded:
            raise ValueError("checkpoint is missing the classifier (classifier.weight / .bias)")
        return loaded
