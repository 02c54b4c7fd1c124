"""Which FP8 (e4m3) KV-cache scale granularity keeps the model's predictions (issue #33's "finer
FP8 KV cache"), measured before building one into the engine:

    .venv/bin/python bench/fp8_kv_scales.py            # the default model, argparse's source

HF transformers runs the default model in float32 over fixed text, teacher-forced, with every
key and value it caches stored as e4m3 and read back (``x -> e4m3(x / s) * s``) under one scale
scheme at a time:

- ``layer``: one scale per layer for keys and one for values, from the amax over the whole text
  (the engine's calibrated per-layer scheme, the spec's);
- ``head``: one per layer and KV head (static, the same calibration);
- ``token-head``: one per token and KV head, from that vector's own amax (written beside the
  block in an engine);
- ``channel``: keys one per layer, head and channel (static), values per token and head.

It prints, per scheme, the top-1 agreement with the float32 cache and the mean KL divergence
over the positions (every position attends to the quantized cache, as a chunked prefill and
decode do in the engine).
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

E4M3_MAX = 448.0


def fake_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale


def scales(scheme: str, kind: str, x: torch.Tensor, amax: dict) -> torch.Tensor:
    """x [B, Hkv, T, D] -> a scale broadcastable to it."""
    tiny = torch.finfo(torch.float32).tiny
    if scheme == "layer":
        return (amax["layer"] / E4M3_MAX).clamp_min(tiny)
    if scheme == "head":
        return (amax["head"] / E4M3_MAX).clamp_min(tiny).view(1, -1, 1, 1)
    if scheme == "channel" and kind == "k":
        return (amax["channel"] / E4M3_MAX).clamp_min(tiny).view(1, x.shape[1], 1, -1)
    return (x.abs().amax(-1, keepdim=True) / E4M3_MAX).clamp_min(tiny)  # token-head


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-dir", type=Path, default=None,
                    help="HF directory of the model (default: the default GGUF converted)")
    ap.add_argument("--tokens", type=int, default=2048)
    args = ap.parse_args(argv)
    import transformers
    from transformers import DynamicCache

    hf_dir = args.hf_dir
    if hf_dir is None:
        from ingot.model_executor.loader.gguf_loader import convert_gguf_to_hf, default_model_path

        hf_dir = Path.home() / ".cache" / "ingot" / "smollm2-hf-f32"
        if not (hf_dir / "config.json").exists():
            convert_gguf_to_hf(default_model_path(), hf_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    ids = tok(inspect.getsource(argparse), return_tensors="pt").input_ids[:, :args.tokens]

    # Calibration (as the engine's per-layer scheme): amax over the whole text, float32 cache.
    with torch.no_grad():
        out = model(ids, use_cache=True)
    ref = out.logits[0].log_softmax(-1)
    cache = out.past_key_values
    calib = []
    for layer in cache.layers:
        pair = {}
        for kind, x in (("k", layer.keys), ("v", layer.values)):  # [1, Hkv, T, D]
            pair[kind] = {"layer": x.abs().amax(), "head": x.abs().amax(dim=(0, 2, 3)),
                          "channel": x.abs().amax(dim=(0, 2))}
        calib.append(pair)

    class QuantizedCache(DynamicCache):
        scheme = "layer"

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
            c = calib[layer_idx]
            k = fake_e4m3(key_states, scales(self.scheme, "k", key_states, c["k"]))
            v = fake_e4m3(value_states, scales(self.scheme, "v", value_states, c["v"]))
            return super().update(k, v, layer_idx, *args, **kwargs)

    print(f"{ids.shape[1]} positions of argparse's source, {hf_dir.name}, float32 reference")
    for scheme in ("layer", "head", "token-head", "channel"):
        QuantizedCache.scheme = scheme
        with torch.no_grad():
            got = model(ids, past_key_values=QuantizedCache(), use_cache=True).logits[0]
        lp = got.log_softmax(-1)
        agree = (lp.argmax(-1) == ref.argmax(-1)).double().mean().item()
        kl = (ref.exp() * (ref - lp)).sum(-1).mean().item()
        print(f"RESULT workload=fp8_kv_scales scheme={scheme} top1={agree:.4f} mean_kl={kl:.5f}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
