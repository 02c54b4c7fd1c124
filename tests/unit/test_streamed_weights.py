"""The weights a decode step streams, moved into one huge-page buffer at binding
(binding.place_streamed_weights, utils/hugepages.py)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

from ingot.model_executor.binding import place_streamed_weights
from ingot.model_executor.layers.bindable import KernelBindable
from ingot.utils.hugepages import HUGE_PAGE, huge_page_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    """The kernel's THP mode ("always", "madvise", "never"), None where it has none."""
    try:
        text = THP.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_buffer_starts_on_a_huge_page_and_outlives_its_first_view():
    buf = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * HUGE_PAGE + 100
    assert buf.data_ptr() % HUGE_PAGE == 0
    assert not buf.any()  # zeroed
    tail = buf[-100:]
    del buf
    gc.collect()
    tail.fill_(7)  # the mapping is alive while a view is
    assert int(tail.sum()) == 700


def test_buffer_is_on_huge_pages_where_the_kernel_gives_them():
    mode = _thp_mode()
    if mode not in ("madvise", "always"):
        pytest.skip(f"transparent huge pages are {mode!r} on this kernel: no huge page to get")
    buf = huge_page_buffer(8 * HUGE_PAGE)
    buf.fill_(1)  # fault the pages in
    huge = _anon_huge_kb(buf.data_ptr())
    # Fragmented memory may deny some; none at all means the advice was not given.
    assert huge >= HUGE_PAGE // 1024, f"{huge} kB of huge pages under a {mode!r} THP kernel"


class _Lin(KernelBindable, nn.Module):
    streamed_weights = ("a", "b")

    def __init__(self, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        super().__init__()
        self.a, self.b = a, b


class _Emb(KernelBindable, nn.Module):
    streamed_weights = ("a",)

    def __init__(self, a: torch.Tensor) -> None:
        super().__init__()
        self.a = a


class _Model(nn.Module):
    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.embed = _Emb(table)
        self.layers = nn.ModuleList([
            _Lin(torch.arange(100, dtype=torch.bfloat16).reshape(10, 10),
                 torch.arange(7, dtype=torch.uint8)),
            _Lin(torch.full((3, 5), 2.5), None),
        ])
        self.head = _Lin(table, None)  # tied: the embedding's tensor


def test_streamed_weights_move_in_bind_order_each_once_with_their_values():
    table = torch.randn(6, 4)
    model = _Model(table)
    expected = {name: getattr(m, attr).clone() for name, m, attr in (
        ("emb", model.embed, "a"), ("l0a", model.layers[0], "a"), ("l0b", model.layers[0], "b"),
        ("l1a", model.layers[1], "a"))}
    old = weakref.ref(model.layers[0].a)
    moved = place_streamed_weights(model)
    l0, l1 = model.layers
    # One buffer, each weight on a cache line, in binding order; the tied table once, where
    # its last holder (the head, read last in a step) binds.
    base = l0.a.untyped_storage().data_ptr()
    for t in (l0.b, l1.a, model.head.a):
        assert t.untyped_storage().data_ptr() == base
    assert model.head.a is model.embed.a
    addrs = [l0.a.data_ptr(), l0.b.data_ptr(), l1.a.data_ptr(), model.head.a.data_ptr()]
    assert addrs == sorted(addrs) and all(a % 64 == 0 for a in addrs)
    assert l0.a.data_ptr() % HUGE_PAGE == 0
    assert moved == 256 + 64 + 64 + 128  # 200, 7, 60 and 96 bytes, each rounded up to 64
    assert l1.b is None
    for name, t in (("emb", model.embed.a), ("l0a", l0.a), ("l0b", l0.b), ("l1a", l1.a)):
        assert t.dtype == expected[name].dtype and torch.equal(t, expected[name]), name
    gc.collect()
    assert old() is None  # the old copy is released, not kept beside the new


def test_a_broken_move_is_caught_by_the_value_check():
    """The twin of the value check above: a move that lost a weight's bytes must fail it."""
    model = _Model(torch.randn(6, 4))
    expected = model.layers[0].a.clone()
    place_streamed_weights(model)
    model.layers[0].a.view(torch.uint8)[:2].zero_()  # the fault: two bytes not copied
    assert not torch.equal(model.layers[0].a, expected)


def test_nothing_to_move_moves_nothing():
    assert place_streamed_weights(nn.Sequential(nn.Linear(2, 2))) == 0
