"""Vocab-parallel embedding and LM head, and the greedy argmax over vocab shards (spec §1).

Rank r holds vocab rows [r*Vp, (r+1)*Vp) with ``Vp = ceil(V / TP)``; the last shard's rows past
V are padding (zeros in the table, never a token, never an argmax). The embedding looks up the
tokens in its shard, gives zero rows for the others and all-reduces; the head computes its
shard's logits, which are all-gathered only when someone needs the full vocabulary (sampling
with processors, logprobs). In a group of one rank both are the plain layers.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ingot.distributed.group import GroupCoordinator
from ingot.distributed.parallel_state import get_tp_group
from ingot.distributed.sequence_parallel import reduce_partial
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import QuantKernels, quant_dequantize_rows
from ingot.model_executor.layers.linear import LinearBase, default_weight_loader
from ingot.model_executor.layers.quantized import (
    QuantizedWeight,
    keep_quantized,
    packed_weight,
    quantized_parts,
)


def vocab_shard_range(vocab_size: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(first token id, padded shard size, real rows) of a rank's vocab shard."""
    per = -(-vocab_size // tp)
    start = rank * per
    return start, per, max(0, min(per, vocab_size - start))


def _load_vocab_shard(param: nn.Parameter, loaded: torch.Tensor | QuantizedWeight, start: int,
                      real: int) -> None:
    if isinstance(loaded, QuantizedWeight):  # the shard's rows, zero blocks past the vocab
        if loaded.in_features != param.shape[1]:
            raise ValueError(f"a {loaded.qtype} checkpoint tensor of rows of "
                             f"{loaded.in_features}, the model expects rows of {param.shape[1]}")
        keep_quantized(param, loaded.row_slice(start, real, param.shape[0]))
        return
    if param.shape[1:] != loaded.shape[1:]:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model "
                         f"expects rows of {tuple(param.shape[1:])}")
    param.data[:real].copy_(loaded[start : start + real])
    param.data[real:].zero_()


class VocabParallelEmbedding(KernelBindable, nn.Embedding):
    """A table the loader kept quantized (GGUF, layers/quantized.py) is looked up from its
    packed blocks, the looked-up rows dequantized (the float table is never resident); tied to
    the LM head, both read the one packed copy."""

    streamed_weights = ("quant_weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tp_group: GroupCoordinator | None = None) -> None:
        self.tp_group = tp_group if tp_group is not None else get_tp_group()
        self.tp_size = self.tp_group.world_size
        self.vocab_size = num_embeddings
        self.vocab_start, per, self.num_real = vocab_shard_range(
            num_embeddings, self.tp_size, self.tp_group.rank_in_group)
        super().__init__(per if self.tp_size > 1 else num_embeddings, embedding_dim)
        self.weight.requires_grad_(False)
        self.weight.weight_loader = (default_weight_loader if self.tp_size == 1
                                     else self._load_weight)
        self.quant_weight: torch.Tensor | None = None
        self.quant_type: str | None = None
        self.quant_kernels: QuantKernels | None = None

    def bind_kernels(self, kernels: Kernels) -> bool:
        parts = quantized_parts(self.weight)
        if parts is not None:
            if kernels.quant is None:
                raise RuntimeError(
                    "this model's embedding was kept quantized but ingot's quantized CPU "
                    "kernels are not available here (see the log); load it with "
                    "--quantization none")
            self.quant_kernels = kernels.quant
            self.quant_weight, self.quant_type = packed_weight(parts)
        return False  # torch ops for a plain table

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _load_vocab_shard(param, loaded, self.vocab_start, self.num_real)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if self.quant_weight is not None:
                return quant_dequantize_rows(self.quant_kernels, self.quant_weight,
                                             self.quant_type, input_ids, self.weight.dtype)
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_real)
        if self.quant_weight is not None:  # this rank's vocab shard of the packed blocks
            out = quant_dequantize_rows(self.quant_kernels, self.quant_weight, self.quant_type,
                                        local.masked_fill(outside, 0), self.weight.dtype)
        else:
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return reduce_partial(out, self.tp_group)  # SP prefill: this rank's rows


class ParallelLMHead(LinearBase):
    """``forward`` gives this rank's shard of the logits [.., Vp]; ``gather`` the full
    [.., V]; ``greedy`` the argmax over the whole vocabulary without gathering the logits."""

    def __init__(self, hidden_size: int, vocab_size: int, bias: bool = False,
                 tp_group: GroupCoordinator | None = None) -> None:
        self.tp_group = tp_group if tp_group is not None else get_tp_group()
        self.tp_size = self.tp_group.world_size
        self.vocab_size = vocab_size
        self.vocab_start, per, self.num_real = vocab_shard_range(
            vocab_size, self.tp_size, self.tp_group.rank_in_group)
        super().__init__(hidden_size, per if self.tp_size > 1 else vocab_size, bias)
        loader = default_weight_loader if self.tp_size == 1 else self._load_weight
        self.weight.weight_loader = loader
        if self.bias is not None:
            self.bias.weight_loader = loader

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:
            param.data[: self.num_real].copy_(loaded[self.vocab_start : self.vocab_start
                                                     + self.num_real])
            param.data[self.num_real :].zero_()
            return
        _load_vocab_shard(param, loaded, self.vocab_start, self.num_real)

    def gather(self, local_logits: torch.Tensor) -> torch.Tensor:
        """The full logits [.., V] on every rank, from every rank's shard."""
        if self.tp_size == 1:
            return local_logits
        return self.tp_group.all_gather(local_logits, dim=-1)[..., : self.vocab_size]

    def greedy(self, local_logits: torch.Tensor) -> torch.Tensor:
        """Token ids [B] (int64) of the largest logit over every shard; same on every rank."""
        return distributed_argmax(local_logits[..., : self.num_real], self.vocab_start,
                                  self.tp_group)


def distributed_argmax(local_logits: torch.Tensor, vocab_start: int,
                       group: GroupCoordinator) -> torch.Tensor:
    """argmax over vocab shards without gathering the logits: each rank's (max, index) pair is
    gathered (float64 holds both exactly) and the largest value wins; on a tie the lowest token
    id, as ``torch.argmax`` of the full logits picks the first maximum. [B, Vr] -> [B] int64.

    A rank with no real vocab rows (tiny vocab, many ranks) offers -inf."""
    rows = local_logits.shape[0]
    if local_logits.shape[-1] == 0:
        value = torch.full((rows,), float("-inf"), dtype=torch.float64,
                           device=local_logits.device)
        index = torch.zeros(rows, dtype=torch.float64, device=local_logits.device)
    else:
        idx = local_logits.argmax(dim=-1)  # the first maximum
        best = local_logits.gather(-1, idx.unsqueeze(-1)).squeeze(-1)
        value, index = best.double(), (idx + vocab_start).double()
    if group.world_size == 1:
        return index.to(torch.int64)
    pairs = group.all_gather(torch.stack([value, index], dim=-1).unsqueeze(0), dim=0)
    # pairs [world, B, 2]: shards are in vocab order, so the first maximum over ranks is the
    # lowest token id among equal values.
    winner = pairs[..., 0].argmax(dim=0)
    return pairs[..., 1].gather(0, winner.unsqueeze(0)).squeeze(0).to(torch.int64)
