"""Mixture-of-experts layer: a replicated router, top-k routing, and every local expert's
SiLU-gated MLP computed over the tokens routed to it (grouped by expert: one sort, then one
pair of matmuls per expert that has tokens; no Python loop over tokens).

Weights are stacked per layer: ``w13`` [E_L, 2 * I_L, H] (gate rows then up rows) and ``w2``
[E_L, H, I_L]. Their loaders take the checkpoint's per-expert tensors (shard id 0 gate, 1 up,
2 down, plus the expert id) or HF's fused [E, 2I, H] / [E, H, I] tensors.

Parallelism over the TP group of W ranks (spec §1 and §3):
- Without EP (``ep_size`` 1), every rank holds every expert's slice of the intermediate dim:
  gate-up column-split, down row-split (I_L = I / W).
- With EP of degree D, rank r is in partition ``r // (W / D)`` and holds the whole experts of
  that contiguous block (E_L = E / D), their intermediate dim split over the W / D ranks of the
  partition (index ``r % (W / D)``).
In both cases the router is replicated, a token's contribution on a rank that holds none of
its experts is exactly zero, and one all-reduce over the TP group sums expert and intermediate
partials alike.

Cross-DP EP (a ``dp_group`` of D_P > 1 replicas, ``ep_size`` = TP x D_P): the experts spread
over every rank of every replica (position ``dp_rank * TP + tp_rank``, whole experts each).
A step all-gathers the replicas' tokens over the DP group, computes the local experts on all
of them, all-reduces over TP and reduce-scatters over DP, so each replica gets back exactly
its own tokens' output. Every replica must bring the same token count (the DP padding,
distributed/data_parallel.py).

The experts run in one C call (cpu_kernels.c, ``fused_moe``) where ingot's CPU kernels apply:
on CPU, bfloat16 or float32 weights, the kernels built (decided once per layer at load time by
:func:`~ingot.model_executor.binding.bind`; MoE models never compile). It takes the local expert
shard and the first local expert's global id, so TP and EP partials are the same as the torch
path's.
Elsewhere (CUDA, other dtypes, ``INGOT_CPU_KERNELS=0``) the torch path below runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn import functional as F

from ingot.distributed.group import GroupCoordinator
from ingot.distributed.layouts import ep_rank_of, local_expert_range
from ingot.distributed.parallel_state import get_tp_group
from ingot.distributed.sequence_parallel import reduce_partial
from ingot.model_executor.layers.bindable import KernelBindable, Kernels
from ingot.model_executor.layers.cpu_kernels import (
    CpuKernels,
    fused_moe,
    pack_moe_weights,
)
from ingot.model_executor.layers.linear import (
    ReplicatedLinear,
    shard_of,
    sharding_weight_loader,
)

if TYPE_CHECKING:
    from ingot.model_executor.layers.attention import AttentionMetadata


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] float32, expert ids [T, k]): softmax over all experts in float32, the
    top k, renormalised to sum 1 when ``renormalize`` (Mixtral always; Qwen3-MoE iff
    ``norm_topk_prob``). Renormalised, this equals a softmax over the top-k logits."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_parallel_placement(num_experts: int, tp_size: int, tp_rank: int, ep_size: int,
                              ) -> tuple[range, int, int]:
    """(this rank's experts, its intermediate shard index, shard count) for EP degree
    ``ep_size`` inside a TP group of ``tp_size`` (``ep_size`` 1: no EP, all experts)."""
    ep_rank = ep_rank_of(tp_rank, tp_size, ep_size)
    shards = tp_size // ep_size
    return local_expert_range(num_experts, ep_size, ep_rank), tp_rank % shards, shards


def expert_parallel_weight_loader(local_experts: range, loader: Callable[..., None],
                                  expert_dim: int = 0) -> Callable[..., None]:
    """Wrap ``loader(param, tensor, *rest)`` so that it sees only this rank's experts: the
    rows ``local_experts`` of a stacked checkpoint tensor along ``expert_dim`` (spec §3). The
    wrapped loader's own shard (TP) is then taken from those rows, i.e. after the EP
    selection."""

    def load(param: nn.Parameter, loaded: torch.Tensor, *rest: Any) -> None:
        if loaded.shape[expert_dim] < local_experts.stop:
            raise ValueError(f"stacked expert tensor of shape {tuple(loaded.shape)} has no "
                             f"experts {local_experts.start}..{local_experts.stop - 1}")
        loader(param, loaded.narrow(expert_dim, local_experts.start, len(local_experts)), *rest)

    return load


class FusedMoE(KernelBindable, nn.Module):
    """Router + this rank's experts (see the module docstring for the layouts); forward
    returns the full MoE output on every rank."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp_group: GroupCoordinator | None = None,
                 ep_size: int = 1, dp_group: GroupCoordinator | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group if tp_group is not None else get_tp_group()
        tp, rank = self.tp_group.world_size, self.tp_group.rank_in_group
        # Cross-DP EP: the EP world is every rank of every replica.
        self.dp_group = dp_group if dp_group is not None and dp_group.world_size > 1 else None
        if self.dp_group is not None:
            dp = self.dp_group.world_size
            if ep_size != tp * dp:
                raise ValueError(f"cross-DP expert parallelism needs ep_degree == TP x DP "
                                 f"({tp * dp}), got {ep_size}")
            tp, rank = tp * dp, self.dp_group.rank_in_group * tp + rank
        experts, self.shard_index, self.num_shards = expert_parallel_placement(
            num_experts, tp, rank, ep_size)
        if intermediate_size % self.num_shards:
            raise ValueError(f"moe intermediate size {intermediate_size} does not split over "
                             f"{self.num_shards} ranks")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.expert_start, self.num_local_experts = experts.start, len(experts)
        self.ep_size = ep_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # the checkpoint's (all shards)
        inter = intermediate_size // self.num_shards
        self.local_intermediate = inter
        # The router: every rank computes every expert's affinity (spec §3).
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.w13 = nn.Parameter(torch.empty(len(experts), 2 * inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(len(experts), hidden_size, inter),
                               requires_grad=False)
        self.w13.weight_loader = self._load_w13
        self.w2.weight_loader = self._load_w2
        # (expert, shard id) pieces seen by the loaders, every expert's (the model loader
        # marks a stacked parameter loaded at its first piece, so completeness is checked here).
        self.loaded_pieces: set[tuple[int, int]] = set()
        # ingot's fused expert kernel, once bound (bind_kernels); None: the torch path.
        self.cpu_kernels: CpuKernels | None = None
        # The weights it reads: (w13, w2) in float32, their packed copies in bf16 (then the
        # plain ones are released, as packed linears do: nothing reads them any more).
        self.kernel_weights: tuple[torch.Tensor, torch.Tensor] | None = None

    def bind_kernels(self, kernels: Kernels) -> bool:
        """Use the bf16 library's fused expert computation from now on where it applies to
        these weights (CPU; float32, or bfloat16 with even hidden and intermediate sizes;
        contiguous); returns whether it does. Binding bf16 weights packs them and frees the
        plain copy."""
        lib = kernels.bf16
        if self.kernel_weights is not None:  # already bound (and maybe packed)
            self.cpu_kernels = lib or self.cpu_kernels
            return True
        w13, w2 = self.w13.data, self.w2.data
        applies = (lib is not None and w13.device.type == "cpu" and w2.dtype == w13.dtype
                   and w13.is_contiguous() and w2.is_contiguous()
                   and (w13.dtype == torch.float32
                        or (w13.dtype == torch.bfloat16 and self.hidden_size % 2 == 0
                            and self.local_intermediate % 2 == 0)))
        self.cpu_kernels = lib if applies else None
        if not applies:
            return False
        if w13.dtype == torch.bfloat16:
            self.kernel_weights = pack_moe_weights(lib, w13, w2)
            self.w13.data, self.w2.data = w13.new_empty(0), w2.new_empty(0)
        else:
            self.kernel_weights = (self.w13, self.w2)
        return True

    def missing_pieces(self) -> list[tuple[int, str]]:
        """(expert, projection) pairs no checkpoint tensor has filled."""
        names = ("gate", "up", "down")
        return [(e, names[s]) for e in range(self.num_experts) for s in range(3)
                if (e, s) not in self.loaded_pieces]

    # ---- loading ------------------------------------------------------------------------------

    def _local(self, expert_id: int) -> int | None:
        """The expert's index on this rank, None when another EP partition holds it."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert_id}; the model has "
                             f"{self.num_experts} experts")
        local = expert_id - self.expert_start
        return local if 0 <= local < self.num_local_experts else None

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor,
                  shard_id: int | None = None, expert_id: int | None = None) -> None:
        """Per-expert gate (shard 0) or up (shard 1) [I, H]; or HF's fused [E, 2I, H]."""
        if expert_id is None:  # fused: every expert, gate rows then up rows
            full = 2 * self.intermediate_size
            if loaded.shape != (self.num_experts, full, self.hidden_size):
                raise ValueError(f"fused gate-up tensor has shape {tuple(loaded.shape)}, "
                                 f"expected {(self.num_experts, full, self.hidden_size)}")
            self._ep_loader(self._load_stacked_w13)(param, loaded)
            self.loaded_pieces.update((e, s) for e in range(self.num_experts) for s in (0, 1))
            return
        self.loaded_pieces.add((expert_id, int(shard_id)))
        local = self._local(expert_id)
        if local is None:
            return  # another EP partition's expert
        if loaded.shape != (self.intermediate_size, self.hidden_size):
            raise ValueError(f"expert {expert_id} gate/up tensor has shape "
                             f"{tuple(loaded.shape)}, expected "
                             f"{(self.intermediate_size, self.hidden_size)}")
        inter = self.local_intermediate
        rows = param.data[local].narrow(0, int(shard_id) * inter, inter)
        rows.copy_(shard_of(loaded, 0, self.shard_index, self.num_shards))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor,
                 shard_id: int | None = None, expert_id: int | None = None) -> None:
        """Per-expert down [H, I]; or HF's fused [E, H, I]."""
        if expert_id is None:  # fused [E, H, I]: the local experts, then the TP shard of I
            if loaded.shape != (self.num_experts, self.hidden_size, self.intermediate_size):
                raise ValueError(f"fused down tensor has shape {tuple(loaded.shape)}, expected "
                                 f"{(self.num_experts, self.hidden_size, self.intermediate_size)}")
            self._ep_loader(sharding_weight_loader(2, self.shard_index, self.num_shards))(
                param, loaded)
            self.loaded_pieces.update((e, 2) for e in range(self.num_experts))
            return
        self.loaded_pieces.add((expert_id, 2))
        local = self._local(expert_id)
        if local is None:
            return
        if loaded.shape != (self.hidden_size, self.intermediate_size):
            raise ValueError(f"expert {expert_id} down tensor has shape {tuple(loaded.shape)}, "
                             f"expected {(self.hidden_size, self.intermediate_size)}")
        param.data[local].copy_(shard_of(loaded, 1, self.shard_index, self.num_shards))

    def _ep_loader(self, loader: Callable[..., None]) -> Callable[..., None]:
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        return expert_parallel_weight_loader(experts, loader, expert_dim=0)

    def _load_stacked_w13(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """[E_L, 2I, H] of the local experts: the TP shard of the gate and of the up rows."""
        gate, up = loaded.split(self.intermediate_size, dim=1)
        param.data.copy_(torch.cat([shard_of(gate, 1, self.shard_index, self.num_shards),
                                    shard_of(up, 1, self.shard_index, self.num_shards)], dim=1))

    # ---- forward ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, meta: AttentionMetadata | None = None) -> torch.Tensor:
        """``meta``: the step's metadata (its ``kernel_rows`` choose the router's kernel)."""
        if self.dp_group is not None:  # every replica's tokens, in DP rank order
            x = self.dp_group.all_gather(x, dim=0)
        router_logits = self.gate(x, meta.kernel_rows if meta is not None else 0)
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.dp_group is None:
            # All-reduced; in a sequence-parallel prefill reduce-scattered to this rank's rows.
            return reduce_partial(out, self.tp_group)
        if self.tp_group.world_size > 1:
            self.tp_group.all_reduce(out)
        return self.dp_group.reduce_scatter(out, dim=0)  # the sum over replicas, our rows

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum over its experts (and its intermediate slice) of
        ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``; rows of tokens routed to no local
        expert stay exactly zero."""
        if self.cpu_kernels is not None and self.kernel_weights is not None:
            return fused_moe(self.cpu_kernels, x, weights, ids, *self.kernel_weights,
                             self.expert_start, self.num_local_experts, self.local_intermediate)
        return self.experts_torch(x, weights, ids)

    def experts_torch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      ) -> torch.Tensor:
        """:meth:`experts` in torch ops (any device and dtype): grouped by expert."""
        num_tokens, k = ids.shape
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        # Group the (token, slot) assignments by expert: a stable sort keeps token order.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        start, n_local = self.expert_start, self.num_local_experts
        # The local experts' assignments are one contiguous run of the sorted order.
        counts = counts.tolist()  # one host sync per layer (segment bounds)
        begin = sum(counts[:start])
        local_counts = counts[start : start + n_local]
        total = sum(local_counts)
        if total == 0:
            return out
        sel = order[begin : begin + total]
        tokens = sel // k
        xs = x[tokens]
        scale = weights.reshape(-1)[sel]
        ys = torch.empty_like(xs)
        inter = self.local_intermediate
        offset = 0
        for e, n in enumerate(local_counts):
            if n == 0:
                continue
            seg = slice(offset, offset + n)
            gate_up = F.linear(xs[seg], self.w13[e])
            act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            ys[seg] = F.linear(act, self.w2[e])
            offset += n
        # Scale in float32 (the routing weights' dtype), as HF does, then accumulate.
        ys = (ys.float() * scale[:, None]).to(x.dtype)
        out.index_add_(0, tokens, ys)
        return out
