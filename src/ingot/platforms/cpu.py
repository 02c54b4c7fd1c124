"""The CPU platform: always available, the fallback when nothing else activates."""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch

from ingot.platforms.interface import DeviceLike, DtypeChoice, Platform, dtype_name

_CPUINFO = "/proc/cpuinfo"
_MEMINFO = "/proc/meminfo"
# cgroup v2 limits: inside a container /proc/meminfo reports the host, not what we may use.
_CGROUP_MAX = "/sys/fs/cgroup/memory.max"
_CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"

# x86 flags (avx512_bf16, amx_bf16: native bf16 math; avx512f: oneDNN's fast bf16 path) and the
# aarch64 "bf16" feature. Without any of these (and without ingot's bf16 kernels) bf16 is
# emulated and slower than fp32.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512f", "bf16"})
# What emulated bf16 costs, measured (issue #32) on an AMD EPYC (Zen 3, 2 vCPUs, AVX2 + FMA)
# with torch's bf16 ops and no ingot kernels, default model; said where it would happen.
_EMULATED_BF16_COST = (
    "measured on an AVX2 AMD EPYC without ingot's kernels, a 1024-token prefill took 27.3 s in "
    "bf16 against 6.4 s in float32 (4.3x)"
)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """CPU feature flags from /proc/cpuinfo (x86 "flags", aarch64 "Features"); empty if unknown."""
    try:
        with open(_CPUINFO, encoding="ascii", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _meminfo_bytes(field: str) -> int | None:
    try:
        with open(_MEMINFO, encoding="ascii") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key == field:
                    parts = value.split()  # e.g. "16318412 kB"
                    scale = 1024 if len(parts) > 1 and parts[1].lower() == "kb" else 1
                    return int(parts[0]) * scale
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sysconf_bytes(pages_name: str) -> int | None:
    # Fallback for systems without /proc (macOS, some sandboxes); no psutil dependency.
    try:
        pages = os.sysconf(pages_name)
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None
    if pages <= 0 or page_size <= 0:
        return None
    return pages * page_size


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" means unlimited


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    compile_backend = "inductor"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16,
        torch.float32,
        torch.float16,
    )

    @classmethod
    def is_available(cls) -> bool:
        return True

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        # torch.device("cpu", 0) is "cpu:0", which compares unequal to tensors' device "cpu".
        return torch.device("cpu")

    @classmethod
    def supports_bf16(cls) -> bool:
        return torch.backends.mkldnn.is_available() and bool(_cpu_flags() & _BF16_FLAGS)

    @classmethod
    def bf16_full_speed(cls, bf16_kernels: str | None) -> str | None:
        """Why bf16 computes at full speed on this CPU, or None where torch would emulate it.
        Full speed: ingot's bf16 kernels in a vector build serve bf16 models here
        (``bf16_kernels``, its ISA: bf16 in memory, float32 arithmetic in registers where the
        CPU has no bf16 dot product), or the CPU has native bf16 (:meth:`supports_bf16`)."""
        if bf16_kernels is not None:
            # The avx512_bf16 build is the one with vdpbf16ps (cpu_kernels.ISAS).
            math = "bf16 dot products" if bf16_kernels == "avx512_bf16" else "float32 arithmetic"
            return f"bf16 weights on ingot's {bf16_kernels} kernels ({math}, half the bytes of " \
                   "float32)"
        if cls.supports_bf16():
            flags = ", ".join(sorted(_cpu_flags() & _BF16_FLAGS))
            return f"this CPU computes bf16 natively ({flags}: oneDNN's bf16 path)"
        return None

    @classmethod
    def auto_dtype(cls, declared: torch.dtype | None, bf16_kernels: str | None) -> DtypeChoice:
        """The CPU's ``auto`` for a model that decodes: the fastest dtype this CPU computes,
        never emulated half precision. bfloat16 where bf16 runs at full speed
        (:meth:`bf16_full_speed`), else float32, whatever the checkpoint's dtype: a float16
        checkpoint computes in bf16 where that is fast (as vLLM's CPU backend casts it; ingot's
        kernels are bf16, and torch's float16 ops are emulated on CPUs without float16
        arithmetic), and a half-precision checkpoint widens to float32 exactly."""
        fast = cls.bf16_full_speed(bf16_kernels)
        if fast is not None:
            cast = ("; a float16 checkpoint computes in bfloat16 on CPU (as on vLLM's CPU "
                    "backend)" if declared == torch.float16 else "")
            return DtypeChoice(torch.bfloat16, fast + cast)
        widen = (f"; the {dtype_name(declared)} checkpoint widens exactly"
                 if declared in (torch.bfloat16, torch.float16) else "")
        return DtypeChoice(torch.float32, "this CPU has no bf16 arithmetic and no vector build of "
                           "ingot's bf16 kernels serves here, so bf16 would be emulated" + widen)

    @classmethod
    def dtype_warning(cls, dtype: torch.dtype, bf16_kernels: str | None) -> str | None:
        """An explicit half precision this CPU only emulates: bf16 or float16 without
        :meth:`bf16_full_speed`; float16 also where bf16 is fast (ingot's kernels are bf16)."""
        if dtype not in (torch.bfloat16, torch.float16):
            return None
        name = dtype_name(dtype)
        fast = cls.bf16_full_speed(bf16_kernels)
        if fast is None:
            return (
                f"dtype {name} on a CPU that only emulates it: no bf16 arithmetic here and no "
                "vector build of ingot's bf16 kernels (INGOT_CPU_KERNELS=0, no C compiler, or "
                f"no AVX2 + FMA), so torch emulates {name} matmuls; {_EMULATED_BF16_COST}. "
                "Pass --dtype float32 (or auto, which picks it here)"
            )
        if dtype == torch.float16:
            return (
                "dtype float16 on CPU runs none of ingot's kernels (they are bf16) and computes "
                "torch's float16 ops, emulated on CPUs without float16 arithmetic. Pass --dtype "
                f"bfloat16 (or auto, which picks it here: {fast})"
            )
        return None

    @classmethod
    def bf16_matmul_faster(cls) -> bool:
        """bf16 matrix multiplies outrun float32 ones here: only with AMX tiles. AVX512-BF16's
        dot product does no more multiply-adds a cycle than float32 FMAs, and oneDNN's bf16
        GEMM measured 1.8x slower than MKL's float32 one on such a CPU (PERFORMANCE.md)."""
        return cls.supports_bf16() and "amx_bf16" in _cpu_flags()

    @classmethod
    def prefill_only_dtype(cls) -> torch.dtype:
        # Compute-bound: bf16 only where it computes faster; float32 is then also exact.
        return torch.bfloat16 if cls.bf16_matmul_faster() else torch.float32

    @classmethod
    def total_memory_bytes(cls, device: DeviceLike = None) -> int:
        total = _meminfo_bytes("MemTotal") or _sysconf_bytes("SC_PHYS_PAGES")
        if total is None:
            raise RuntimeError("cannot determine total memory: no /proc/meminfo and no sysconf")
        limit = _read_int(_CGROUP_MAX)
        return min(total, limit) if limit else total

    @classmethod
    def available_memory_bytes(cls, device: DeviceLike = None) -> int:
        available = _meminfo_bytes("MemAvailable")
        if available is None:
            available = _sysconf_bytes("SC_AVPHYS_PAGES")
        if available is None:
            raise RuntimeError("cannot determine available memory: no /proc/meminfo and no sysconf")
        limit, used = _read_int(_CGROUP_MAX), _read_int(_CGROUP_CURRENT)
        if limit and used is not None:
            available = min(available, max(limit - used, 0))
        # Keep the invariant available <= total even if the two reads raced.
        return min(available, cls.total_memory_bytes(device))
