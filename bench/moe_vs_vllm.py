"""MoE decode throughput: ingot against vLLM's CPU backend on one tiny-random Qwen3-MoE.

Builds a random-weight Qwen3-MoE checkpoint (bf16 safetensors, fixed seed; the shapes are
the arguments, the values do not matter for speed), then times the same greedy workload on
each engine in its own child process, alternating engines in rounds (A B A B ...): ``--batch``
prompts of ``--prompt-len`` token ids, ``--new-tokens`` each (ignore_eos), no tokenizer.
Reports output tokens per second (prefill included: it is a small share at these lengths).
vLLM runs from the peer venv (../shared/bench/vllm_peer.sh installs it). Engine
``ingot-torch-moe`` is ingot with its fused expert kernel refused (the torch expert path),
for the kernel's A/B in the same run; each ingot child reports how many MoE layers ran the
kernel.

    .venv/bin/python bench/moe_vs_vllm.py [--rounds 3] [--batch 8] [--new-tokens 64]
        [--engines ingot,vllm,ingot-torch-moe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PEER = Path(os.environ.get("INGOT_PEER_VENV", Path.home() / ".cache/ingot-peer/vllm"))

# Run by both engines' children: argv = engine, model dir, batch, prompt len, new tokens.
WORKLOAD = r'''
import json, random, sys, time
engine, model, batch, prompt_len, new = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
if engine == "vllm":
    from vllm import LLM, SamplingParams
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=max(batch, 1),
              skip_tokenizer_init=True, gpu_memory_utilization=0.3)
    def run(prompts, sp):
        return [len(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
else:
    from ingot import LLM, SamplingParams
    from ingot.model_executor.layers.bindable import NO_KERNELS
    from ingot.model_executor.layers.fused_moe import FusedMoE
    bound, bind = [], FusedMoE.bind_kernels
    def counted(layer, kernels):
        bound.append(bind(layer, NO_KERNELS if engine == "ingot-torch-moe" else kernels))
        return bound[-1]
    FusedMoE.bind_kernels = counted
    llm = LLM(model, dtype="bfloat16", max_model_len=512, max_num_seqs=max(batch, 1),
              skip_tokenizer_init=True)
    def run(prompts, sp):
        return [len(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]
rng = random.Random(0)
sp = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
run([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm
prompts = [[rng.randrange(10, 4000) for _ in range(prompt_len)] for _ in range(batch)]
t = time.perf_counter()
gen = sum(run(prompts, sp))
dt = time.perf_counter() - t
kernel_layers = sum(bound) if engine != "vllm" else None
print("RESULT " + json.dumps({"tok_s": gen / dt, "tokens": gen, "seconds": dt,
                              "kernel_layers": kernel_layers}), flush=True)
'''


def build_checkpoint(path: Path, args: argparse.Namespace) -> None:
    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=4096, hidden_size=args.hidden, intermediate_size=args.hidden * 2,
        moe_intermediate_size=args.moe_intermediate, num_experts=args.experts,
        num_experts_per_tok=args.top_k, norm_topk_prob=True, decoder_sparse_step=1,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=args.hidden // 8, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(path, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--moe-intermediate", type=int, default=256)
    parser.add_argument("--engines", default="ingot,vllm")
    args = parser.parse_args()
    engines = args.engines.split(",")
    pythons = {"ingot": sys.executable, "ingot-torch-moe": sys.executable,
               "vllm": str(PEER / "bin" / "python")}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "qwen3-moe-tiny"
        build_checkpoint(model, args)
        results: dict[str, list[float]] = {e: [] for e in engines}
        for r in range(args.rounds):
            for engine in engines:
                cmd = [pythons[engine], "-c", WORKLOAD, engine, str(model), str(args.batch),
                       str(args.prompt_len), str(args.new_tokens)]
                start = time.perf_counter()
                proc = subprocess.run(cmd, capture_output=True, text=True)
                lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if proc.returncode or not lines:
                    print(f"round {r} {engine}: FAILED (exit {proc.returncode})\n"
                          f"{proc.stderr[-4000:]}", flush=True)
                    continue
                res = json.loads(lines[0][7:])
                results[engine].append(res["tok_s"])
                kernel = ("" if res["kernel_layers"] is None
                          else f", {res['kernel_layers']} MoE layers on the kernel")
                print(f"round {r} {engine}: {res['tok_s']:.1f} tok/s ({res['tokens']} tokens, "
                      f"child {time.perf_counter() - start:.0f} s{kernel})", flush=True)
    print(f"\nQwen3-MoE tiny random (hidden {args.hidden}, {args.layers} layers, {args.experts} "
          f"experts top-{args.top_k}, moe_intermediate {args.moe_intermediate}), bf16, batch "
          f"{args.batch}, {args.prompt_len} in / {args.new_tokens} out, median of "
          f"{args.rounds} rounds")
    print("| engine | output tok/s |")
    print("|---|---|")
    for engine in engines:
        med = statistics.median(results[engine]) if results[engine] else float("nan")
        print(f"| {engine} | {med:.1f} |")


if __name__ == "__main__":
    main()
