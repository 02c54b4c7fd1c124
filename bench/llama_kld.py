"""llama.cpp's own agreement between its quantized kernels and the same weights in float32, on
the text the quantized-weights gate of tests/e2e/test_gguf_quantized.py reads (argparse's
source), for issue #33's "report llama.cpp's figures beside ingot's":

    .venv/bin/python bench/llama_kld.py "$(bench/llama_cpp.sh)/llama-perplexity"

Writes, under a scratch directory, the default model's GGUF with every tensor dequantized to
float32 by the ``gguf`` package (the same reference ingot's gate uses: ``--quantization none``),
runs ``llama-perplexity --kl-divergence-base`` on it, then ``--kl-divergence`` on the original
file, and prints llama.cpp's summary ("Same top p": top-1 agreement, mean KL divergence) as

    RESULT workload=llama_kld engine=llama.cpp same_top1=0.9712 mean_kld=0.00301 ctx=512 ...

llama-perplexity scores the second half of each ``--ctx-size`` chunk (the first half is
context): the positions differ from the gate's 5 windows of 500 tokens, the text and the
weights do not. llama.cpp is a benchmark peer, never a dependency of ingot.
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def write_f32_gguf(src: Path, dst: Path) -> None:
    """``src`` with every tensor float32: quantized blocks dequantized by the gguf package."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # written by GGUFWriter itself
        value = field.contents()
        if field.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32)
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type).astype(np.float32)
        writer.add_tensor(t.name, data.reshape([int(d) for d in reversed(t.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def parse_summary(text: str) -> dict[str, float]:
    """llama-perplexity's KL-divergence summary -> same_top1 (a fraction), mean_kld."""
    out = {}
    top = re.search(r"Same top p:\s*([\d.]+)\s*±", text)
    kld = re.search(r"Mean\s+KLD:\s*([\d.eE+-]+)", text)
    if top:
        out["same_top1"] = float(top.group(1)) / 100
    if kld:
        out["mean_kld"] = float(kld.group(1))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("llama_perplexity", help="path of the llama-perplexity binary")
    ap.add_argument("--model", default=None, help="GGUF file (default: ingot's default model)")
    ap.add_argument("--ctx-size", type=int, default=512)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        model = str(default_model_path())
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        f32, base, text = tmp / "f32.gguf", tmp / "base.kld", tmp / "text.txt"
        write_f32_gguf(Path(model), f32)
        text.write_text(inspect.getsource(argparse))
        common = ["-f", str(text), "-c", str(args.ctx_size), "-t", str(args.threads),
                  "--kl-divergence-base", str(base)]
        repack = ""
        for cmd in ([args.llama_perplexity, "-m", str(f32), *common],
                    [args.llama_perplexity, "-m", model, *common, "--kl-divergence"]):
            for extra in ([], ["--no-repack"]):
                print("running: " + " ".join(cmd + extra), file=sys.stderr, flush=True)
                proc = subprocess.run(cmd + extra, capture_output=True, text=True, timeout=3600)
                if proc.returncode == 0:
                    repack = repack or (" repack=0" if extra else "")
                    break
                # (llama.cpp's repacked AVX-512/AMX weights crashed on a Xeon with AMX, build
                # 11434, as in bench/llama_bench.py: again with the file's layout)
                print(f"exited with {proc.returncode}: {proc.stderr[-1500:]}", file=sys.stderr)
            else:
                return 1
        summary = parse_summary(proc.stdout + proc.stderr)
    if "same_top1" not in summary:
        print("no KL-divergence summary in llama-perplexity's output", file=sys.stderr)
        return 1
    fields = " ".join(f"{k}={v:.5g}" for k, v in summary.items())
    print(f"RESULT workload=llama_kld engine=llama.cpp {fields} ctx={args.ctx_size} "
          f"model={os.path.basename(model)}{repack}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
