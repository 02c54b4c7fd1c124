"""A float32 decoder's linears on oneDNN's packed kernels (binding.select_kernels: CPUs not made
by Intel, ``INGOT_CPU_F32_GEMM``) or MKL's sgemm: the choice, made once at load, and what runs
under it. The encoder's counterpart is test_pooling_tiny_vs_hf.py's
test_bert_fp32_linears_through_either_gemm."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paged_harness import PagedHarness, hf_greedy
from tiny import hf_model

from ingot import LLM, SamplingParams
from ingot.engine.arg_utils import EngineArgs
from ingot.model_executor.binding import select_kernels
from ingot.model_executor.layers import cpu_kernels, linear
from ingot.model_executor.layers.bindable import Kernels
from ingot.model_executor.loader.model_loader import load_model

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


def _flags(vendor: str) -> str:
    return f"vendor_id\t: {vendor}\nflags\t\t: fpu fma avx avx2\n"


@pytest.fixture(scope="module")
def tiny_decoder(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                        skip_tokenizer_init=True).create_engine_config()
    return load_model(config.model_config, CPU)


@pytest.mark.parametrize(("vendor", "env", "pack"),
                         [("AuthenticAMD", "auto", "f32"), ("GenuineIntel", "auto", None),
                          ("AuthenticAMD", "mkl", None), ("GenuineIntel", "onednn", "f32")])
def test_a_float32_decoder_packs_for_onednn_by_vendor(tiny_decoder, monkeypatch, vendor, env,
                                                      pack):
    """Decided once at load, as for an encoder: oneDNN's packed float32 linear on CPUs not made
    by Intel, MKL's sgemm on Intel's, ``INGOT_CPU_F32_GEMM`` over either. Compiled layers
    (``keep_plain``) and ``INGOT_DISABLE_PACKED_LINEAR`` stay plain; bf16 is another choice."""
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: _flags(vendor))
    monkeypatch.setenv("INGOT_CPU_F32_GEMM", env)
    assert select_kernels(tiny_decoder, torch.float32, CPU).pack == pack
    assert select_kernels(tiny_decoder, torch.float32, CPU, keep_plain=True).pack is None
    monkeypatch.setenv("INGOT_DISABLE_PACKED_LINEAR", "1")
    assert select_kernels(tiny_decoder, torch.float32, CPU).pack is None


def _packed_layers(model: torch.nn.Module) -> list[linear.LinearBase]:
    return [m for m in model.modules()
            if isinstance(m, linear.LinearBase) and m.packed_weight is not None]


def test_packed_decoder_computes_the_plain_decoders_logits(tiny_llama_dir, monkeypatch):
    """On a CPU not made by Intel every linear of a float32 decoder (qkv, o, gate-up and down
    per layer, the LM head) holds oneDNN's copy in its plain weight's place, and prefill and
    decode logits match the plain (MKL) model's within float32 rounding. Broken twin: one
    packed copy made from other values fails the same gate (the copies are what runs)."""
    real = linear.LinearBase.pack_f32_weight

    def logits(vendor: str, perturb: bool = False) -> tuple[list[torch.Tensor], int, int]:
        packed: list = []

        def pack(layer):  # noqa: ANN001, ANN202
            packed.append(layer)
            if perturb and len(packed) == 3:
                layer.weight.data.copy_(layer.weight.data.flip(0))  # outputs out of order
            real(layer)

        monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: _flags(vendor))
        monkeypatch.setattr(linear.LinearBase, "pack_f32_weight", pack)
        h = PagedHarness(tiny_llama_dir)
        assert len(_packed_layers(h.model)) == len(packed)
        assert all(m.weight.numel() == 0 for m in _packed_layers(h.model))  # no plain copy
        rng = random.Random(0)
        prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (7, 19)]
        out = h.step([(i, p, 0) for i, p in enumerate(prompts)])  # packed prefill
        for step in range(3):  # batched decode, then one request alone
            batch = [(i, [5 + step], len(p) + step) for i, p in enumerate(prompts)]
            out += h.step(batch if step < 2 else batch[:1])
        return out, len(packed), len(h.model.model.layers)

    monkeypatch.setenv("INGOT_CPU_F32_GEMM", "auto")
    plain, none, _ = logits("GenuineIntel")
    packed, count, layers = logits("AuthenticAMD")
    assert none == 0 and count == 4 * layers + 1  # the LM head too (not tied here)
    for a, b in zip(packed, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    broken, _, _ = logits("AuthenticAMD", perturb=True)
    assert not all(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                   for a, b in zip(broken, plain, strict=True))


def _prompts(n: int = 16, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def _tokens_and_logprobs(out) -> tuple[list[int], list[float]]:  # noqa: ANN001
    c = out.outputs[0]
    return c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids, strict=True)]


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_f32_rows_are_the_same_whatever_the_batch(threads):
    """Why one kernel serves every row count: a row's output through oneDNN's packed float32
    linear is bit for bit the same alone, in any batch and on any thread count, so a decode
    row equals its verification row and its batched self. Shapes: the default model's qkv,
    down and LM head. Broken twin: MKL's sgemm (the plain weight) rounds differently at this
    width, so the comparison sees a kernel switch (mixing the two by row count would break
    the equality).

    The property is the AVX2 kernels', which is where the engine chooses oneDNN (forced on a
    Xeon with AMX, oneDNN's AVX-512 float32 kernels gave a row other bits at other row counts).
    Where this CPU would run wider ones, a child process caps oneDNN at AVX2
    (``ONEDNN_MAX_CPU_ISA=AVX2``) and checks what an AVX2 CPU runs."""
    if cpu_kernels.onednn_f32_preferred() or os.environ.get("ONEDNN_MAX_CPU_ISA") == "AVX2":
        _packed_f32_rows_are_the_same(threads)
        return
    code = ("import sys; sys.path[:0] = sys.argv[1:]; "
            "from test_f32_decoder_linears import _packed_f32_rows_are_the_same as check; "
            f"check({threads}); print('rows equal')")
    here = Path(__file__).parent
    child = subprocess.run(
        [sys.executable, "-c", code, str(here), str(here.parent)], capture_output=True,
        text=True, timeout=600, env={**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2",
                                     "ONEDNN_VERBOSE": "1"})
    assert child.returncode == 0 and "rows equal" in child.stdout, child.stdout + child.stderr
    # the child's linears really ran oneDNN's AVX2 float32 kernels
    assert "brg_matmul:avx2" in child.stdout or "gemm:jit:avx2" in child.stdout, child.stdout[-2000:]


def _packed_f32_rows_are_the_same(threads: int) -> None:
    torch.manual_seed(0)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((960, 576), (576, 1536), (49152, 576)):
            layer = linear.ReplicatedLinear(k, n)
            layer.weight.data.normal_()
            plain = layer.weight.detach().clone()
            layer.bind_kernels(Kernels(cpu=True, pack="f32"))
            assert layer.packed_weight is not None and layer.weight.numel() == 0
            x = torch.randn(70, k)
            together = layer(x)
            alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
            pieces = torch.cat([layer(x[i : i + 7]) for i in range(0, 70, 7)])
            assert torch.equal(together, alone) and torch.equal(together, pieces)
            mkl = torch.nn.functional.linear(x, plain)
            torch.testing.assert_close(together, mkl, rtol=1e-4, atol=1e-4)
            assert not torch.equal(together, mkl)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.slow
@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
def test_fp32_decoder_through_either_gemm(tiny_llama_dir, monkeypatch, gemm):
    """Through the engine, ``INGOT_CPU_F32_GEMM`` picking either GEMM: greedy tokens equal
    HF's, and a request's tokens are the same alone and in a batch of 16 mixed lengths, its
    logprobs within 1e-4 (not bit for bit: the torch attention's padding to the batch's
    context bucket rounds differently alone and batched)."""
    monkeypatch.setenv("INGOT_CPU_F32_GEMM", gemm)
    packed: list = []
    real = linear.LinearBase.pack_f32_weight
    monkeypatch.setattr(linear.LinearBase, "pack_f32_weight",
                        lambda layer: (packed.append(layer), real(layer)))
    llm = LLM(str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4)
    try:
        assert len(packed) == (9 if gemm == "onednn" else 0)  # 2 layers x 4, the LM head
        prompts = _prompts()
        batched = [_tokens_and_logprobs(o) for o in llm.generate(prompts, GREEDY)]
        hf = hf_model(tiny_llama_dir)
        for i in (0, 5, 15):
            assert batched[i][0] == hf_greedy(hf, prompts[i], 12)
            alone = _tokens_and_logprobs(llm.generate([prompts[i]], GREEDY)[0])
            assert alone[0] == batched[i][0]
            assert all(abs(a - b) < 1e-4 for a, b in zip(alone[1], batched[i][1], strict=True))
    finally:
        llm.llm_engine.shutdown()
