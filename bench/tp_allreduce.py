"""All-reduce latency and bandwidth of the TP group: the shared-memory path against gloo.

Spawns ``--world`` ranks (one compute thread each, gloo over loopback, a file rendezvous) that
all-reduce decode-sized ([1, 576], [8, 576]) and prefill-sized ([2048, 576]) tensors in float32
and bfloat16 through the group's two paths, alternating the paths in rounds (A B A B ...), and
prints the median time per all-reduce of each, a bandwidth (the tensor's bytes over that time)
and the ratio, measured in the same run.

    .venv/bin/python bench/tp_allreduce.py [--world 2] [--rounds 5] [--iters 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

SHAPES = [(1, 576), (8, 576), (2048, 576)]
DTYPES = [torch.bfloat16, torch.float32]


def _rank(rank: int, world: int, init: str, rounds: int, iters: int, out: str) -> None:
    from ingot.distributed import parallel_state
    from ingot.distributed.group import GroupCoordinator

    torch.set_num_threads(1)
    shm = parallel_state.init_distributed(world, rank, f"file://{init}", world,
                                          torch.device("cpu"), timeout_s=120)
    assert shm.shm is not None, "the shared-memory path did not come up"
    gloo = GroupCoordinator(shm.ranks, shm.rank, shm.device_group, shm.backend)
    lines = []
    for dtype in DTYPES:
        for shape in SHAPES:
            x = torch.randn(shape).to(dtype)
            n = max(5, iters // (1 + x.numel() // 8192))  # fewer for the big tensors
            times: dict[str, list[float]] = {"shm": [], "gloo": []}
            for _ in range(rounds):
                for name, group in (("shm", shm), ("gloo", gloo)):
                    for _ in range(3):
                        group.all_reduce(x)  # warm
                    group.barrier()
                    start = time.perf_counter()
                    for _ in range(n):
                        group.all_reduce(x)
                    times[name].append((time.perf_counter() - start) / n)
            med = {k: statistics.median(v) for k, v in times.items()}
            nbytes = x.numel() * x.element_size()
            lines.append(
                f"| {list(shape)} | {str(dtype).removeprefix('torch.')} | {nbytes / 1024:.1f} KiB "
                f"| {med['shm'] * 1e6:.1f} | {med['gloo'] * 1e6:.1f} "
                f"| {nbytes / med['shm'] / 1e9:.2f} | {nbytes / med['gloo'] / 1e9:.2f} "
                f"| {med['gloo'] / med['shm']:.1f}x |")
    if rank == 0:
        Path(out).write_text("\n".join(lines) + "\n")
    parallel_state.destroy_distributed()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/result.md"
        mp.spawn(_rank, args=(args.world, f"{tmp}/init", args.rounds, args.iters, out),
                 nprocs=args.world, join=True)
        print(f"world {args.world}, median of {args.rounds} alternating rounds")
        print("| tensor | dtype | size | shm us | gloo us | shm GB/s | gloo GB/s | gloo/shm |")
        print("|---|---|---|---|---|---|---|---|")
        print(Path(out).read_text(), end="")


if __name__ == "__main__":
    main()
