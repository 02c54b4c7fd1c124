"""A single-process "simulated group" (spec §0): the ranks of a TP group as threads of this
process, with collectives over shared memory. For fast unit tests of sharded modules: the
same module code as under torch.distributed, no processes to spawn. Sums run in rank order,
so every rank gets bit-identical results, as with a real all-reduce."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ingot.distributed.group import GroupCoordinator
from ingot.distributed.parallel_state import set_tp_group


class _Hub:
    def __init__(self, world_size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size)

    def exchange(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor
        self.barrier.wait()  # everyone has written
        parts = [t for t in self.slots if t is not None]
        self.barrier.wait()  # everyone has read: the slots may be reused
        return parts


class SimulatedGroup(GroupCoordinator):
    """One rank's view of a simulated group; build them with ``simulated_groups``."""

    def __init__(self, hub: _Hub, rank: int) -> None:
        self.hub = hub
        self.ranks = list(range(len(hub.slots)))
        self.rank = self.rank_in_group = rank
        self.world_size = len(self.ranks)
        self.device_group = None
        self.backend = "simulated"
        self.shm = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            parts = self.hub.exchange(self.rank, x.clone())
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            x.copy_(total)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return x
        return torch.cat(self.hub.exchange(self.rank, x.clone()), dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            x.copy_(self.hub.exchange(self.rank, x.clone())[src])
        return x

    def barrier(self) -> None:
        if self.world_size > 1:
            self.hub.barrier.wait()


def simulated_groups(world_size: int) -> list[SimulatedGroup]:
    hub = _Hub(world_size)
    return [SimulatedGroup(hub, rank) for rank in range(world_size)]


def run_simulated(world_size: int, fn: Callable[..., Any], *args: Any,
                  timeout_s: float = 120.0) -> list[Any]:
    """``fn(group, *args)`` on every rank (one thread each, with that rank's group as the TP
    group of its thread); returns the results in rank order, or raises the first rank's error
    (the others are released from their collectives instead of waiting forever)."""
    groups = simulated_groups(world_size)
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def run(rank: int) -> None:
        set_tp_group(groups[rank])
        try:
            results[rank] = fn(groups[rank], *args)
        except threading.BrokenBarrierError as exc:
            errors[rank] = exc
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = exc
            groups[rank].hub.barrier.abort()
        finally:
            set_tp_group(None)

    threads = [threading.Thread(target=run, args=(r,), name=f"sim-rank-{r}")
               for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
        if t.is_alive():
            groups[0].hub.barrier.abort()
            raise TimeoutError(f"simulated rank {t.name} did not finish in {timeout_s} s")
    first = next((e for e in errors if e is not None
                  and not isinstance(e, threading.BrokenBarrierError)), None)
    if first is None:
        first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
