"""Collectives through shared memory for the ranks of one group on one host (CPU).

gloo moves every tensor through a TCP socket, even between processes on the same machine: a
decode step's all-reduce of a few KiB costs tens of microseconds of system calls and copies per
layer half. Here the ranks of a group map one segment of ``/dev/shm`` instead. Each collective
is one *round*: every rank copies its part into its own slot, publishes the round number in its
flag, waits until every flag has reached it, and reads the others' slots. Sums run in rank
order (half types accumulate in float32 and round once), so every rank gets bit-identical,
deterministic results, as vLLM's CPU backend does with its shm all-reduce.

Two sets of slots alternate between rounds. A rank may write round ``k + 2`` into the slots of
round ``k`` only after every rank has published ``k + 1``, which each does only after it has
finished reading round ``k``: one flag per rank is the whole synchronisation. torch.distributed
(gloo) still sets the segment up, and carries what this path does not take (ranks on other
hosts, non-CPU or non-contiguous tensors, gathers larger than a slot). Tensors larger than a
slot are all-reduced in slot-sized pieces.

The flags are plain 8-byte stores and loads: on x86-64 (total store order) a rank's data copy
is visible before the flag that follows it, so the path is enabled there only.
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import socket
import time
import uuid
from collections.abc import Sequence

import torch
import torch.distributed as dist

logger = logging.getLogger("ingot")

#: "0" forces gloo for every collective; anything else (default "1"): shared memory when every
#: rank of the group is on this host.
ENABLE_ENV = "INGOT_CPU_SHM_ALLREDUCE"
#: Bytes of one rank's slot, in MiB (default 8: a 2048 x 576 float32 prefill tensor is 4.5).
SLOT_MB_ENV = "INGOT_CPU_SHM_SLOT_MB"
DEFAULT_SLOT_MB = 8

_LINE = 64  # one flag per cache line: ranks never write the same line
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64,
           torch.int32)
# Quick polls before yielding the CPU; a peer sharing our core needs it to get there.
_SPINS = 200
_LIVENESS_S = 0.5


def host_identity() -> str:
    """What two processes on the same machine (and the same /dev/shm) share."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}/{boot}"


def node_identity(node: int = 0) -> str:
    """This host, and the node index it plays (--node-rank): two "nodes" on one host (tests,
    or containers sharing /dev/shm) must still keep apart, as real ones have to."""
    return f"{host_identity()}#node{node}"


def shm_supported(backend: str) -> str | None:
    """None when this process may use the path, else why not (for the log line)."""
    if os.environ.get(ENABLE_ENV, "1").strip() == "0":
        return f"{ENABLE_ENV}=0"
    if backend != "gloo":
        return f"backend {backend}"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"{platform.machine()} is not x86-64 (the flags rely on its store order)"
    if not os.path.isdir("/dev/shm"):
        return "no /dev/shm"
    return None


def slot_bytes_from_env() -> int:
    raw = os.environ.get(SLOT_MB_ENV, str(DEFAULT_SLOT_MB)).strip()
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"{SLOT_MB_ENV}={raw!r} is not a number of MiB; use e.g. 8") from None
    if mb <= 0:
        raise ValueError(f"{SLOT_MB_ENV}={raw!r} must be positive; use e.g. 8")
    return max(_LINE, int(mb * 2**20) // _LINE * _LINE)


def decline_reason(ranks: Sequence[tuple[str | None, str, int]]) -> str | None:
    """From every rank's (why it cannot, host identity, pid): why the group cannot use shared
    memory, or None when it can. One rank's reason, or ranks on different hosts, decline it
    for all (a collective must take the same path on every rank)."""
    for reason, _, _ in ranks:
        if reason is not None:
            return reason
    if len({host for _, host, _ in ranks}) > 1:
        return "the ranks are on several hosts"
    return None


def _process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            state = f.read().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


class ShmCommunicator:
    """One rank's view of its group's segment. Build it with :meth:`create` on every rank of
    the group at once (it is a collective over ``device_group``)."""

    def __init__(self, mm: mmap.mmap, world_size: int, rank_in_group: int, slot_bytes: int,
                 pids: Sequence[int], timeout_s: float) -> None:
        self.world_size = world_size
        self.rank_in_group = rank_in_group
        self.slot_bytes = slot_bytes
        self.pids = list(pids)
        self.timeout_s = timeout_s
        self._mm = mm
        flags_bytes = world_size * _LINE
        self._flags = memoryview(mm)[:flags_bytes].cast("q")  # flag of rank j: [j * 8]
        self._stride = _LINE // 8
        self._flag_index = [j * self._stride for j in range(world_size)]
        data = torch.frombuffer(mm, dtype=torch.uint8, offset=flags_bytes,
                                count=2 * world_size * slot_bytes)
        self._slots = data.view(2, world_size, slot_bytes)
        self.seq = 0  # rounds done; the flags hold it
        self.rounds = 0  # for tests and the benchmark: collectives that went through here
        self._acc: torch.Tensor | None = None  # float32 scratch for half-type sums
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}

    # -- set-up ---------------------------------------------------------------------------

    @classmethod
    def create(cls, device_group: dist.ProcessGroup, ranks: Sequence[int], rank_in_group: int,
               backend: str, slot_bytes: int | None = None, timeout_s: float = 600.0,
               node: int = 0) -> ShmCommunicator | None:
        """The segment for this group, or None (every rank returns the same) when a rank is
        on another host or node (``node``: --node-rank; two "nodes" on one host still keep
        apart), the platform does not allow it, or the segment cannot be made. The hosts are
        compared before any segment exists, so no rank ever opens another host's."""
        world_size = len(ranks)
        reason = shm_supported(backend)
        slot = slot_bytes if slot_bytes is not None else slot_bytes_from_env()
        mine = (reason, node_identity(node), os.getpid())
        everyone: list = [None] * world_size
        dist.all_gather_object(everyone, mine, group=device_group)
        why = decline_reason(everyone)
        if why is not None:
            return cls._declined(why)
        size = world_size * _LINE + 2 * world_size * slot
        path: list = [None]
        if rank_in_group == 0:
            name = f"/dev/shm/ingot-tp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                try:
                    os.ftruncate(fd, size)
                finally:
                    os.close(fd)
                path[0] = name
            except OSError as exc:
                path[0] = f"error: cannot create {name}: {exc}"
        # Rank 0's slot size is the group's (a rank with another INGOT_CPU_SHM_SLOT_MB must
        # still lay the segment out alike).
        path.append(slot)
        dist.broadcast_object_list(path, src=ranks[0], group=device_group)
        slot = path[1]
        size = world_size * _LINE + 2 * world_size * slot
        mm: mmap.mmap | None = None
        error = path[0] if path[0].startswith("error:") else None
        if error is None:
            try:
                fd = os.open(path[0], os.O_RDWR)
                try:
                    mm = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
            except OSError as exc:
                error = f"error: rank {rank_in_group} cannot map {path[0]}: {exc}"
        errors: list = [None] * world_size
        dist.all_gather_object(errors, error, group=device_group)
        if rank_in_group == 0 and not path[0].startswith("error:"):
            # Everyone has mapped it (or failed): the name is no longer needed, and an unlinked
            # segment cannot outlive the processes, however they end.
            os.unlink(path[0])
        if any(errors):
            if mm is not None:
                mm.close()
            return cls._declined(next(e for e in errors if e)[len("error: "):])
        assert mm is not None
        logger.info("TP collectives through shared memory: %d ranks, %.1f MiB slots",
                    world_size, slot / 2**20)
        return cls(mm, world_size, rank_in_group, slot, [p for _, _, p in everyone], timeout_s)

    @staticmethod
    def _declined(why: str) -> None:
        logger.info("TP collectives over torch.distributed (no shared memory: %s)", why)
        return None

    # -- one round ------------------------------------------------------------------------

    def _views(self, dtype: torch.dtype, numel: int, start: int = 0) -> list[torch.Tensor]:
        """Every rank's slot of this round as ``numel`` elements of ``dtype`` from ``start``.
        Cached: a decode step's collectives repeat a few shapes, and making the views costs
        more than the copies of such small tensors."""
        key = (self.seq & 1, dtype, numel, start)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            views = [self._slots[key[0], j].view(dtype)[start : start + numel]
                     for j in range(self.world_size)]
            self._view_cache[key] = views
        return views

    def _slot(self, rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return self._views(dtype, numel)[rank]

    def _begin(self) -> None:
        self.seq += 1
        self.rounds += 1

    def _publish_and_wait(self) -> None:
        seq, flags = self.seq, self._flags
        flags[self.rank_in_group * self._stride] = seq
        slots = self._flag_index
        for _ in range(_SPINS):
            if min([flags[j] for j in slots]) >= seq:
                return
        start = last_check = time.monotonic()
        while min([flags[j] for j in slots]) < seq:
            os.sched_yield()
            now = time.monotonic()
            if now - last_check > _LIVENESS_S:
                last_check = now
                self._check_peers(seq, now - start)

    def _check_peers(self, seq: int, waited: float) -> None:
        late = [j for j in range(self.world_size) if self._flags[j * self._stride] < seq]
        dead = [j for j in late if not _process_alive(self.pids[j])]
        if dead:
            raise RuntimeError(f"shared-memory collective: group rank(s) {dead} (pid "
                               f"{[self.pids[j] for j in dead]}) exited")
        if waited > self.timeout_s:
            raise RuntimeError(f"shared-memory collective: group rank(s) {late} did not arrive "
                               f"within {self.timeout_s:.0f} s")

    # -- collectives ----------------------------------------------------------------------

    def takes(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous()

    def _sum_into(self, out: torch.Tensor, numel: int, start: int = 0) -> None:
        """``out`` = the slots' elements ``[start, start + numel)`` summed in rank order."""
        parts = self._views(out.dtype, numel, start)
        if out.dtype in (torch.bfloat16, torch.float16) and len(parts) > 2:
            # float32 accumulation, rounded once (with two parts a half-type add is exactly
            # that: it adds in float32 and rounds).
            if self._acc is None or self._acc.numel() < numel:
                self._acc = torch.empty(max(numel, 1 << 16), dtype=torch.float32)
            acc = self._acc[:numel]
            acc.copy_(parts[0])
            for p in parts[1:]:
                acc += p
            out.copy_(acc)
        else:
            torch.add(parts[0], parts[1], out=out)
            for p in parts[2:]:
                out.add_(p)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group into ``x`` (in place), in slot-sized pieces."""
        flat = x.view(-1)
        per = self.slot_bytes // x.element_size()
        n = flat.numel()
        if n <= per:  # one piece (every decode step)
            self._begin()
            self._views(x.dtype, n)[self.rank_in_group].copy_(flat)
            self._publish_and_wait()
            self._sum_into(flat, n)
            return x
        for i in range(0, n, per):
            piece = flat[i : i + per]
            self._begin()
            self._slot(self.rank_in_group, x.dtype, piece.numel()).copy_(piece)
            self._publish_and_wait()
            self._sum_into(piece, piece.numel())
        return x

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor | None:
        """This rank's chunk (dim 0) of the group sum; each rank sums only its own rows.
        None when ``x`` does not fit one slot (the caller falls back)."""
        if x.numel() * x.element_size() > self.slot_bytes:
            return None
        rows = x.shape[0] // self.world_size
        per_row = x[0].numel() if x.dim() > 1 else 1
        self._begin()
        self._slot(self.rank_in_group, x.dtype, x.numel()).copy_(x.view(-1))
        self._publish_and_wait()
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype)
        self._sum_into(out.view(-1), rows * per_row, self.rank_in_group * rows * per_row)
        return out

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor | None:
        """Every rank's ``x`` concatenated along ``dim`` in group order; None when ``x`` does
        not fit one slot."""
        n = x.numel()
        if n * x.element_size() > self.slot_bytes:
            return None
        self._begin()
        self._slot(self.rank_in_group, x.dtype, n).copy_(x.view(-1))
        self._publish_and_wait()
        # torch.cat copies out of the slots before the next round can reuse them.
        return torch.cat([self._slot(j, x.dtype, n).view(x.shape)
                          for j in range(self.world_size)], dim=dim)

    def broadcast(self, x: torch.Tensor, src: int) -> bool:
        """``x`` from group rank ``src``, in place; False when it does not fit one slot."""
        n = x.numel()
        if n * x.element_size() > self.slot_bytes:
            return False
        self._begin()
        if self.rank_in_group == src:
            self._slot(src, x.dtype, n).copy_(x.view(-1))
        self._publish_and_wait()
        if self.rank_in_group != src:
            x.view(-1).copy_(self._slot(src, x.dtype, n))
        return True

    def barrier(self) -> None:
        self._begin()
        self._publish_and_wait()

    def close(self) -> None:
        self._view_cache.clear()
        self._flags.release()
        self._slots = None  # type: ignore[assignment]
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it; the mapping goes with the process
            pass
