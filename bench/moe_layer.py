"""One MoE layer's experts: ingot's fused CPU kernel against the torch path (fused_moe.py).

Random bf16 weights and routing (fixed seeds) at a decode batch and a prefill chunk, for the
tiny-random Qwen3-MoE of bench/moe_vs_vllm.py and a Qwen3-30B-A3B-shaped layer; the two paths
alternate in rounds (A B A B ...) in this process. Reports the median wall time per call and
the median CPU time of the calling thread per call at one compute thread (CPU time counts only
what the thread ran, so it moves less than wall time when other processes share the CPUs).

    .venv/bin/python bench/moe_layer.py [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from ingot.model_executor.layers.bindable import Kernels
from ingot.model_executor.layers.cpu_kernels import load_cpu_kernels
from ingot.model_executor.layers.fused_moe import FusedMoE

SHAPES = {  # name: (experts, top k, hidden, moe intermediate)
    "tiny (moe_vs_vllm.py)": (8, 2, 256, 256),
    "Qwen3-30B-A3B layer": (128, 8, 2048, 768),
}


def _time(fn, calls: int) -> tuple[float, float]:  # noqa: ANN001
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - wall) / calls, (time.thread_time() - cpu) / calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", default="1,8,128")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if load_cpu_kernels() is None:
        raise SystemExit("ingot's CPU kernels do not build here")
    print(f"{args.threads} thread(s), median of {args.rounds} rounds; us per call (wall / CPU)")
    print("| layer | tokens | torch path | kernel | speed-up (wall, CPU) |")
    print("|---|---|---|---|---|")
    for name, (experts, top_k, hidden, inter) in SHAPES.items():
        torch.manual_seed(0)
        plain = FusedMoE(experts, top_k, hidden, inter, True).to(torch.bfloat16)
        with torch.no_grad():
            for p in plain.parameters():
                p.normal_(0, 0.05)
        fused = FusedMoE(experts, top_k, hidden, inter, True).to(torch.bfloat16)
        fused.load_state_dict(plain.state_dict())
        assert fused.bind_kernels(Kernels(cpu=True))
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, hidden).to(torch.bfloat16)
            ids = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
            weights = torch.rand(tokens, top_k)
            work = tokens * top_k * 3 * hidden * inter
            calls = max(1, int(2e9 // max(work, 1) // 40))
            runs: dict[str, list[tuple[float, float]]] = {"torch": [], "kernel": []}
            with torch.inference_mode():
                for layer in (plain, fused):
                    layer.experts(x, weights, ids)  # warm
                for _ in range(args.rounds):
                    runs["torch"].append(_time(partial(plain.experts, x, weights, ids), calls))
                    runs["kernel"].append(_time(partial(fused.experts, x, weights, ids), calls))
            med = {k: (statistics.median(w for w, _ in v) * 1e6,
                       statistics.median(c for _, c in v) * 1e6) for k, v in runs.items()}
            (tw, tc), (kw, kc) = med["torch"], med["kernel"]
            print(f"| {name} | {tokens} | {tw:.0f} / {tc:.0f} | {kw:.0f} / {kc:.0f} | "
                  f"{tw / kw:.1f}x, {tc / kc:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
