"""ingot's own CPU kernels for bf16 decode (source: cpu_kernels.c), written once over the vector
layer of cpu_kernels_vec.h and built per ISA (:data:`ISAS`): AVX-512 with AVX512-BF16's
``vdpbf16ps``, AVX-512F, AVX2 + FMA (bf16 widened to float32 in registers by a 16-bit shift,
float32 FMAs: AMD Zen 2/3, older Xeons) and a portable build (plain C the compiler vectorises).
The loader takes the widest build the CPU runs (``INGOT_CPU_ISA`` caps it); tests load each.

Why: a decode step at small batch is a chain of GEMVs whose cost is reading the weights, plus a
few hundred small elementwise ops whose cost is dispatch, not arithmetic. Measured on the
project's 2-core AVX512-BF16 machine (single-stream decode of the default model):
- ``gemv``: the weight pre-packed in blocks of 8 rows (:func:`pack_gemv_weight`) streams at
  ~20 GB/s against ~13.5 GB/s for a row-major walk and ~8.5 GB/s for oneDNN's packed linear on
  these 0.6-3.5 MB matrices. Used up to GEMV_MAX_ROWS rows; beyond, oneDNN's AMX path is faster.
  On an AMD EPYC (Zen 3, AVX2, one thread, a loaded machine) the avx2 build's GEMV over the
  default model's 30 layers' linears and LM head took 25 ms against 65 ms for MKL's float32
  GEMV on float32 weights (half the bytes, and no emulated bf16 compute).
- ``gemm``: more rows on CPUs without AMX, float32 FMAs on bf16 weights widened in registers
  (1.5-2x oneDNN's bf16 GEMM there, whose vdpbf16ps runs at half the FMA rate).
- ``decode_attention``: rotary, the KV-cache write and attention over the paged cache (no
  gather) in one call per layer; q.k as bf16 dot products 16 (8) keys at a time, float32
  softmax.
- ``rms_norm`` (with the residual add) and ``silu_mul``: one call instead of 9 and 3 torch ops.
- ``write_kv``: a prefill chunk's k/v rows into the paged cache (one call for both caches).
- ``rope_write_kv``: a prefill chunk's rotary on q and k, and the cache write, in one call.
- ``argmax`` of bf16 logits for greedy sampling: ~9x faster than torch's on 64 x 49152.
- ``fused_moe`` (bf16 and float32): a mixture-of-experts block's experts in one call, for
  every token of a step (layers/fused_moe.py), instead of a sort, a host sync and two matmuls
  per expert from Python.
Elementwise results round to bf16 at the same points as the torch ops they replace.

Encoder-only models' float32 kernels and OpenMP thread pinning need no bf16 math; they live in a
second library (cpu_kernels_f32.c, :func:`load_f32_kernels`) over the same vector layer.

Each C source is built once per machine and ISA with the system C compiler into the ingot cache
(``$INGOT_CACHE_ROOT/kernels``) and loaded with ctypes; OpenMP is the libgomp torch already
loaded. Without a compiler, or with ``INGOT_CPU_KERNELS=0``, the loaders return None and the
torch ops / oneDNN run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("ingot")

# Rows of x sent to the GEMV kernel. Measured over a model's worth of weights (120 matrices):
# 11.1 / 13.0 / 16.0 ms for 1 / 2 / 3 rows against oneDNN's 17.7 / 16.9 / 19.3; even at 4 rows
# and slower from 6 (oneDNN's AMX path takes over there).
GEMV_MAX_ROWS = 3
# ... and beside ingot's GEMM (CPUs without AMX), which is faster from 3-4 rows: the default
# model's qkv / gate-up / down on both cores (bench/gemm_kernel.py, quiet), GEMV against GEMM:
# 23 / 86 / 35 us against 25 / 94 / 42 at 2 rows, 45 / 131 / 68 against 29 / 79 / 61 at 4.
GEMV_MAX_ROWS_BESIDE_GEMM = 2
GEMV_BLOCK_ROWS, GEMV_BLOCK_K = 8, 32  # the packed layout (GEMV_ROWS in the C source)
# Limits of the decode-attention kernel's fixed-size buffers and vdpbf16ps steps.
ATTN_MAX_HEAD_DIM, ATTN_MAX_GROUP = 256, 16

_SOURCE_PATH = Path(__file__).with_suffix(".c")
_F32_SOURCE_PATH = Path(__file__).with_name("cpu_kernels_f32.c")
_HEADER_PATH = Path(__file__).with_name("cpu_kernels_vec.h")  # included by both sources
_COMMON_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-lm"]


@dataclass(frozen=True)
class KernelIsa:
    """One build of ingot's kernel sources over the vector layer (cpu_kernels_vec.h)."""

    #: /proc/cpuinfo flags the CPU needs to run it.
    cpu_flags: tuple[str, ...]
    #: Compiler flags that select the layer's section.
    cc_flags: tuple[str, ...]
    #: float32 lanes of a vector (the built library reports the width it was compiled for).
    lanes: int
    #: Whether bf16 dot products are native (vdpbf16ps) rather than widened to float32 FMAs.
    native_bf16_dot: bool


_AVX512 = ("-mavx512f", "-mavx512bw", "-mavx512vl")
#: The builds, widest first; the loaders take the first the CPU runs. "portable" (GCC vector
#: extensions, no ISA flags) runs anywhere: the reference, and the build for other CPUs.
ISAS: dict[str, KernelIsa] = {
    "avx512_bf16": KernelIsa(("avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
                             (*_AVX512, "-mavx512bf16"), 16, True),
    "avx512": KernelIsa(("avx512f", "avx512bw", "avx512vl"), _AVX512, 16, False),
    "avx2": KernelIsa(("avx2", "fma"), ("-mavx2", "-mfma"), 8, False),
    "portable": KernelIsa((), (), 8, False),
}
#: The float32 library's builds (it has no bf16 dot product, so "avx512_bf16" would only
#: duplicate "avx512").
F32_ISAS: tuple[str, ...] = ("avx512", "avx2", "portable")
_loaded: dict[str, object] = {}  # library name -> its bound entry points, or None
# library name -> why it is None: "disabled" (INGOT_CPU_KERNELS=0), "no compiler", or the
# failed build's message. Tests skip for the first two and fail for a build that broke.
unavailable: dict[str, str] = {}


_P = ctypes.c_void_p


class DecodeLayer(ctypes.Structure):
    """One decoder layer for ``CpuKernels.decode_layers`` (cpu_kernels.c's
    ``ingot_decode_layer_t``): linears in the order qkv, o, gate_up, down; the norms' weights
    as :meth:`RMSNorm.kernel_weight` gives them (NULL where the layer has no such norm)."""

    _fields_ = [*((name, _P) for name in (
                    "in_w", "post_w", "q_w", "k_w", "attn_out_w", "mlp_out_w")),
                ("gemv_w", _P * 4), ("gemm_w", _P * 4),
                ("quant_w", _P * 4), ("bias", _P * 4), ("qtype", ctypes.c_int32 * 4),
                *((name, ctypes.c_float) for name in (
                    "in_eps", "post_eps", "qk_eps", "attn_out_eps", "mlp_out_eps", "scale")),
                ("window", ctypes.c_int64), ("cos_sin", _P),
                ("zero_centred", ctypes.c_int32), ("act", ctypes.c_int32),
                ("kc", _P), ("vc", _P)]


#: The gated MLP activations ingot's kernels take, by HF name -> the kernels' id.
KERNEL_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


class DecodeStep(ctypes.Structure):
    """One step's sizes, buffers and attention metadata for ``CpuKernels.decode_layers``
    (cpu_kernels.c's ``ingot_decode_step_t``; ``q_rot`` non-NULL: write every key first)."""

    _fields_ = [*((name, ctypes.c_int64) for name in (
                    "rows", "hidden", "inter", "qkv_size", "heads", "kv_heads", "head_dim",
                    "block_size", "width")),
                *((name, _P) for name in (
                    "embedded", "x", "h", "res", "qkv", "attn", "gate_up", "act",
                    "q_rot", "k_rot", "positions", "slots", "table", "seq_lens", "scratch")),
                ("per_thread", ctypes.c_int64), ("quant_linear", _P), ("use_gemv", ctypes.c_int32),
                ("threads", ctypes.c_int32)]


class CpuKernels:
    """The loaded library's entry points, with their ctypes signatures, built for one ISA of
    :data:`ISAS`."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.isa = isa
        _check_build(lib, isa)
        self.gemv = _bind(lib.ingot_gemv_bf16, [p] * 4 + [i64] * 3 + [i32])
        self.gemm = _bind(lib.ingot_gemm_bf16, [p] * 4 + [i64] * 3 + [i32])
        self.gemm.restype = ctypes.c_int
        self.rms_norm = _bind(lib.ingot_rmsnorm_bf16, [p] * 5 + [i64] * 2 + [f32, i32])
        self.rms_norm_zc = _bind(lib.ingot_rmsnorm_zc_bf16, [p] * 5 + [i64] * 2 + [f32, i32])
        self.silu_mul = _bind(lib.ingot_silu_mul_bf16, [p] * 2 + [i64] * 2 + [i32])
        self.gelu_tanh_mul = _bind(lib.ingot_gelu_tanh_mul_bf16, [p] * 2 + [i64] * 2 + [i32])
        #: by KERNEL_ACTIVATIONS id
        self.act_mul = (self.silu_mul, self.gelu_tanh_mul)
        self.decode_attention = _bind(
            lib.ingot_decode_attention_bf16,
            [p, i64, p, i64, p, i64] + [p] * 8 + [i64] * 7 + [f32, p, i64, i32],
        )
        self.argmax = _bind(lib.ingot_argmax_bf16, [p] * 2 + [i64] * 2 + [i32])
        self.write_kv = _bind(
            lib.ingot_write_kv_bf16, [p, i64, p, i64, p, p, p, i64, i64, i32]
        )
        self.rope_write_kv = _bind(
            lib.ingot_rope_write_kv_bf16, [p, i64, p, i64, p, i64] + [p] * 7 + [i64] * 4 + [i32]
        )
        moe_args = [p] * 6 + [i64] * 6 + [i32]
        self.fused_moe = {torch.bfloat16: _bind(lib.ingot_fused_moe_bf16, moe_args),
                          torch.float32: _bind(lib.ingot_fused_moe_f32, moe_args)}
        for fn in self.fused_moe.values():
            fn.restype = i32  # -1: its work buffers could not be allocated
        self.moe_pack = _bind(lib.ingot_moe_pack_bf16, [p] * 2 + [i64] * 3)
        self.decode_layers = _bind(lib.ingot_decode_layers_bf16,
                                   [ctypes.POINTER(DecodeLayer), i64, ctypes.POINTER(DecodeStep)],
                                   i32)


class F32Kernels:
    """The float32 library's entry points (encoder attention and epilogues, thread pinning),
    built for one ISA of :data:`F32_ISAS`."""

    def __init__(self, lib: ctypes.CDLL, isa: str) -> None:
        p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
        self.isa = isa
        self.lanes = _bind(lib.ingot_f32_lanes, [], i32)()
        if self.lanes != ISAS[isa].lanes:
            raise OSError(f"the {isa} float32 kernels were built for {self.lanes} lanes")
        self.encoder_attention = _bind(
            lib.ingot_encoder_attention_f32, [p] * 3 + [i64, p, i64, p] + [i64] * 3 + [f32, p, i64, i32]
        )
        self.bias_gelu = _bind(lib.ingot_bias_gelu_f32, [p, p, i64, i64, i32])
        self.add_layernorm = _bind(lib.ingot_add_layernorm_f32, [p] * 6 + [i64] * 2 + [f32, i32])
        # platforms/cpu_threads.py pins teams with it
        self.bind_threads = _bind(lib.ingot_bind_threads, [ctypes.POINTER(ctypes.c_int), i32], i32)


def _bind(fn, argtypes, restype=None):  # noqa: ANN001, ANN202
    fn.restype = restype
    fn.argtypes = argtypes
    return fn


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    # Read once: the loaders consult it on every call (encoder attention calls one per layer).
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


@functools.lru_cache(maxsize=4)
def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _cpu_has(*flags: str) -> bool:
    # Whole words ("fma" is not "fma4"), split once per text: the greedy sampler asks for the
    # kernels every step (splitting /proc/cpuinfo each time had cost ~4% of a decode step).
    words = _words(_cpu_flags())
    return all(flag in words for flag in flags)


def _check_build(lib: ctypes.CDLL, isa: str) -> None:
    # A compiler that ignored a flag would hand back another section of the vector layer.
    lanes = _bind(lib.ingot_cpu_lanes, [], ctypes.c_int)()
    native = bool(_bind(lib.ingot_cpu_native_bf16_dot, [], ctypes.c_int)())
    if (lanes, native) != (ISAS[isa].lanes, ISAS[isa].native_bf16_dot):
        raise OSError(f"the {isa} kernels were built for {lanes} lanes, native bf16 dot {native}")


def cpu_isas() -> tuple[str, ...]:
    """The builds of :data:`ISAS` this CPU runs, widest first ("portable" always)."""
    return tuple(isa for isa, build in ISAS.items() if _cpu_has(*build.cpu_flags))


def f32_isas() -> tuple[str, ...]:
    """The float32 library's builds this CPU runs, widest first ("portable" always)."""
    runs = cpu_isas()
    return tuple(isa for isa in F32_ISAS if isa in runs)


def has_amx() -> bool:
    """Whether this CPU has AMX's bf16 tiles, on which oneDNN's bf16 linear runs: the one test
    behind every kernel choice that differs on AMX."""
    return _cpu_has("amx_bf16", "amx_tile")


def gemm_preferred() -> bool:
    """Whether bf16 linears of more rows than the GEMV serves run on ingot's GEMM rather than
    oneDNN's: on CPUs without AMX (where oneDNN's bf16 GEMM rides vdpbf16ps at about half the
    float32 FMA rate), unless ``INGOT_CPU_GEMM`` says otherwise (``1`` on, ``0`` off)."""
    choice = os.environ.get("INGOT_CPU_GEMM", "auto")
    if choice not in ("auto", "0", "1"):
        raise ValueError(f"INGOT_CPU_GEMM must be auto, 0 or 1, got {choice!r}")
    if choice != "auto":
        return choice == "1"
    return not has_amx()


#: Rows from which a quantized linear runs dense where ``quant_dense_preferred``: every prefill
#: step (prefill token buckets start at 128 rows) and no decode step of up to 127 requests (the
#: decode program runs those on the quantized kernel whatever their count). Measured on a Xeon
#: with AMX (2 vCPUs, bench/quant_linear.py and the engine): the default model's gate_up at 1024
#: rows 10.4 ms on the quantized kernel, 1.6 ms on oneDNN's bf16 linear plus 1.2 ms to
#: dequantize its Q4_1 blocks; at 64 rows 0.66 ms against 0.26 + 1.2 ms.
QUANT_DENSE_MIN_ROWS = 128


#: Rows from which the quantized library's build with AMX multiplies on AMX int8 tiles (16 x 16
#: int32 dot products per 32-weight block), the same bits as its integer dots: on a Xeon with
#: AMX, gate_up of the default model took 0.15 ms against 0.17 at 16 rows, 0.41 against 0.65
#: at 64 (docs/features.md); below 16 rows a tile would be mostly padding.
QUANT_AMX_MIN_ROWS = 16


def quant_amx_rows() -> int:
    """``QUANT_AMX_MIN_ROWS``, or 0 (never) where ``INGOT_CPU_QUANT_AMX`` is ``off``
    (``auto``: the tiles wherever the build has them and Linux grants them)."""
    choice = os.environ.get("INGOT_CPU_QUANT_AMX", "auto")
    if choice not in ("auto", "off"):
        raise ValueError(f"INGOT_CPU_QUANT_AMX must be auto or off, got {choice!r}")
    return QUANT_AMX_MIN_ROWS if choice == "auto" else 0


def quant_dense_preferred() -> bool:
    """Whether a bf16 model's quantized linears run oneDNN's bf16 linear on the weight
    dequantized per call at ``QUANT_DENSE_MIN_ROWS`` rows and more: on CPUs where oneDNN's bf16
    linear runs on AMX tiles, unless ``INGOT_CPU_QUANT_DENSE`` says otherwise (``on`` or
    ``off``). Elsewhere oneDNN's bf16 GEMM is no faster than the integer dots (AVX-512 BF16
    without AMX) or emulated (AVX2)."""
    choice = os.environ.get("INGOT_CPU_QUANT_DENSE", "auto")
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"INGOT_CPU_QUANT_DENSE must be auto, on or off, got {choice!r}")
    if choice != "auto":
        return choice == "on"
    return (has_amx() and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def onednn_f32_preferred() -> bool:
    """Whether float32 CPU linears (encoders' and decoders', at every row count) run oneDNN's
    packed kernels rather than MKL's sgemm: on CPUs not made by Intel, whose cores MKL's sgemm
    is not tuned for, unless ``INGOT_CPU_F32_GEMM`` says otherwise (``onednn`` or ``mkl``).
    Measured on an AMD EPYC (Zen 3, AVX2, 2 vCPUs): MiniLM's [4096, 384] x [384, 384-1536]
    linears 1.05-1.2x faster on both cores; a decode step's linears of the default model (30
    layers' weights streamed from memory, the LM head) in 0.80x MKL's time at 1 row and
    0.42-0.70x at 2-64 rows on both cores, 1.17x at 1 row and 0.59-0.80x at 2-64 rows on one
    thread (bench/gemm_kernel.py --pass). A row's output comes out the same bit for bit
    whatever the rows beside it (tested; MKL's differs from 2 rows on). On the Intel AVX-512
    machine MKL was faster."""
    choice = os.environ.get("INGOT_CPU_F32_GEMM", "auto")
    if choice not in ("auto", "onednn", "mkl"):
        raise ValueError(f"INGOT_CPU_F32_GEMM must be auto, onednn or mkl, got {choice!r}")
    if choice != "auto":
        return choice == "onednn"
    info = _cpu_flags()
    return "vendor_id" in info and "GenuineIntel" not in info


def _kernel_dir() -> Path:
    from ingot.compilation.cache import default_cache_root

    return default_cache_root() / "kernels"


def _build(compiler: str, source_path: Path, flags: list[str]) -> Path:
    source = source_path.read_text()
    flags = [*flags, f"-I{_HEADER_PATH.parent}"]
    digest = hashlib.sha256((source + _HEADER_PATH.read_text() + " ".join(flags) + compiler).encode()
                            ).hexdigest()[:16]
    target = _kernel_dir() / f"ingot_{source_path.stem}_{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / "kernels.c"
        src.write_text(source)
        staged = Path(tmp) / target.name
        subprocess.run(
            [compiler, str(src), "-o", str(staged), *flags],
            check=True, capture_output=True, text=True, timeout=120,
        )
        os.replace(staged, target)  # atomic: a concurrent process sees all of it or nothing
    logger.info("built ingot's CPU kernels: %s", target)
    return target


def _load(name: str, source_path: Path, flags: list[str], bind):  # noqa: ANN001, ANN202
    """One library, built and loaded once per process: ``bind(CDLL)``, or None where it cannot
    be used (disabled, no compiler, a failed build)."""
    if name in _loaded:
        return _loaded[name]
    _loaded[name] = None
    if os.environ.get("INGOT_CPU_KERNELS", "1") == "0":
        unavailable[name] = "disabled"
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: ingot's CPU kernels are off, torch ops and oneDNN run")
        unavailable[name] = "no compiler"
        return None
    try:
        kernels = bind(ctypes.CDLL(str(_build(compiler, source_path, flags))))
    except (OSError, AttributeError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("ingot's CPU kernels (%s) are unavailable (%s): using torch ops", name, detail)
        unavailable[name] = f"the build failed: {detail}"
        return None
    _loaded[name] = kernels
    return kernels


def _pick(isa: str | None, builds: tuple[str, ...], runs: tuple[str, ...]) -> str | None:
    # The widest build this CPU runs (at most INGOT_CPU_ISA's where set: an AVX-512 machine
    # can run what an AVX2 CPU would), or the one asked for (None where the CPU cannot run it).
    if isa is None:
        cap = os.environ.get("INGOT_CPU_ISA")
        if cap is not None:
            if cap not in ISAS:
                raise ValueError(f"INGOT_CPU_ISA must be one of {list(ISAS)}, got {cap!r}")
            runs = tuple(r for r in runs if list(ISAS).index(r) >= list(ISAS).index(cap))
        return next((r for r in runs if r in builds), None)
    if isa not in builds:
        raise ValueError(f"unknown CPU kernel ISA {isa!r}; one of {list(builds)}")
    return isa if isa in runs else None


def load_cpu_kernels(isa: str | None = None) -> CpuKernels | None:
    """The bf16 decode kernels (and the fused MoE) for ``isa`` (one of :data:`ISAS`; default:
    the widest this CPU runs, so every caller of the default shares one build), built and
    loaded once per process; None where they cannot be used."""
    isa = _pick(isa, tuple(ISAS), cpu_isas())
    if isa is None:
        return None
    flags = [*ISAS[isa].cc_flags, *_COMMON_FLAGS]
    return _load(f"bf16-{isa}", _SOURCE_PATH, flags, lambda lib: CpuKernels(lib, isa))


def bf16_kernel_isa() -> str | None:
    """The ISA of the bf16 library's build that serves bf16 models here when it is a vector
    build (avx2 or wider: bf16 at full speed, in float32 registers where the CPU has no bf16
    dot product); None where none loads (``INGOT_CPU_KERNELS=0``, no compiler, a failed build)
    or only the portable one does. The CPU's ``auto`` dtype asks it (engine/arg_utils.py:
    platforms cannot import this layer, so the engine passes the answer in)."""
    kernels = load_cpu_kernels()
    return None if kernels is None or kernels.isa == "portable" else kernels.isa


def load_f32_kernels(isa: str | None = None) -> F32Kernels | None:
    """The float32 kernels for ``isa`` (one of :data:`F32_ISAS`; default: the widest this CPU
    runs), built and loaded once per process; None where they cannot be used."""
    isa = _pick(isa, F32_ISAS, f32_isas())
    if isa is None:
        return None
    flags = [*ISAS[isa].cc_flags, *_COMMON_FLAGS]
    return _load(f"f32-{isa}", _F32_SOURCE_PATH, flags, lambda lib: F32Kernels(lib, isa))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def pack_gemv_weight(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 -> the GEMV kernel's layout: blocks of 8 rows, each as K/32 steps of
    [8][32], zero-padded to whole blocks."""
    n, k = weight.shape
    n_pad = -(-n // GEMV_BLOCK_ROWS) * GEMV_BLOCK_ROWS
    k_pad = -(-k // GEMV_BLOCK_K) * GEMV_BLOCK_K
    padded = weight.new_zeros(n_pad, k_pad)
    padded[:n, :k] = weight
    blocks = padded.view(n_pad // GEMV_BLOCK_ROWS, GEMV_BLOCK_ROWS, k_pad // GEMV_BLOCK_K,
                         GEMV_BLOCK_K)
    return blocks.transpose(1, 2).contiguous()


def gemv_bf16(
    kernels: CpuKernels,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] bf16, ``packed`` from :func:`pack_gemv_weight`, bias float32 or None
    -> [M, out_features] bf16."""
    return _packed_matmul(kernels.gemv, x, packed, out_features, bias)


def _packed_matmul(kernel, x: torch.Tensor, packed: torch.Tensor, out_features: int,  # noqa: ANN001
                   bias: torch.Tensor | None) -> torch.Tensor:
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, out_features, dtype=torch.bfloat16)
    # The GEMV returns nothing, the GEMM nonzero when it could not get its row buffers.
    if kernel(x.data_ptr(), packed.data_ptr(), _ptr(bias), y.data_ptr(), m, out_features, k,
              torch.get_num_threads()):
        raise MemoryError(f"GEMM kernel: no memory for its {k}-wide row buffers")
    return y


def pack_gemm_weight(kernels: CpuKernels, weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bf16 (K even) -> the GEMM kernel's layout, the MoE kernel's for one matrix:
    blocks of 16 rows, each K/2 steps of [16 rows][2] (zero rows pad the last block)."""
    n, k = weight.shape
    weight = weight.contiguous()
    packed = torch.empty(-(-n // 16), k // 2, 32, dtype=torch.bfloat16)
    kernels.moe_pack(weight.data_ptr(), packed.data_ptr(), 1, n, k)
    return packed


def gemm_bf16(
    kernels: CpuKernels,
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] bf16, ``packed`` from :func:`pack_gemm_weight`, bias float32 or None
    -> [M, out_features] bf16 (float32 FMAs on the widened weights)."""
    return _packed_matmul(kernels.gemm, x, packed, out_features, bias)


def rms_norm_bf16(
    kernels: CpuKernels,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of bf16 rows (x [..., N], weight [N] bf16; with ``zero_centred``, Gemma's: weight
    float32 1 + w, one rounding), with the residual add when given: returns out, or
    (out, x + residual) like :class:`RMSNorm`."""
    x = x.contiguous()
    n = x.shape[-1]
    m = x.numel() // n
    out = torch.empty_like(x)
    new_residual = None
    if residual is not None:
        residual = residual.contiguous()
        new_residual = torch.empty_like(x)
    norm = kernels.rms_norm_zc if zero_centred else kernels.rms_norm
    norm(x.data_ptr(), _ptr(residual), weight.data_ptr(), out.data_ptr(), _ptr(new_residual), m,
         n, eps, torch.get_num_threads())
    return out if new_residual is None else (out, new_residual)


def act_mul_bf16(kernels: CpuKernels, gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """[M, 2I] bf16 (gate then up) -> act(gate) * up, [M, I] bf16 (``act``: a name of
    :data:`KERNEL_ACTIVATIONS`)."""
    gate_up = gate_up.contiguous()
    m, two_i = gate_up.shape
    out = torch.empty(m, two_i // 2, dtype=torch.bfloat16)
    kernels.act_mul[KERNEL_ACTIVATIONS[act]](gate_up.data_ptr(), out.data_ptr(), m, two_i // 2,
                                             torch.get_num_threads())
    return out


def decode_attention_supported(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    return (
        num_heads % num_kv_heads == 0
        and head_dim % 32 == 0
        and head_dim <= ATTN_MAX_HEAD_DIM
        and num_heads // num_kv_heads <= ATTN_MAX_GROUP
    )


def _rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A [T, heads, head_dim] (or [T, n]) view whose rows may be strided, with each row's heads
    contiguous: (tensor, row stride in elements); copied when that does not hold."""
    if t.stride(-1) != 1 or (t.dim() == 3 and t.stride(1) != t.shape[2]):
        t = t.contiguous()
    return t, t.stride(0)


def attention_scratch(num_heads: int, max_keys: int, threads: int) -> tuple[torch.Tensor, int]:
    """The decode-attention kernel's float32 work space: per thread, the scores and the bf16
    probabilities of up to ``num_heads`` query heads over ``max_keys`` keys (padded to 16).
    Returns (buffer, floats per thread)."""
    per_thread = 2 * num_heads * (max_keys + 16)
    return torch.empty(threads * per_thread, dtype=torch.float32), per_thread


def decode_attention_bf16(
    kernels: CpuKernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    positions: torch.Tensor | None = None,
    cos_sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode token per sequence: query [B, H, D], key/value [B, Hkv, D] bf16 (rows may be
    strided views into a fused qkv output). Writes key/value into kv_cache [2, num_blocks,
    block_size, Hkv, D] at slot_mapping (-1 = skip; None = nothing to write), then attends over each sequence's first
    seq_lens keys (the last ``sliding_window`` of them when given). With ``positions`` and
    ``cos_sin`` ([max_position, 2, D] bf16) q and k are rotated first (NeoX). -> [B, H * D]."""
    num_reqs, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    query, q_stride = _rows(query)
    key, k_stride = _rows(key)
    value, v_stride = _rows(value)
    block_table = block_table.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    slots = None if slot_mapping is None else slot_mapping.to(torch.int64).contiguous()
    width = block_table.shape[1]
    threads = torch.get_num_threads()
    scratch, per_thread = attention_scratch(num_heads, width * block_size, threads)
    out = torch.empty(num_reqs, num_heads * head_dim, dtype=torch.bfloat16)
    if positions is not None:
        positions = positions.to(torch.int64).contiguous()
    kernels.decode_attention(
        query.data_ptr(), q_stride, key.data_ptr(), k_stride, value.data_ptr(), v_stride,
        _ptr(positions), _ptr(cos_sin), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        _ptr(slots), block_table.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        num_reqs, num_heads, num_kv_heads, head_dim, block_size, width, sliding_window or 0,
        scale, scratch.data_ptr(), per_thread, threads,
    )
    return out


def argmax_bf16(kernels: CpuKernels, logits: torch.Tensor) -> torch.Tensor:
    """[M, N] bf16 -> [M] int64, exactly torch.argmax(dim=-1) (first index on ties, NaN wins)."""
    logits = logits.contiguous()
    m, n = logits.shape
    out = torch.empty(m, dtype=torch.int64)
    kernels.argmax(logits.data_ptr(), out.data_ptr(), m, n, torch.get_num_threads())
    return out


def write_kv_bf16(
    kernels: CpuKernels,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key/value [T, Hkv, D] bf16 (rows may be strided) into kv_cache [2, num_blocks,
    block_size, Hkv, D] at slot_mapping (-1 = not written)."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key, k_stride = _rows(key)
    value, v_stride = _rows(value)
    slots = slot_mapping.to(torch.int64).contiguous()
    kernels.write_kv(
        key.data_ptr(), k_stride, value.data_ptr(), v_stride, kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(), slots.data_ptr(), key.shape[0], num_kv_heads * head_dim,
        torch.get_num_threads(),
    )


def rope_write_kv_bf16(
    kernels: CpuKernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A prefill chunk: query [T, H, D], key/value [T, Hkv, D] bf16 (rows may be strided views
    into a fused qkv output). Rotates query and key at ``positions`` (NeoX, ``cos_sin``
    [max_position, 2, D] bf16, rounding as :class:`RotaryEmbedding`), writes the rotated key and
    the value into kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping (-1 = not
    written) and returns the rotated (query, key), contiguous."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    query, q_stride = _rows(query)
    key, k_stride = _rows(key)
    value, v_stride = _rows(value)
    positions = positions.to(torch.int64).contiguous()
    slots = slot_mapping.to(torch.int64).contiguous()
    q_out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.bfloat16)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=torch.bfloat16)
    kernels.rope_write_kv(
        query.data_ptr(), q_stride, key.data_ptr(), k_stride, value.data_ptr(), v_stride,
        positions.data_ptr(), cos_sin.data_ptr(), q_out.data_ptr(), k_out.data_ptr(),
        kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), slots.data_ptr(), num_tokens,
        num_heads, num_kv_heads, head_dim, torch.get_num_threads(),
    )
    return q_out, k_out


def encoder_attention_f32(
    kernels: F32Kernels,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    starts: torch.Tensor,
    scale: float,
    max_len: int,
) -> torch.Tensor:
    """Bidirectional attention within each packed sequence: query/key/value [T, H, D] float32
    (rows may be strided views into a fused qkv output, all three with the same strides),
    sequence b at rows starts[b] .. starts[b+1]-1 (``starts`` [B + 1], ``max_len`` its longest
    span). -> [T, H * D]; rows past starts[-1] are zero."""
    num_tokens, num_heads, head_dim = query.shape
    query, stride = _rows(query)
    key, value = key, value
    if _rows(key)[1] != stride or _rows(value)[1] != stride or key.stride() != query.stride() \
            or value.stride() != query.stride():
        query, key, value = query.contiguous(), key.contiguous(), value.contiguous()
        stride = query.stride(0)
    starts = starts.to(torch.int64).contiguous()
    threads = torch.get_num_threads()
    per_thread = (head_dim + 8) * (max_len + 32)  # the kernel's [D][Lp] keys + [8][Lp] scores
    scratch = torch.empty(threads * per_thread, dtype=torch.float32)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=torch.float32)
    end = int(starts[-1])
    out[end:] = 0
    kernels.encoder_attention(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), stride, out.data_ptr(),
        out.stride(0), starts.data_ptr(), starts.numel() - 1, num_heads, head_dim, scale,
        scratch.data_ptr(), per_thread, threads,
    )
    return out


def bias_gelu_f32_(kernels: F32Kernels, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """x = gelu(x + bias) in place (erf GELU, as ``F.gelu``): x [M, N] contiguous float32, bias
    [N] float32. The epilogue of a linear run without its bias (``torch.mm``)."""
    assert x.is_contiguous() and x.dtype == torch.float32 and bias.dtype == torch.float32
    m, n = x.shape
    kernels.bias_gelu(x.data_ptr(), bias.data_ptr(), m, n, torch.get_num_threads())
    return x


def add_layernorm_f32(
    kernels: F32Kernels,
    x: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.layer_norm(x + bias + residual, weight, norm_bias, eps)`` over the last dim of
    float32 rows in one pass (bias / residual may be None); ``out`` may be ``x`` (in place)."""
    x = x.contiguous()
    n = x.shape[-1]
    if residual is not None:
        residual = residual.contiguous()
    out = torch.empty_like(x) if out is None else out
    kernels.add_layernorm(x.data_ptr(), _ptr(bias), _ptr(residual), weight.data_ptr(),
                          norm_bias.data_ptr(), out.data_ptr(), x.numel() // n, n, eps,
                          torch.get_num_threads())
    return out


def pack_moe_weights(kernels: CpuKernels, w13: torch.Tensor, w2: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 stacked experts -> the fused MoE kernel's layout: each [N, K] matrix as blocks of
    16 rows, each K/2 steps of [16 rows][2] (zero rows pad the last block). Gate and up are
    packed apart (w13 [E, 2I, H] -> [E, 2, ceil(I/16), H/2, 32]), down [E, H, I] -> [E,
    ceil(H/16), I/2, 32]. H and I must be even."""
    num_local, two_inter, hidden = w13.shape
    inter = two_inter // 2
    gate_up = w13.reshape(num_local * 2, inter, hidden).contiguous()
    w13p = torch.empty(num_local, 2, -(-inter // 16), hidden // 2, 32, dtype=torch.bfloat16)
    kernels.moe_pack(gate_up.data_ptr(), w13p.data_ptr(), num_local * 2, inter, hidden)
    w2 = w2.contiguous()
    w2p = torch.empty(num_local, -(-hidden // 16), inter // 2, 32, dtype=torch.bfloat16)
    kernels.moe_pack(w2.data_ptr(), w2p.data_ptr(), num_local, hidden, inter)
    return w13p, w2p


def fused_moe(
    kernels: CpuKernels,
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_start: int,
    num_local: int,
    inter: int,
) -> torch.Tensor:
    """The experts of a MoE block for every token: x [T, H], routing ``weights`` [T, k]
    (float32) and global expert ``ids`` [T, k]; ``w13``/``w2`` hold the ``num_local`` local
    experts ``expert_start`` .. (an EP block and/or a TP slice ``inter`` of I; the other
    experts' slots contribute nothing): float32 as stacked ([E_L, 2 I_L, H] gate rows then up
    rows, [E_L, H, I_L]), bfloat16 from :func:`pack_moe_weights`. Returns [T, H] in x's dtype,
    ``sum_j weights[t, j] * down(silu(gate(x[t])) * up(x[t]))`` over local experts."""
    x = x.contiguous()
    num_tokens, hidden = x.shape
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    status = kernels.fused_moe[x.dtype](
        x.data_ptr(), ids.data_ptr(), weights.data_ptr(), w13.data_ptr(), w2.data_ptr(),
        out.data_ptr(), num_tokens, ids.shape[1], expert_start, num_local, hidden, inter,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError(f"fused MoE kernel: no memory for the work buffers of {num_tokens} "
                          f"tokens x {ids.shape[1]} experts (lower --max-num-batched-tokens)")
    return out


def bind_openmp_team(cpus: tuple[int, ...]) -> bool | None:
    """Bind the calling thread's OpenMP team, thread i -> cpus[i], with the float32 library's
    per-thread binding; None where that library cannot build (the caller falls back)."""
    kernels = load_f32_kernels()
    if kernels is None:
        return None
    arr = (ctypes.c_int * len(cpus))(*cpus)
    return kernels.bind_threads(arr, len(cpus)) == 0


# ---- GGUF-quantized weights (cpu_kernels_quant.c) ----------------------------------------------
# Issue #33's kernels: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 weights kept as the file's blocks, Q4_K /
# Q5_K / Q6_K as per-32 blocks with float32 scales (repacked 8 rows interleaved), activations quantized
# per 32 to int8 (llama.cpp's Q8_1 scheme), integer dot products. The GGUF loader keeps those
# types (loader/gguf_loader.py, layers/quantized.py); docs/features.md ("Quantized weights
# (GGUF)") has the measurements.

_QUANT_SOURCE_PATH = Path(__file__).with_name("cpu_kernels_quant.c")
#: The quantized library's builds (no bf16 arithmetic, so "avx512_bf16" would duplicate
#: "avx512"). Each x86 build also needs F16C (every AVX2 CPU has it) for the f16 block scales,
#: and takes vpdpbusd where the CPU has AVX512-VNNI (avx512) or AVX-VNNI (avx2).
QUANT_ISAS: tuple[str, ...] = ("avx512", "avx2", "portable")
_QUANT_EXTRA = {"avx512": (("f16c",), ("-mf16c",), ("avx512_vnni", "-mavx512vnni")),
                "avx2": (("f16c",), ("-mf16c",), ("avx_vnni", "-mavxvnni")),
                "portable": ((), (), None)}
#: Rows interleaved in a repacked group (QROWS in the C source).
QUANT_GROUP_ROWS = 8
#: GGUF type name -> (GGML type id, bytes of one block in the file: 32 weights, a K-quant's
#: super-block 256, bytes of one repacked (group, block): 8 rows' 32 weights). Repacked, each
#: 32 weights of a K-quant are a block of their own with float32 scales.
QUANT_TYPES: dict[str, tuple[int, int, int]] = {
    "Q4_0": (2, 18, 144),
    "Q4_1": (3, 20, 160),
    "Q5_0": (6, 22, 176),
    "Q5_1": (7, 24, 192),
    "Q8_0": (8, 34, 272),
    "Q4_K": (12, 144, 192),
    "Q5_K": (13, 176, 224),
    "Q6_K": (14, 210, 320),
}
#: The K-quants among them: 256-weight super-blocks in the file.
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
#: The 5-bit types among them: a fifth bit per weight beside the nibbles.
FIVE_BIT = ("Q5_0", "Q5_1", "Q5_K")


def quant_block_weights(qtype: str) -> int:
    """Weights of one block of ``qtype`` in the file (whole ones of them make a row)."""
    return 256 if qtype in K_QUANTS else 32


class QuantKernels:
    """The quantized library's entry points, built for one ISA of :data:`QUANT_ISAS`."""

    def __init__(self, lib: ctypes.CDLL, isa: str, amx_rows: int = 0) -> None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self.isa = isa
        lanes = _bind(lib.ingot_quant_lanes, [], i32)()
        if lanes != ISAS[isa].lanes:
            raise OSError(f"the {isa} quantized kernels were built for {lanes} lanes")
        #: 0 lane loops (portable), 1 vpmaddubsw + vpmaddwd, 2 vpdpbusd (VNNI)
        self.dot_kind = _bind(lib.ingot_quant_dot_kind, [], i32)()
        if (self.dot_kind == 0) != (isa == "portable"):
            raise OSError(f"the {isa} quantized kernels were built without its integer dots")
        group_bytes = _bind(lib.ingot_quant_group_bytes, [i32], i64)
        for name, (type_id, _, size) in QUANT_TYPES.items():
            if group_bytes(type_id) != size:
                raise OSError(f"the quantized kernels' {name} groups are not {size} bytes")
        self.quantize_q8_1 = _bind(lib.ingot_quantize_q8_1, [p, i32, i64, i64] + [p] * 4 + [i32])
        self.matmul = _bind(lib.ingot_quant_matmul, [i32] + [p] * 7 + [i32] + [i64] * 3 + [i32],
                            i32)
        self.linear = _bind(lib.ingot_quant_linear, [i32, p, i32, p, p, p, i32] + [i64] * 3 + [i32],
                            i32)
        #: ingot_quant_linear's address, for the bf16 library's decode loop to call
        self.linear_address = ctypes.cast(lib.ingot_quant_linear, ctypes.c_void_p).value
        self.dequantize = _bind(lib.ingot_quant_dequantize, [i32, p, p, i32, i64, i64, i32], i32)
        #: (min rows) -> whether steps of that many rows and more run on AMX tiles from now on
        #: (0: never; only a build with AMX, where Linux grants the tiles, says yes)
        self.amx_setup = _bind(lib.ingot_quant_amx_setup, [i32], i32)
        #: whether this build multiplies steps of ``amx_rows`` rows and more on AMX tiles
        self.amx = bool(self.amx_setup(amx_rows))
        self.dequantize_rows = _bind(lib.ingot_quant_dequantize_rows,
                                     [i32, p, i64, p, i64, p, i32, i64, i32], i32)


def quant_isas() -> tuple[str, ...]:
    """The quantized library's builds this CPU runs, widest first ("portable" always)."""
    runs = cpu_isas()
    return tuple(isa for isa in QUANT_ISAS if isa in runs and _cpu_has(*_QUANT_EXTRA[isa][0]))


#: Suffix of a test build: the quantized library's build without the VNNI dot product on a CPU
#: that has it, i.e. the integer dots (vpmaddubsw + vpmaddwd) a CPU with the same vectors and
#: no VNNI runs (an AMD Zen 3 the avx2 one, a Skylake-X the avx512 one).
QUANT_NO_VNNI = "-novnni"


def quant_builds_here() -> tuple[str, ...]:
    """Every quantized build this CPU runs, for the tests: :func:`quant_isas`, and where the
    CPU has VNNI, those builds without it too (both dot products are then tested here)."""
    runs = quant_isas()
    return runs + tuple(isa + QUANT_NO_VNNI for isa in runs
                        if _QUANT_EXTRA[isa][2] is not None and _cpu_has(_QUANT_EXTRA[isa][2][0]))


def load_quant_kernels(isa: str | None = None) -> QuantKernels | None:
    """The GGUF-quantized kernels for ``isa`` (one of :data:`QUANT_ISAS`, or one with
    :data:`QUANT_NO_VNNI` for the tests; default: the widest this CPU runs), built and loaded
    once per process; None where they cannot be used. Built with ``-ffp-contract=off``: no
    fused multiply-adds, so every build gives the same bits."""
    no_vnni = isa is not None and isa.endswith(QUANT_NO_VNNI)
    isa = _pick(isa.removesuffix(QUANT_NO_VNNI) if isa else None, QUANT_ISAS, quant_isas())
    if isa is None:
        return None
    _, extra_flags, vnni = _QUANT_EXTRA[isa]
    flags = [*ISAS[isa].cc_flags, *extra_flags, *_COMMON_FLAGS, "-ffp-contract=off"]
    if vnni is not None and _cpu_has(vnni[0]) and not no_vnni:
        flags.append(vnni[1])
    if isa == "avx512" and _cpu_has("amx_tile", "amx_int8"):
        flags += ["-mamx-tile", "-mamx-int8"]  # the AMX tiles' path for many rows
    amx_rows = quant_amx_rows()  # (a bad INGOT_CPU_QUANT_AMX raises here, before any caching)
    return _load(f"quant-{isa}{QUANT_NO_VNNI if no_vnni else ''}", _QUANT_SOURCE_PATH, flags,
                 lambda lib: QuantKernels(lib, isa, amx_rows))


def pack_quant_weight(raw, qtype: str, n: int, k: int) -> torch.Tensor:  # noqa: ANN001
    """A GGUF tensor's bytes (``raw``: [N, K/32 * block bytes] uint8, numpy or torch, rows in
    the file's order) -> the quantized kernels' layout, [ceil(N/8), K/32, group bytes] uint8:
    per group of 8 rows and block of 32 weights, the 8 rows' scales (f16; float32 for the
    K-quants), then their mins (Q4_1, Q5_1, K-quants), then the 5-bit types' fifth bits, then
    the weights 4 per row in turn (cpu_kernels_quant.c). The legacy types' bytes are the file's,
    rearranged; a K-quant's blocks take d * scale and -(dmin * min), exact in float32. Rows past
    N are zero blocks."""
    if qtype not in QUANT_TYPES:
        raise ValueError(f"no quantized kernel for {qtype}; one of {list(QUANT_TYPES)}")
    per = quant_block_weights(qtype)
    if k % per:
        raise ValueError(f"{qtype} rows of {k} weights are not whole {per}-weight blocks")
    _, block_bytes, _ = QUANT_TYPES[qtype]
    nb, rows = k // 32, QUANT_GROUP_ROWS
    if getattr(raw, "flags", None) is not None and not raw.flags.writeable:
        raw = raw.copy()  # numpy over a read-only map: torch wants memory it may write
    groups = -(-n // rows)
    row_bytes = k // per * block_bytes
    flat = torch.as_tensor(raw).view(torch.uint8).reshape(n, row_bytes)
    if groups * rows != n:
        flat = torch.cat([flat, flat.new_zeros(groups * rows - n, row_bytes)])
    if qtype == "Q6_K":
        scales, mins, q = _q6_k_blocks(flat, groups * rows, k)  # mins: the second scales
    elif qtype in K_QUANTS:
        scales, mins, q = _k_quant_blocks(flat, qtype, groups * rows, k)
    else:
        blocks = flat.view(groups * rows, nb, block_bytes)
        scales, mins = blocks[..., 0:2], blocks[..., 2:4] if qtype in ("Q4_1", "Q5_1") else None
        if qtype == "Q8_0":
            q = blocks[..., 2:34]
        else:
            first = 2 + (2 if mins is not None else 0) + (4 if qtype in FIVE_BIT else 0)
            nibbles = blocks[..., first:first + 16]  # low: weight e, high: weight e + 16
            q = torch.cat([nibbles & 15, nibbles >> 4], -1)  # [N, nb, 32], weight order
            if qtype in FIVE_BIT:  # bit e of the little-endian qh: weight e's fifth
                qh = blocks[..., first - 4:first].to(torch.int64)
                word = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
                q = q | (((word[..., None] >> torch.arange(32)) & 1) << 4).to(torch.uint8)

    def by_group(t: torch.Tensor) -> torch.Tensor:  # [N, nb, x] -> [G, nb, 8 rows * x]
        return t.reshape(groups, rows, nb, -1).transpose(1, 2).reshape(groups, nb, -1)

    parts = [by_group(scales)]
    if mins is not None:
        parts.append(by_group(mins))
    q = q.reshape(groups, rows, nb, 32).transpose(1, 2)  # [G, nb, 8, 32]
    if qtype in ("Q8_0", "Q6_K"):  # weight 4c + j of row r -> chunk c, lane r, byte j
        parts.append(q.reshape(groups, nb, rows, 8, 4).transpose(2, 3).reshape(groups, nb, -1))
        return torch.cat(parts, -1).contiguous()
    # weight 8c + 4h + j of row r -> chunk c, lane r, byte j, low nibble (h 0) or high (h 1);
    # its fifth bit -> row r's qh byte j, bit 2c + h
    q = q.reshape(groups, nb, rows, 4, 2, 4)
    if qtype in FIVE_BIT:
        bits = ((q >> 4) & 1).permute(0, 1, 2, 5, 3, 4).reshape(groups, nb, rows, 4, 8)
        parts.append((bits.to(torch.int32) << torch.arange(8, dtype=torch.int32)).sum(-1)
                     .to(torch.uint8).reshape(groups, nb, -1))
    q = (q & 15).permute(0, 1, 3, 2, 4, 5)
    parts.append((q[..., 0, :] | (q[..., 1, :] << 4)).reshape(groups, nb, 16 * rows))
    return torch.cat(parts, -1).contiguous()


def _q6_k_blocks(flat: torch.Tensor, n: int, k: int,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q6_K tensor's super-blocks ([N, K/256 * 210] uint8) as 32-weight blocks: (the float32
    scale d * sc of the first 16 weights of each block and of the last 16, as bytes [N, K/32,
    4] each, q - 32 as int8 bytes [N, K/32, 32]), as the gguf package dequantizes them: w =
    (d * sc) (q - 32), q = 4 bits of ql and 2 of qh."""
    sb = flat.view(n, k // 256, 210)
    ql, qh = sb[..., :128].reshape(n, -1, 2, 1, 64), sb[..., 128:192].reshape(n, -1, 2, 1, 32)
    sc = sb[..., 192:208].contiguous().view(torch.int8).float()  # [N, S, 16]
    d = sb[..., 208:210].contiguous().view(torch.float16).float()
    # weights 128h .. of a super-block: ql[64h:] low nibbles then high; qh[32h:] 2 bits each
    low = (ql >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 15
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 1, 4, 1)) & 3
    q = (low.reshape(n, -1, 8, 32) | (high.reshape(n, -1, 8, 32) << 4)).to(torch.int16) - 32
    scale = (d * sc).reshape(n, k // 32, 2)  # exact: 11 x 8 significant bits
    return (scale[..., 0].contiguous().view(torch.uint8).reshape(n, k // 32, 4),
            scale[..., 1].contiguous().view(torch.uint8).reshape(n, k // 32, 4),
            q.to(torch.int8).view(torch.uint8).reshape(n, k // 32, 32))


def _k_quant_blocks(flat: torch.Tensor, qtype: str, n: int, k: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A K-quant tensor's super-blocks ([N, K/256 * bytes] uint8) as 32-weight blocks: (the
    float32 scale d * sc and min -(dmin * m) of each block as bytes [N, K/32, 4] each, the
    weights 0..15 or 0..31 [N, K/32, 32] uint8), as the gguf package dequantizes them: w =
    (d * sc) q - dmin m."""
    sb = flat.view(n, k // 256, QUANT_TYPES[qtype][1])
    d = sb[..., 0:2].contiguous().view(torch.float16).float()
    dmin = sb[..., 2:4].contiguous().view(torch.float16).float()
    sc_bytes = sb[..., 4:16]
    a, b, c = sc_bytes[..., 0:4], sc_bytes[..., 4:8], sc_bytes[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], -1).float()  # [N, S, 8]
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], -1).float()
    scale = (d * sc).reshape(n, -1, 1)  # both exact: 11 x 6 significant bits
    low = -(dmin * mn).reshape(n, -1, 1)
    qs = sb[..., -128:].reshape(n, k // 256, 4, 1, 32)
    q = ((qs >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 1, 2, 1)) & 15)
    q = q.reshape(n, k // 256, 8, 32)  # sub-block 2p: low nibbles of qs[32p:], 2p + 1: high
    if qtype == "Q5_K":  # bit i of qh[e]: sub-block i's weight e
        qh = sb[..., 16:48].reshape(n, k // 256, 1, 32)
        q = q | (((qh >> torch.arange(8, dtype=torch.uint8).view(1, 1, 8, 1)) & 1) << 4)
    return (scale.contiguous().view(torch.uint8), low.contiguous().view(torch.uint8),
            q.reshape(n, k // 32, 32))


def quantize_q8_1(kernels: QuantKernels, x: torch.Tensor,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] float32 or bf16 (K % 32 == 0) -> (q int8 [M, K], d, s = d * sum float32
    [M, K/32], sum int32 [M, K/32]): per block of 32, d = max|x| / 127, q = nearest-even(x *
    127 / max|x|) (0 for a zero block)."""
    x = x.contiguous()
    m, k = x.shape
    if k % 32:
        raise ValueError(f"activations of {k} columns are not whole 32-blocks")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"activations must be float32 or bf16, got {x.dtype}")
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // 32, dtype=torch.float32)
    s = torch.empty_like(d)
    total = torch.empty(m, k // 32, dtype=torch.int32)
    kernels.quantize_q8_1(x.data_ptr(), int(x.dtype == torch.bfloat16), m, k, q.data_ptr(),
                          d.data_ptr(), s.data_ptr(), total.data_ptr(), torch.get_num_threads())
    return q, d, s, total


def quant_matmul(kernels: QuantKernels, x: torch.Tensor, packed: torch.Tensor, qtype: str,
                 out_features: int, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None, threads: int | None = None,
                 ) -> torch.Tensor:
    """x [..., K] float32 or bf16 times a weight from :func:`pack_quant_weight` (``qtype``,
    ``out_features`` rows), plus ``bias`` (float32 or None) -> [..., out_features] in
    ``out_dtype`` (default x's): x quantized per 32 as :func:`quantize_q8_1` does, integer dot
    products per block, float32 accumulation (cpu_kernels_quant.c states the order); one call."""
    k = x.shape[-1]
    if packed.shape[1] * 32 != k or packed.shape[2] != QUANT_TYPES[qtype][2]:
        raise ValueError(f"a {qtype} weight packed as {tuple(packed.shape)} does not take "
                         f"{k}-wide activations")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"activations must be float32 or bf16, got {x.dtype}")
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    out_dtype = out_dtype or x.dtype
    y = torch.empty(m, out_features, dtype=out_dtype)
    if bias is not None and bias.dtype != torch.float32:
        bias = bias.float()
    status = kernels.linear(QUANT_TYPES[qtype][0], x2.data_ptr(), int(x.dtype == torch.bfloat16),
                            packed.data_ptr(), _ptr(bias), y.data_ptr(),
                            int(out_dtype == torch.bfloat16), m, out_features, k,
                            threads or torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"quantized linear: no memory for {m} x {k} quantized activations")
    if status:
        raise ValueError(f"the quantized kernels do not take {qtype}")
    return y.view(*x.shape[:-1], out_features)


def quant_dequantize(kernels: QuantKernels, packed: torch.Tensor, qtype: str, out_features: int,
                     dtype: torch.dtype = torch.bfloat16, threads: int | None = None,
                     ) -> torch.Tensor:
    """The dense [out_features, K] weight of one from :func:`pack_quant_weight`, in ``dtype``
    (bf16 or float32): each value the ``gguf`` package's dequantization rounded once, as
    :func:`quant_dequantize_rows` gives a row."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"a dequantized weight is float32 or bf16, got {dtype}")
    k = packed.shape[1] * 32
    y = torch.empty(out_features, k, dtype=dtype)
    status = kernels.dequantize(QUANT_TYPES[qtype][0], packed.data_ptr(), y.data_ptr(),
                                int(dtype == torch.bfloat16), out_features, k,
                                threads or torch.get_num_threads())
    if status:
        raise ValueError(f"the quantized kernels do not take {qtype}")
    return y


def quant_dequantize_rows(kernels: QuantKernels, packed: torch.Tensor, qtype: str,
                          ids: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          threads: int | None = None) -> torch.Tensor:
    """Rows ``ids`` [...] of a weight from :func:`pack_quant_weight` -> [..., K] in ``dtype``
    (bf16 or float32), as :func:`quant_dequantize` gives them: the embedding lookup of a
    quantized table, which reads only the looked-up rows' blocks (the dequantized table is never
    built). Raises IndexError for an id outside the packed rows."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"dequantized rows are float32 or bf16, got {dtype}")
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    rows, k = packed.shape[0] * QUANT_GROUP_ROWS, packed.shape[1] * 32
    y = torch.empty(flat.numel(), k, dtype=dtype)
    status = kernels.dequantize_rows(QUANT_TYPES[qtype][0], packed.data_ptr(), rows,
                                     flat.data_ptr(), flat.numel(), y.data_ptr(),
                                     int(dtype == torch.bfloat16), k,
                                     threads or torch.get_num_threads())
    if status == -3:
        raise IndexError(f"row ids must be in [0, {rows}), got {flat.tolist()[:8]}...")
    if status:
        raise ValueError(f"the quantized kernels do not take {qtype}")
    return y.view(*ids.shape, k)
