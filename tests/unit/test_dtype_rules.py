"""The dtype rules (issue #32): ``auto`` on CPU is the fastest dtype this CPU computes, bf16
where it runs at full speed (native bf16, or ingot's bf16 kernels in a vector build), else
float32, never emulated half precision; an encoder keeps its prefill-only rule; CUDA keeps
vLLM's rule; an explicit half precision the CPU only emulates gets a warning with its cost.
Platforms and kernel availability are faked, so every case runs on any machine."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ingot.engine.arg_utils import EngineArgs
from ingot.engine.model_resolution import auto_dtype
from ingot.platforms import cpu as cpu_mod
from ingot.platforms.cpu import CpuPlatform
from ingot.platforms.cuda import CudaPlatform

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CHECKPOINTS = [F32, BF16, F16, None]  # None: a config that states no dtype (a GGUF)


def _cpu(monkeypatch: pytest.MonkeyPatch, flags: set[str]) -> type[CpuPlatform]:
    """The CPU platform on a CPU with these /proc/cpuinfo flags (oneDNN present)."""
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(cpu_mod, "_cpu_flags", lambda: frozenset(flags))
    return CpuPlatform


AVX2 = {"sse2", "avx", "avx2", "fma"}
AVX512_BF16 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile"}


def _auto(platform, declared, kernels=None, prefill_only=False):  # noqa: ANN001, ANN202
    return auto_dtype(SimpleNamespace(dtype=declared), platform, prefill_only, lambda: kernels)


@pytest.mark.parametrize("declared", CHECKPOINTS)
def test_avx2_kernels_make_bf16_the_cpu_auto(monkeypatch, declared):
    """AVX2 + FMA and ingot's avx2 build: bf16, for every checkpoint dtype. Broken twin: the
    same CPU without a vector build (kernels off, no compiler, portable only) computes
    float32, as its bf16 would be emulated."""
    cpu = _cpu(monkeypatch, AVX2)
    dtype, reason = _auto(cpu, declared, "avx2")
    assert dtype is BF16
    assert reason.startswith("bf16 weights on ingot's avx2 kernels (float32 arithmetic, half")
    assert _auto(cpu, declared, None).dtype is F32


@pytest.mark.parametrize("declared", CHECKPOINTS)
def test_native_bf16_makes_bf16_the_cpu_auto_without_kernels(monkeypatch, declared):
    """AVX512-BF16 (oneDNN's bf16) with ingot's kernels off: bf16 still, and the reason names
    the flags; with its kernels the reason is theirs (vdpbf16ps dot products)."""
    cpu = _cpu(monkeypatch, AVX512_BF16)
    dtype, reason = _auto(cpu, declared, None)
    assert dtype is BF16 and "natively (avx512_bf16, avx512f" in reason
    dtype, reason = _auto(cpu, declared, "avx512_bf16")
    assert dtype is BF16 and "ingot's avx512_bf16 kernels (bf16 dot products" in reason


@pytest.mark.parametrize("declared", CHECKPOINTS)
def test_no_kernels_and_no_native_bf16_means_float32(monkeypatch, declared):
    """No bf16 arithmetic and no vector build: float32 for fp32, bf16 and fp16 checkpoints
    (a half checkpoint widens exactly), never its own emulated half precision (vLLM's rule,
    which keeps it, is what the CPU rule replaces)."""
    cpu = _cpu(monkeypatch, AVX2)
    dtype, reason = _auto(cpu, declared, None)
    assert dtype is F32 and "bf16 would be emulated" in reason
    assert ("widens exactly" in reason) == (declared in (BF16, F16))
    # The broken twin: vLLM's rule (the base platform's) keeps the half checkpoint.
    if declared in (BF16, F16):
        assert super(CpuPlatform, cpu).auto_dtype(declared, None).dtype is declared


def test_an_fp16_checkpoint_computes_in_bf16_where_that_is_fast_and_says_so(monkeypatch):
    cpu = _cpu(monkeypatch, AVX2)
    dtype, reason = _auto(cpu, F16, "avx2")
    assert dtype is BF16 and "a float16 checkpoint computes in bfloat16 on CPU" in reason
    assert "float16" not in _auto(cpu, BF16, "avx2").reason


@pytest.mark.parametrize("flags", [AVX2, AVX512_BF16])
def test_the_encoder_rule_is_unchanged(monkeypatch, flags):
    """An encoder (prefill only) gets float32 on a CPU without AMX, kernels or not, and never
    asks for the kernels there (the first ask builds the bf16 library); with AMX, bf16."""
    cpu = _cpu(monkeypatch, flags)

    def no_ask() -> str | None:
        raise AssertionError("the encoder rule asked for the bf16 kernels")

    for declared in CHECKPOINTS:
        dtype, reason = auto_dtype(SimpleNamespace(dtype=declared), cpu, True, no_ask)
        assert dtype is F32 and reason.startswith("an encoder only prefills")
    # The decoder twin of the same model on the same CPU: bf16 with the kernels.
    assert _auto(cpu, F32, "avx2").dtype is BF16
    amx = _cpu(monkeypatch, AMX)
    assert amx.prefill_only_dtype() is BF16
    assert _auto(amx, F32, None, prefill_only=True).dtype is BF16


@pytest.mark.parametrize("native", [True, False])
def test_cuda_keeps_vllms_rule(monkeypatch, native):
    """CUDA: a bf16/fp16 checkpoint keeps its dtype, a float32 one takes bf16 where the GPU
    has it, else float32; ingot's CPU kernels play no part."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: native)
    for kernels in (None, "avx2"):
        assert _auto(CudaPlatform, BF16, kernels).dtype is BF16
        assert _auto(CudaPlatform, F16, kernels).dtype is F16  # the CPU rule would say bf16
        assert _auto(CudaPlatform, F32, kernels).dtype is (BF16 if native else F32)
        assert _auto(CudaPlatform, None, kernels).dtype is (BF16 if native else F32)
    assert CudaPlatform.dtype_warning(F16, None) is None


def test_an_explicit_emulated_half_precision_warns_with_its_cost(monkeypatch):
    """bf16 or fp16 given on a CPU without bf16 arithmetic or a vector build: the warning
    names the measured cost and what to pass instead. With the kernels, bf16 says nothing;
    fp16 still warns (the kernels are bf16) and names bfloat16; float32 never warns."""
    cpu = _cpu(monkeypatch, AVX2)
    for dtype in (BF16, F16):
        warning = cpu.dtype_warning(dtype, None)
        assert warning is not None and "only emulates it" in warning
        assert "27.3 s in bf16 against 6.4 s in float32 (4.3x)" in warning
        assert "Pass --dtype float32" in warning
    assert cpu.dtype_warning(BF16, "avx2") is None
    fp16 = cpu.dtype_warning(F16, "avx2")
    assert fp16 is not None and "runs none of ingot's kernels" in fp16
    assert "Pass --dtype bfloat16" in fp16
    assert cpu.dtype_warning(F32, None) is None
    assert _cpu(monkeypatch, AVX512_BF16).dtype_warning(BF16, None) is None


# ---- through EngineArgs: asked once, logged once --------------------------------------------


@pytest.fixture
def no_vector_kernels(monkeypatch):
    """This CPU as one with no bf16 arithmetic and no vector build of ingot's kernels, as
    INGOT_CPU_KERNELS=0 makes it on an AVX2 machine (the loader caches per process, so the
    environment variable alone would not undo an earlier load)."""
    from ingot.model_executor.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "load_cpu_kernels", lambda isa=None: None)
    monkeypatch.setattr(CpuPlatform, "supports_bf16", classmethod(lambda cls: False))


def _config(path, caplog, **kw):  # noqa: ANN001, ANN202
    with caplog.at_level(logging.INFO, logger="ingot"):
        return EngineArgs(model=str(path), device="cpu", skip_tokenizer_init=True,
                          max_model_len=64, **kw).create_engine_config()


def test_engine_args_log_the_auto_choice_once(tiny_llama_dir, caplog, monkeypatch):
    from ingot.model_executor.layers import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "bf16_kernel_isa", lambda: "avx2")
    config = _config(tiny_llama_dir, caplog)
    assert config.model_config.dtype is BF16
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype auto")]
    assert lines == ["dtype auto -> bfloat16: bf16 weights on ingot's avx2 kernels (float32 "
                     "arithmetic, half the bytes of float32)"]


def test_engine_args_without_vector_kernels(tiny_llama_dir, caplog, no_vector_kernels):
    """auto: float32 with its reason; an explicit bf16: kept, with the warning."""
    assert _config(tiny_llama_dir, caplog).model_config.dtype is F32
    assert "dtype auto -> float32: this CPU has no bf16 arithmetic" in caplog.text
    caplog.clear()
    assert _config(tiny_llama_dir, caplog, dtype="bfloat16").model_config.dtype is BF16
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "dtype bfloat16 on a CPU that only emulates it" in warning.getMessage()
    caplog.clear()
    _config(tiny_llama_dir, caplog, dtype="float32")
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "dtype auto" not in caplog.text


def test_bench_defaults_to_auto_and_reports_what_ran():
    from ingot.benchmarks.workloads import ran_with
    from ingot.cli.main import build_parser

    assert build_parser().parse_args(["bench", "single"]).dtype == "auto"

    def fake(dtype, builds):  # noqa: ANN001, ANN202
        engine = SimpleNamespace(model_config=SimpleNamespace(dtype=dtype),
                                 startup_stats=lambda: {"cpu_kernels": builds})
        return SimpleNamespace(llm_engine=engine)

    assert ran_with(fake(BF16, {"bf16": "avx2"})) == "dtype=bfloat16 kernels=avx2"
    assert ran_with(fake(F32, {})) == "dtype=float32 kernels=none"
    assert ran_with(fake(F32, {"bf16": "avx2", "f32": "avx512"})) == \
        "dtype=float32 kernels=bf16:avx2,f32:avx512"
