"""``base[index] = value`` as an out-of-place expression (spec section 13, ``setitem``).

Rules, by index type:

* int -> ``select_scatter``;
* slice: start 0 and step 1 -> ``slice_scatter``; step > 1 or a negative start ->
  ``slice_scatter`` with explicit ``start``/``end``/``step``; a positive start with step 1 ->
  pad the value and a mask to the full size along the dim, then ``torch.where``;
* tuple: ``slice(None)`` entries are dropped (they select everything) and ``Ellipsis`` is
  resolved; tensor entries -> ``index_put``; a single int/slice entry -> the rules above; several
  -> slice down along the first int/slice entry, assign inside, ``select/slice_scatter`` back up;
* bool mask -> ``torch.where``; int tensor -> ``index_put``;
* anything else (``None``/newaxis, lists, symbolic slice bounds, masks mixed with other
  indices) is unsupported: :func:`lower_setitem` returns None and the caller keeps the setitem.

Scalar values become tensors with ``full_like`` of the region they fill; tensor values are
``expand_as``-ed to it and cast to the base dtype, as ``setitem`` does implicitly.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from ingot.compilation.passes.alias_analysis import example_value
from ingot.compilation.passes.graph_builder import GraphBuilder

_FULL = slice(None)


class _Unsupported(Exception):
    """An index or value the rules do not cover; the setitem stays as it is."""


def _is_tensor(arg: Any) -> bool:
    return isinstance(arg, Node) and isinstance(example_value(arg), torch.Tensor)


def _is_mask(arg: Any) -> bool:
    return _is_tensor(arg) and example_value(arg).dtype == torch.bool


def _is_full(entry: Any) -> bool:
    return (
        isinstance(entry, slice)
        and entry.start in (None, 0)
        and entry.stop is None
        and entry.step in (None, 1)
    )


def _tensor_of(node: Node) -> torch.Tensor:
    value = example_value(node)
    if not isinstance(value, torch.Tensor):
        raise _Unsupported(f"no example tensor for {node.name}")
    return value


def normalize_index(index: Any, ndim: int) -> list[Any]:
    """One entry per indexed dim (a bool mask spans several), Ellipsis expanded, right-padded."""
    items = index if isinstance(index, tuple) else (index,)
    consumed = 0
    for item in items:
        if item is Ellipsis:
            continue
        if isinstance(item, bool) or item is None:
            raise _Unsupported(f"index entry {item!r}")
        if isinstance(item, Node):
            if not _is_tensor(item):
                raise _Unsupported(f"non-tensor index node {item.name}")
            consumed += example_value(item).ndim if _is_mask(item) else 1
        elif isinstance(item, int):
            consumed += 1
        elif isinstance(item, slice):
            if any(isinstance(b, Node) for b in (item.start, item.stop, item.step)):
                raise _Unsupported("symbolic slice bounds")
            consumed += 1
        else:
            raise _Unsupported(f"index entry of type {type(item).__name__}")
    if consumed > ndim or sum(i is Ellipsis for i in items) > 1:
        raise _Unsupported("too many indices")
    entries: list[Any] = []
    for item in items:
        entries += [_FULL] * (ndim - consumed) if item is Ellipsis else [item]
    if Ellipsis not in items:
        entries += [_FULL] * (ndim - consumed)
    return entries


def source_for(b: GraphBuilder, region: Node, value: Any, node_name: str | None = None) -> Node:
    """``value`` as a tensor of exactly ``region``'s shape and dtype."""
    if not _is_tensor(value):  # python scalar or SymInt/SymFloat node
        return b.function(torch.full_like, region, value, node_name=node_name)
    region_t, value_t = _tensor_of(region), _tensor_of(value)
    if value_t.ndim > region_t.ndim:
        raise _Unsupported("value has more dims than the region it is written to")
    cast = value_t.dtype != region_t.dtype
    src = b.method("expand_as", value, region, node_name=None if cast else node_name)
    return b.method("type_as", src, region, node_name=node_name) if cast else src


def _cast_to(b: GraphBuilder, value: Node, like: Node) -> Node:
    if _tensor_of(value).dtype == _tensor_of(like).dtype:
        return value
    return b.method("type_as", value, like)


def _region(b: GraphBuilder, base: Node, dim: int, entry: Any) -> Node:
    return b.function(operator.getitem, base, (_FULL,) * dim + (entry,))


def _scatter(b: GraphBuilder, base: Node, src: Node, dim: int, entry: Any, name: str | None,
             explicit: bool = True) -> Node:
    if isinstance(entry, int):
        return b.function(torch.select_scatter, base, src, dim, entry, node_name=name)
    if not explicit:
        return b.function(torch.slice_scatter, base, src, dim=dim, end=entry.stop, node_name=name)
    return b.function(torch.slice_scatter, base, src, dim=dim, start=entry.start,
                      end=entry.stop, step=entry.step or 1, node_name=name)


def _assign_basic(b: GraphBuilder, base: Node, dim: int, entry: Any, value: Any,
                  name: str | None) -> Node:
    """One int or slice entry at ``dim``."""
    src = source_for(b, _region(b, base, dim, entry), value)
    if isinstance(entry, int):
        return _scatter(b, base, src, dim, entry, name)
    start, step = entry.start or 0, entry.step or 1
    if step <= 0:
        raise _Unsupported("non-positive slice step")
    if start == 0 and step == 1:
        return _scatter(b, base, src, dim, entry, name, explicit=False)
    size = _tensor_of(base).shape[dim]
    if step > 1 or start < 0 or not isinstance(size, int):
        return _scatter(b, base, src, dim, entry, name)
    # Positive start, step 1: pad the value and a mask to the full extent of the dim and select.
    lo, hi, _ = entry.indices(size)
    pad = [0, 0] * (_tensor_of(base).ndim - 1 - dim) + [lo, size - max(hi, lo)]
    padded = b.function(F.pad, src, pad)
    ones = b.function(torch.ones_like, src, dtype=torch.bool)
    mask = b.function(F.pad, ones, pad, value=False)
    return b.function(torch.where, mask, padded, base, node_name=name)


def _assign_mask(b: GraphBuilder, base: Node, dim: int, mask: Node, value: Any,
                 name: str | None) -> Node:
    base_t, mask_t = _tensor_of(base), _tensor_of(mask)
    if mask_t.ndim == 0:
        raise _Unsupported("0-dim bool mask")
    trailing = base_t.ndim - dim - mask_t.ndim
    if _is_tensor(value) and _tensor_of(value).ndim > trailing:
        # One value row per selected element: only index_put can place them.
        src = _cast_to(b, value, base)
        return b.function(torch.ops.aten.index_put.default, base, [None] * dim + [mask], src,
                          node_name=name)
    shape = (1,) * dim + tuple(mask_t.shape) + (1,) * trailing
    mask_b = b.method("reshape", mask, shape)
    src = b.function(torch.full_like, base, value) if not _is_tensor(value) else _cast_to(
        b, value, base)
    return b.function(torch.where, mask_b, src, base, node_name=name)


def _index_put(b: GraphBuilder, base: Node, entries: list[Any], value: Any,
               name: str | None) -> Node:
    last = max(i for i, e in enumerate(entries) if isinstance(e, Node))
    indices = [e if isinstance(e, Node) else None for e in entries[: last + 1]]
    if _is_tensor(value):
        src = _cast_to(b, value, base)
    else:
        region = b.function(operator.getitem, base, tuple(entries[: last + 1]))
        src = b.function(torch.full_like, region, value)
    if any(i is None for i in indices):
        # Tensor.index_put rejects None entries; the aten op takes them as "whole dim".
        return b.function(torch.ops.aten.index_put.default, base, indices, src, node_name=name)
    return b.method("index_put", base, tuple(indices), src, node_name=name)


def _assign(b: GraphBuilder, base: Node, entries: list[Any], value: Any,
            name: str | None) -> Node:
    nontrivial = [i for i, e in enumerate(entries) if not _is_full(e)]
    if not nontrivial:
        return source_for(b, base, value, node_name=name)
    masks = [i for i in nontrivial if _is_mask(entries[i])]
    if masks:
        if nontrivial != masks or len(masks) != 1:
            raise _Unsupported("bool mask mixed with other indices")
        return _assign_mask(b, base, masks[0], entries[masks[0]], value, name)
    basic = [i for i in nontrivial if not isinstance(entries[i], Node)]
    if not basic:
        return _index_put(b, base, entries, value, name)
    dim = basic[0]
    entry = entries[dim]
    if len(nontrivial) == 1:
        return _assign_basic(b, base, dim, entry, value, name)
    # Several dims: slice down along the first int/slice entry, assign inside, scatter back up.
    sub = _region(b, base, dim, entry)
    rest = entries[:dim] + ([] if isinstance(entry, int) else [_FULL]) + entries[dim + 1:]
    new_sub = _assign(b, sub, rest, value, None)
    return _scatter(b, base, new_sub, dim, entry, name)


def lower_setitem(b: GraphBuilder, base: Node, index: Any, value: Any,
                  node_name: str | None = None) -> Node | None:
    """Emit nodes computing ``base`` after ``base[index] = value``; the last is named
    ``node_name``. Returns None (emitting nothing useful) when the index is unsupported."""
    base_t = example_value(base)
    if not isinstance(base_t, torch.Tensor):
        return None
    mark = len(b.created)
    try:
        return _assign(b, base, normalize_index(index, base_t.ndim), value, node_name)
    except _Unsupported:
        b.rollback(mark)
        return None
