"""GroupCoordinator: one process group and its collectives, over torch.distributed (gloo on
CPU, NCCL on CUDA). Every collective the model uses goes through here, so a backend that lacks
one (gloo: no ``reduce_scatter`` in older releases, no ``all_to_all``) gets a fallback in one
place. A group of one rank needs no process group at all: every collective is the identity.

It is also the one owner of *which path* a collective takes: with a shared-memory segment
(``enable_shm``, every rank on this host, shm_comm.py) the CPU collectives go through it, and
whatever it does not take (other devices, dtypes, a gather larger than a slot) goes to
torch.distributed. The choice depends only on the tensor's shape, dtype and device, which every
rank has alike, so the ranks always take the same path.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ingot.distributed.shm_comm import ShmCommunicator


class GroupCoordinator:
    def __init__(self, ranks: list[int], rank: int, device_group: dist.ProcessGroup | None,
                 backend: str = "gloo") -> None:
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not in the group {ranks}")
        self.ranks = list(ranks)
        self.rank = rank  # global rank
        self.world_size = len(ranks)
        self.rank_in_group = self.ranks.index(rank)
        self.device_group = device_group
        self.backend = backend
        if self.world_size > 1 and device_group is None:
            raise ValueError("a group of several ranks needs a process group")
        self.shm: ShmCommunicator | None = None

    def enable_shm(self, slot_bytes: int | None = None, timeout_s: float = 600.0,
                   node: int = 0) -> bool:
        """Set up the shared-memory path (a collective: every rank of the group calls it);
        returns whether it is on, the same on every rank. ``node``: this rank's node index
        (--node-rank); ranks of several nodes keep to torch.distributed."""
        if self.world_size > 1 and self.shm is None:
            self.shm = ShmCommunicator.create(self.device_group, self.ranks, self.rank_in_group,
                                              self.backend, slot_bytes, timeout_s, node)
        return self.shm is not None

    def _shm_for(self, x: torch.Tensor) -> ShmCommunicator | None:
        shm = self.shm
        return shm if shm is not None and shm.takes(x) else None

    @classmethod
    def single(cls) -> GroupCoordinator:
        """The group of this process alone (TP = 1): no collectives happen."""
        return cls([0], 0, None)

    def __repr__(self) -> str:
        return f"GroupCoordinator(ranks={self.ranks}, rank_in_group={self.rank_in_group})"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place; returns ``x``."""
        if self.world_size > 1:
            shm = self._shm_for(x)
            if shm is not None:
                return shm.all_reduce(x)
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim``, in group order."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        shm = self._shm_for(x)
        if shm is not None and (out := shm.all_gather(x, dim)) is not None:
            return out
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x, group=self.device_group)
        return torch.cat(parts, dim=dim)

    def _chunk(self, op: str, x: torch.Tensor, dim: int) -> int:
        """Each rank's share of ``x`` along ``dim`` (which must split evenly)."""
        size = x.shape[dim]
        if size % self.world_size:
            raise ValueError(f"{op}: dim {dim} of size {size} is not divisible by the group's "
                             f"{self.world_size} ranks")
        return size // self.world_size

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's chunk of the group sum along ``dim`` (all-reduce + narrow: gloo's
        reduce_scatter is missing in older torch releases)."""
        if self.world_size == 1:
            return x
        chunk = self._chunk("reduce_scatter", x, dim)
        shm = self._shm_for(x)
        if dim == 0 and shm is not None and (out := shm.reduce_scatter(x)) is not None:
            return out
        total = self.all_reduce(x.clone())
        return total.narrow(dim, self.rank_in_group * chunk, chunk).contiguous()

    def all_to_all(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Chunk j of ``x`` along ``dim`` goes to rank j; returns the chunks this rank
        received, concatenated in sender order (all-gather + select: gloo has no all_to_all)."""
        if self.world_size == 1:
            return x
        chunk = self._chunk("all_to_all", x, dim)
        gathered = self.all_gather(x.unsqueeze(0), dim=0)  # [world, ...]
        mine = gathered.narrow(dim + 1, self.rank_in_group * chunk, chunk)
        return torch.cat(list(mine.unbind(0)), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``x`` from the group's rank ``src`` (group-local), in place; returns ``x``."""
        if self.world_size > 1:
            shm = self._shm_for(x)
            if shm is None or not shm.broadcast(x, src):
                dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            if self.shm is not None:
                self.shm.barrier()
            else:
                dist.barrier(group=self.device_group)
