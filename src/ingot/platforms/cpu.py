"""The CPU platform: always available, the fallback when nothing else activates."""

from __future__ import annotations

import functools
import os
from typing import ClassVar

import torch

from ingot.platforms.interface import DeviceLike, Platform

_CPUINFO = "/proc/cpuinfo"
_MEMINFO = "/proc/meminfo"
# cgroup v2 limits: inside a container /proc/meminfo reports the host, not what we may use.
_CGROUP_MAX = "/sys/fs/cgroup/memory.max"
_CGROUP_CURRENT = "/sys/fs/cgroup/memory.current"

# x86 flags (avx512_bf16, amx_bf16: native bf16 math; avx512f: oneDNN's fast bf16 path) and the
# aarch64 "bf16" feature. Without any of these bf16 is emulated and slower than fp32.
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512f", "bf16"})


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
