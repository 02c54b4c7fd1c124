"""The ``Platform`` interface: everything the engine needs to know about the device it runs on.

A platform is used as a class, never instantiated: ``resolve_platform()`` returns
``type[Platform]`` and every member is a class attribute or classmethod, so there is no state to
keep in sync between workers.
"""

from __future__ import annotations

import random
from typing import ClassVar, NamedTuple

import torch

DeviceLike = torch.device | str | int | None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``, the spelling users type on the command line."""
    return str(dtype).removeprefix("torch.")


class DtypeChoice(NamedTuple):
    """The dtype ``auto`` picks, and why (logged once at start-up)."""

    dtype: torch.dtype
    reason: str


class Platform:
    """Base class for platforms; subclasses fill in the class attributes and override hooks."""

    name: ClassVar[str] = "base"
    device_type: ClassVar[str] = "cpu"
    dist_backend: ClassVar[str] = "gloo"
    compile_backend: ClassVar[str] = "inductor"
    # Ordered by preference, so error messages list the best choice first.
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @classmethod
    def is_available(cls) -> bool:
        raise NotImplementedError(f"{cls.__name__}.is_available")

    @classmethod
    def device(cls, index: int = 0) -> torch.device:
        return torch.device(cls.device_type, index)

    @classmethod
    def supports_bf16(cls) -> bool:
        """Whether bf16 runs at full speed here (not merely emulated)."""
        return False

    @classmethod
    def default_dtype(cls) -> torch.dtype:
        # bf16 halves memory and keeps fp32's range; only worth it with hardware support.
        if torch.bfloat16 in cls.supported_dtypes and cls.supports_bf16():
            return torch.bfloat16
        return torch.float32

    @classmethod
    def auto_dtype(cls, declared: torch.dtype | None, bf16_kernels: str | None) -> DtypeChoice:
        """``auto`` for a model that decodes, from the checkpoint's dtype (``declared``; None:
        not stated, as float32). vLLM's rule: keep a bf16/fp16 checkpoint's dtype where the
        platform lists it, otherwise the platform default. ``bf16_kernels`` (the ISA of
        ingot's vector bf16 CPU kernels serving here, or None) is for the CPU's rule."""
        name = dtype_name(declared) if declared is not None else "float32"
        if declared in (torch.bfloat16, torch.float16) and declared in cls.supported_dtypes:
            return DtypeChoice(declared, f"the checkpoint's dtype ({cls.name} computes it)")
        default = cls.default_dtype()
        why = ("half precision where the device computes bf16" if default == torch.bfloat16
               else "no native bf16 here")
        return DtypeChoice(default, f"a {name} checkpoint on {cls.name}: {why}")

    @classmethod
    def dtype_warning(cls, dtype: torch.dtype, bf16_kernels: str | None) -> str | None:
        """What an explicit ``dtype`` costs here where it runs far below this platform's
        speed (None: nothing to say)."""
        return None

    @classmethod
    def prefill_only_dtype(cls) -> torch.dtype:
        """The auto dtype of a model that only ever prefills (an encoder: compute-bound, no
        decode step whose cost is reading the weights, where half precision pays off)."""
        return cls.default_dtype()

    @classmethod
    def check_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        """Return ``dtype`` if this platform can run it, else raise ``ValueError``."""
        if dtype not in cls.supported_dtypes:
            choices = ", ".join(dtype_name(d) for d in cls.supported_dtypes)
            raise ValueError(
                f"dtype {dtype_name(dtype)} is not supported on platform {cls.name}; "
                f"use one of {choices}"
            )
        return dtype

    @classmethod
    def total_memory_bytes(cls, device: DeviceLike = None) -> int:
        raise NotImplementedError(f"{cls.__name__}.total_memory_bytes")

    @classmethod
    def available_memory_bytes(cls, device: DeviceLike = None) -> int:
        raise NotImplementedError(f"{cls.__name__}.available_memory_bytes")

    @classmethod
    def synchronize(cls, device: DeviceLike = None) -> None:
        """Wait for queued device work; a no-op where execution is synchronous."""

    @classmethod
    def empty_cache(cls) -> None:
        """Return cached allocator blocks to the device; a no-op without a caching allocator."""

    @classmethod
    def seed_everything(cls, seed: int) -> None:
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:  # numpy is a dependency, but seeding must not be what breaks
            pass
        else:
            np.random.seed(seed)
        # Seeds the CPU generator and, lazily, every CUDA device's generator too.
        torch.manual_seed(seed)
