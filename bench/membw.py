"""Memory read bandwidth of this machine, and the decode tokens/s bound it sets for a model.

Decode at batch 1 reads every weight once per token, so tokens/s <= bandwidth / weight bytes.
The bandwidth is a torch sum over a buffer far larger than the last-level cache (L3 here is
reported as 300 MiB, so the default buffer is 2 GiB), the median of several passes, on torch's
thread count (the one ingot runs with unless --threads says otherwise). A copy figure
(read + write bytes) is printed alongside for reference.

    .venv/bin/python bench/membw.py [--gib 2] [--repeats 7] [--threads N] [--model PATH]

Prints:
  RESULT workload=membw read_gb_s=... copy_gb_s=... threads=N buffer_gib=2.0
  RESULT workload=decode_bound model=... weight_bytes=... bound_tok_s=...
Weight bytes are all parameters at bf16 (2 bytes each). A tied embedding counts once: its full
read is the lm_head matmul, while the embedding lookup reads one row; an untied model reads the
whole lm_head plus one embedding row. The KV cache read (small next to the weights at short
contexts: ~23 KB per context token for the default model) is left out, so this is an upper bound.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping
from pathlib import Path

BF16_BYTES = 2
# Names of the token embedding and the output projection, GGUF and Hugging Face spellings.
EMBED_NAMES = ("token_embd.weight", "model.embed_tokens.weight")
LM_HEAD_NAMES = ("output.weight", "lm_head.weight")


def decode_weight_bytes(numels: Mapping[str, int], hidden_size: int,
                        bytes_per_param: int = BF16_BYTES) -> int:
    """Bytes of weights one decode step reads, from {parameter name: element count}.

    Tied embedding (no lm_head tensor): every parameter once. Untied: everything but the
    embedding, plus the one embedding row the lookup reads.
    """
    total = sum(numels.values())
    embed = next((numels[n] for n in EMBED_NAMES if n in numels), None)
    tied = not any(n in numels for n in LM_HEAD_NAMES)
    if embed is not None and not tied:
        total = total - embed + hidden_size
    return total * bytes_per_param


def bound_tok_s(weight_bytes: int, read_gb_s: float) -> float:
    """Upper bound on single-stream decode tokens/s (GB = 1e9 bytes)."""
    return read_gb_s * 1e9 / weight_bytes


def model_numels(path: str | Path) -> tuple[dict[str, int], int]:
    """({tensor name: element count}, hidden size) of a GGUF file or a safetensors HF dir,
    read from headers only (no weights are loaded)."""
    import math

    path = Path(path)
    if path.is_file():
        from ingot.model_executor.loader.gguf_loader import read_gguf_header

        _, infos = read_gguf_header(path)
        numels = {name: math.prod(info.shape) for name, info in infos.items()}
        embed = next(infos[n] for n in EMBED_NAMES if n in infos)
        return numels, min(embed.shape)
    import json

    from safetensors import safe_open

    numels = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                numels[name] = math.prod(st.get_slice(name).get_shape())
    hidden = json.loads((path / "config.json").read_text())["hidden_size"]
    return numels, hidden


def measure_read_gb_s(gib: float = 2.0, repeats: int = 7) -> tuple[float, float]:
    """(read GB/s from a sum, copy GB/s counting read + write bytes), medians over repeats."""
    import torch

    n = int(gib * 2**30) // 4
    buf = torch.ones(n, dtype=torch.float32)  # touched, so pages are resident before timing
    dst = torch.empty_like(buf)
    nbytes = buf.numel() * buf.element_size()
    buf.sum()
    reads, copies = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        reads.append(nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(buf)
        copies.append(2 * nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(reads), statistics.median(copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0, help="buffer size (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's, which ingot also uses)")
    ap.add_argument("--model", default=None,
                    help="GGUF file or HF dir for the bound (default: ingot's default model)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    read, copy = measure_read_gb_s(args.gib, args.repeats)
    print(f"RESULT workload=membw read_gb_s={read:.1f} copy_gb_s={copy:.1f} "
          f"threads={torch.get_num_threads()} buffer_gib={args.gib}", flush=True)
    model = args.model
    if model is None:
        from ingot.model_executor.loader.gguf_loader import default_model_path

        model = default_model_path()
    numels, hidden = model_numels(model)
    wbytes = decode_weight_bytes(numels, hidden)
    line = (f"RESULT workload=decode_bound model={Path(model).name} weight_bytes={wbytes} "
            f"bound_tok_s={bound_tok_s(wbytes, read):.1f}")
    if Path(model).is_file():  # a GGUF: its tensors' own bytes, as --quantization gguf reads
        from gguf import GGUFReader  # them (the tied embedding is the LM head's blocks)

        fbytes = sum(int(t.n_bytes) for t in GGUFReader(model).tensors)
        line += f" file_weight_bytes={fbytes} file_bound_tok_s={bound_tok_s(fbytes, read):.1f}"
    print(line, flush=True)


if __name__ == "__main__":
    main()
