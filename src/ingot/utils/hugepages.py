"""Memory for the weights a decode step streams: one anonymous mapping advised for transparent
huge pages (``MADV_HUGEPAGE``; Linux's default THP mode, ``madvise``, gives huge pages only to
memory that asks). The binding step (model_executor/binding.py) lays the kernels' weights out
in one such buffer, in the order a step reads them. Why: a GEMV streams its weight from DRAM
once per step, and over 4 KiB pages each page needs its own TLB entry and the hardware
prefetcher restarts at every page (measured on the AMX Xeon, the default model's four Q4_1
linear shapes, one row, 2 threads: 97 MB of weights at 13.6 GB/s as separate tensors, 14.6 in
one 4 KiB-page buffer, 16.4 on huge pages; 398 MB: 10.0, 12.2, 14.5 GB/s)."""

from __future__ import annotations

import mmap

import torch

#: x86-64's transparent huge page.
HUGE_PAGE = 2 << 20


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8) starting on a 2 MiB boundary of an anonymous private
    mapping advised ``MADV_HUGEPAGE``: huge pages where the kernel has them to give, plain pages
    otherwise (THP ``never``, no free huge page, a system without the advice). The tensor keeps
    the mapping alive; it is freed with the last tensor that views it."""
    if not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice)
        except OSError:  # a kernel built without THP: plain pages
            pass
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]
