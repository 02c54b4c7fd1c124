"""Which nodes of a Dynamo-level FX graph are views of, or mutate, which tensors.

Shared by :mod:`aliasing` (which inputs does the graph mutate) and
:mod:`inplace_to_outofplace` (how to write a modified view back into its base). The graph is the
one a ``torch.compile(backend=fn)`` backend receives: tensor methods are ``call_method`` nodes,
indexing is ``operator.getitem``/``operator.setitem``, and every node carries a fake tensor in
``meta["example_value"]``. Where those example values exist, aliasing is decided the way eager
decides it (does the result share the argument's storage); the name tables are the fallback for
hand-built graphs and give the *kind* of view, which the write-back needs.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Node
from torch.multiprocessing.reductions import StorageWeakRef

# View kinds: how a view's elements map onto its base.
RESHAPE = "reshape"  # same elements in row-major order; base = view.reshape_as(base)
IDENTITY = "identity"  # the very same tensor (detach, a no-op .to()/.contiguous(), ...)
TRANSPOSE = "transpose"
T = "t"
PERMUTE = "permute"
MOVEDIM = "movedim"
SELECT = "select"
NARROW = "narrow"
SLICE = "slice"  # aten.slice(x, dim, start, end, step)
GETITEM = "getitem"  # basic indexing: ints, slices, None, Ellipsis
OTHER = "other"  # a view we can detect but not write back through (expand, diagonal, ...)

#: Methods (and same-named ``torch.*`` functions) whose result is always a view of ``args[0]``.
ALIASING_METHODS: dict[str, str] = {
    "view": RESHAPE,
    "view_as": RESHAPE,
    "squeeze": RESHAPE,
    "unsqueeze": RESHAPE,
    "unflatten": RESHAPE,
    "transpose": TRANSPOSE,
    "swapaxes": TRANSPOSE,
    "swapdims": TRANSPOSE,
    "t": T,
    "permute": PERMUTE,
    "movedim": MOVEDIM,
    "moveaxis": MOVEDIM,
    "select": SELECT,
    "narrow": NARROW,
    "__getitem__": GETITEM,
    "detach": IDENTITY,
    "expand": OTHER,
    "expand_as": OTHER,
    "diagonal": OTHER,
    "unfold": OTHER,
    "as_strided": OTHER,
}

#: Methods that return a view only when they can (else a copy), e.g. ``reshape`` of a
#: non-contiguous tensor. Decided from the example values; without them, assume the common case.
MAYBE_ALIASING_METHODS: dict[str, tuple[str, bool]] = {
    "reshape": (RESHAPE, True),
    "reshape_as": (RESHAPE, True),
    "flatten": (RESHAPE, True),
    "contiguous": (IDENTITY, False),
    "to": (IDENTITY, False),
    "type": (IDENTITY, False),
    "type_as": (IDENTITY, False),
}

#: aten view ops (``OpOverload``/``OpOverloadPacket`` targets), by packet name.
ALIASING_ATEN_OPS: dict[str, str] = {
    "view": RESHAPE,
    "reshape": RESHAPE,
    "squeeze": RESHAPE,
    "unsqueeze": RESHAPE,
    "alias": IDENTITY,
    "detach": IDENTITY,
    "transpose": TRANSPOSE,
    "t": T,
    "permute": PERMUTE,
    "movedim": MOVEDIM,
    "select": SELECT,
    "narrow": NARROW,
    "slice": SLICE,
}

_TORCH_FUNCTIONS: dict[Any, str] = {
    getattr(torch, n): n
    for n in (*ALIASING_METHODS, *MAYBE_ALIASING_METHODS)
    if not n.startswith("_") and callable(getattr(torch, n, None))
}
_TORCH_FUNCTIONS[operator.getitem] = "__getitem__"

_OPS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def is_inplace_name(name: object) -> bool:
    """``add_``, ``index_copy_``: in-place by PyTorch's naming rule; dunders are not."""
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


def example_value(arg: object) -> Any:
    """The fake tensor (or SymInt, ...) Dynamo recorded for a node; constants are their own."""
    if isinstance(arg, Node):
        return arg.meta.get("example_value")
    return arg


def op_name(node: Node) -> str | None:
    """The method / function name a call node stands for, or None for anything else."""
    if node.op == "call_method":
        return node.target if isinstance(node.target, str) else None
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    try:
        return _TORCH_FUNCTIONS.get(target) or (
            target.__name__ if getattr(torch, getattr(target, "__name__", ""), None) is target
            else None
        )
    except TypeError:  # unhashable target
        return None


def _schemas(target: Any) -> list[torch.FunctionSchema]:
    if isinstance(target, torch._ops.OpOverload):
        return [target._schema]
    if isinstance(target, torch._ops.OpOverloadPacket):
        return [getattr(target, o)._schema for o in target.overloads()]
    return []


def _arg(node: Node, index: int, name: str) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name)


def _nodes_in(value: Any) -> list[Node]:
    if isinstance(value, Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Node)]
    return []


def mutated_args(node: Node) -> list[Node]:
    """The tensors a node writes to: in-place methods, ``setitem``, ``Tensor(a!)`` schemas.

    Also covers ``torch.relu_``-style functions (through the aten schema of the same name),
    ``inplace=True`` functional calls and ``out=`` tensors.
    """
    if node.op == "call_method":
        if is_inplace_name(node.target) and node.args and isinstance(node.args[0], Node):
            return [node.args[0]]
        return []
    if node.op != "call_function":
        return []
    target = node.target
    if target is operator.setitem:
        return _nodes_in(node.args[0])
    found: list[Node] = []
    schemas = _schemas(target)
    name = getattr(target, "__name__", "")
    if not schemas and is_inplace_name(name) and getattr(torch, name, None) is target:
        packet = getattr(torch.ops.aten, name, None)
        schemas = _schemas(packet) if packet is not None else []
        if not schemas:
            found += _nodes_in(node.args[0] if node.args else None)
    for schema in schemas:
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                found += [n for n in _nodes_in(_arg(node, i, a.name)) if n not in found]
    if node.kwargs.get("inplace") is True and node.args:
        found += [n for n in _nodes_in(node.args[0]) if n not in found]
    found += [n for n in _nodes_in(node.kwargs.get("out")) if n not in found]
    return found


def _shares_storage(a: Node, b: Node) -> bool | None:
    va, vb = example_value(a), example_value(b)
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)):
        return None
    try:
        return StorageWeakRef(va.untyped_storage()) == StorageWeakRef(vb.untyped_storage())
    except (NotImplementedError, RuntimeError):  # tensors without storage (sparse, ...)
        return None


def _has_tensor_index(index: Any) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return isinstance(index, list) or any(isinstance(i, Node) for i in items)


def view_kind(node: Node) -> str | None:
    """The kind of view ``node`` is of ``node.args[0]``, or None if its result is not an alias.

    The result of an in-place method is ``self``, so it is an IDENTITY view of its target.
    """
    if node.op not in ("call_method", "call_function") or not node.args:
        return None
    base = node.args[0]
    if not isinstance(base, Node):
        return None
    name = op_name(node)
    shared = _shares_storage(node, base)
    if is_inplace_name(name) and shared is not False and base in mutated_args(node):
        return IDENTITY
    if isinstance(node.target, _OPS):
        is_view = any(
            r.alias_info is not None and not r.alias_info.is_write
            for s in _schemas(node.target)
            for r in s.returns
        )
        if not is_view:
            return None
        return ALIASING_ATEN_OPS.get(name or "", OTHER) if shared is not False else None
    if name in ALIASING_METHODS:
        if name == "__getitem__" and _has_tensor_index(node.args[1]):
            return None  # advanced indexing copies
        return ALIASING_METHODS[name] if shared is not False else None
    if name in MAYBE_ALIASING_METHODS:
        kind, default = MAYBE_ALIASING_METHODS[name]
        return kind if (default if shared is None else shared) else None
    # An op we have no entry for that still returns a view of its input: a mutation through it
    # must not be lost silently, so report it as a view we cannot write back through.
    return OTHER if shared else None


def resolve_root(node: Node, memo: dict[Node, Node] | None = None) -> Node:
    """Follow view chains (``cache.view(...).transpose(...)[0]``) down to the viewed tensor."""
    memo = {} if memo is None else memo
    chain = []
    current = node
    while current not in memo and view_kind(current) is not None:
        chain.append(current)
        current = current.args[0]
    root = memo.get(current, current)
    for n in chain:
        memo[n] = root
    return root
