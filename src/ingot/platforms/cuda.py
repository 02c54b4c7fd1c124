"""The CUDA platform (NVIDIA GPUs; ROCm builds of torch also report as CUDA)."""

from __future__ import annotations

from typing import ClassVar

import torch

from ingot.platforms.interface import DeviceLike, Platform, dtype_name


def _cuda_device(device: DeviceLike) -> torch.device:
    # None means the current device, which is what torch.cuda's own APIs default to.
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    compile_backend = "inductor"
    supported_dtypes: ClassVar[tuple[torch.dtype, ...]] = (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    )

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    @classmethod
    def supports_bf16(cls) -> bool:
        return torch.cuda.is_bf16_supported()

    @classmethod
    def check_dtype(cls, dtype: torch.dtype) -> torch.dtype:
        # Pre-Ampere GPUs only emulate bf16; refuse it there rather than run far slower than fp16.
        if dtype == torch.bfloat16 and not cls.supports_bf16():
            choices = ", ".join(dtype_name(d) for d in cls.supported_dtypes if d != dtype)
            raise ValueError(
                f"dtype bfloat16 is not supported on platform {cls.name} "
                f"(this GPU has no native bf16); use one of {choices}"
            )
        return super().check_dtype(dtype)

    @classmethod
    def total_memory_bytes(cls, device: DeviceLike = None) -> int:
        return torch.cuda.mem_get_info(_cuda_device(device))[1]

    @classmethod
    def available_memory_bytes(cls, device: DeviceLike = None) -> int:
        return torch.cuda.mem_get_info(_cuda_device(device))[0]

    @classmethod
    def synchronize(cls, device: DeviceLike = None) -> None:
        torch.cuda.synchronize(None if device is None else _cuda_device(device))

    @classmethod
    def empty_cache(cls) -> None:
        torch.cuda.empty_cache()
