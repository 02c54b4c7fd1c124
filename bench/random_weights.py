"""Save an HF model directory with random weights in the shape of a given config.

For timing on machines the real weights cannot reach (a GPU machine with no network): speed
depends on shapes, not values. The tokenizer files beside the config are copied along.

    python bench/random_weights.py CONFIG_DIR OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config_dir", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    config = transformers.AutoConfig.from_pretrained(args.config_dir)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out_dir, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (args.config_dir / name).exists():
            shutil.copy(args.config_dir / name, args.out_dir / name)
    print(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random parameters "
          f"to {args.out_dir}")


if __name__ == "__main__":
    main()
