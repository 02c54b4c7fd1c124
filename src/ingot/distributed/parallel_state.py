"""The process-wide groups of one worker: ``init_distributed(...)`` joins the world and builds
the TP groups (every rank creates every group, in the same order, as torch.distributed
requires); ``get_tp_group()`` is what the model's layers size their shards from. Before (or
without) initialisation the TP group is this process alone, so TP = 1 never touches
torch.distributed.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading

import torch
import torch.distributed as dist

from ingot.distributed.group import GroupCoordinator
from ingot.distributed.layouts import dp_column_group_ranks, tp_group_ranks

logger = logging.getLogger("ingot")

_TP: GroupCoordinator | None = None
_WORLD: GroupCoordinator | None = None
# The DP column group (the same TP position in every replica): only expert parallelism across
# the replicas joins them in one world (distributed/data_parallel.py); otherwise this rank alone.
_DP: GroupCoordinator | None = None
# Expert parallelism (spec §3) re-reads the TP group for the MoE layers: its degree decides
# which experts a rank holds. Process-wide (init_distributed sets it), with a per-thread
# override (get_ep_size).
_EP_SIZE = 1
# Sequence-parallel prefill (distributed/sequence_parallel.py), read when the model is built.
_SEQUENCE_PARALLEL = False


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(world_size: int, rank: int, init_method: str, tp_size: int,
                     device: torch.device, timeout_s: float = 600.0,
                     ep_size: int = 1, sequence_parallel: bool = False,
                     node_rank: int = 0) -> GroupCoordinator:
    """Join the world (``init_method`` is tcp://host:port or file://path) and build the TP
    groups, and the DP column groups when the world spans several replicas (world > TP:
    expert parallelism across them); returns this rank's TP group. ``ep_size``: the MoE
    layers' expert-parallel degree (within a replica they re-read the TP group, so no group of
    their own is needed: one all-reduce over TP sums every partial). ``node_rank``: the node
    this rank runs on (TP across nodes): ranks of different nodes never share memory, even
    when the "nodes" are processes of one host."""
    global _TP, _WORLD, _EP_SIZE, _DP, _SEQUENCE_PARALLEL
    _EP_SIZE = ep_size
    _SEQUENCE_PARALLEL = sequence_parallel
    backend = backend_for(device)
    if (backend == "gloo" and init_method.startswith(("file://", "tcp://127.", "tcp://localhost:"))
            and "GLOO_SOCKET_IFNAME" not in os.environ and os.path.exists("/sys/class/net/lo")):
        # A file (or loopback) rendezvous means every rank is on this host: talk over loopback
        # rather than whatever address the hostname resolves to (unreachable in some
        # containers). Across hosts, GLOO_SOCKET_IFNAME names the interface.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, world_size=world_size,
                                rank=rank, timeout=datetime.timedelta(seconds=timeout_s))
    _WORLD = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD, backend)
    mine = None
    for ranks in tp_group_ranks(world_size, tp_size):
        # The world itself needs no second group.
        group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks,
                                                                                 backend=backend)
        if rank in ranks:
            mine = GroupCoordinator(ranks, rank, group, backend)
    assert mine is not None
    # Ranks on this host all-reduce through shared memory (gloo between hosts; shm_comm.py).
    mine.enable_shm(timeout_s=timeout_s, node=node_rank)
    _TP = mine
    _DP = None
    if world_size > tp_size:
        for ranks in dp_column_group_ranks(world_size, tp_size, world_size // tp_size):
            group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(
                ranks, backend=backend)
            if rank in ranks:
                _DP = GroupCoordinator(ranks, rank, group, backend)
    logger.info("torch.distributed (%s): rank %d of %d, TP group %s, DP group %s, EP degree %d, "
                "TP collectives over %s", backend, rank, world_size, mine.ranks,
                _DP.ranks if _DP else [rank], ep_size,
                "shared memory" if mine.shm is not None else backend)
    return mine


# A per-thread override (tests, and the simulated group's rank threads); None: the process's.
_local = threading.local()


def get_tp_group() -> GroupCoordinator:
    override = getattr(_local, "tp", None)
    if override is not None:
        return override
    return _TP if _TP is not None else GroupCoordinator.single()


def set_tp_group(group: GroupCoordinator | None) -> None:
    """Build layers on this thread under ``group`` (None: back to the process's group)."""
    _local.tp = group


def get_dp_group() -> GroupCoordinator:
    """This rank's DP column group (this rank alone unless EP spans the replicas; tests pass
    a group to the layers instead)."""
    return _DP if _DP is not None else GroupCoordinator.single()


def get_ep_size() -> int:
    override = getattr(_local, "ep", None)
    return override if override is not None else _EP_SIZE


def set_ep_size(size: int | None, this_thread_only: bool = False) -> None:
    """The EP degree MoE layers are built with (1 or None: no EP, experts split by TP)."""
    global _EP_SIZE
    if this_thread_only:
        _local.ep = size
    else:
        _EP_SIZE = size or 1


def tp_collectives() -> str | None:
    """What carries this process's TP collectives: "shm" (shared memory), the backend's name,
    or None with one rank."""
    group = get_tp_group()
    if group.world_size == 1:
        return None
    return "shm" if group.shm is not None else group.backend


def get_sequence_parallel() -> bool:
    """Whether models built now run their prefill steps sequence-parallel (with TP > 1)."""
    override = getattr(_local, "sp", None)
    return override if override is not None else _SEQUENCE_PARALLEL


def set_sequence_parallel(enabled: bool | None) -> None:
    """Build models on this thread with sequence-parallel prefill on or off (None: back to
    the process's setting)."""
    _local.sp = enabled


def destroy_distributed() -> None:
    global _TP, _WORLD, _EP_SIZE, _DP, _SEQUENCE_PARALLEL
    _SEQUENCE_PARALLEL = False
    if _TP is not None and _TP.shm is not None:
        _TP.shm.close()
    _TP = _WORLD = _DP = None
    _EP_SIZE = 1
    if dist.is_initialized():
        dist.destroy_process_group()
