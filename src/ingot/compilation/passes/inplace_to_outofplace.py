"""InPlaceToOutOfPlace: make a Dynamo graph functional (spec section 13).

Every ``call_method`` whose name ends in a single ``_`` and every ``operator.setitem`` is replaced
by an out-of-place expression computing the mutated tensor's new value, and later uses are
rewired to it by node identity. The graph stays in SSA form, so repeated mutations of one tensor
chain ``x -> x_modified -> x_modified_1``; new value nodes are named ``<tensor>_modified``.

* general in-place methods: ``add_`` -> ``add`` (``hasattr(torch.Tensor, name)`` is checked;
  otherwise ``NotImplementedError``), cast back to the target's dtype if the result differs;
* ``copy_`` -> ``expand_as`` + ``slice_scatter``; ``zero_``/``fill_`` -> ``zeros_like``/
  ``full_like`` (they have no out-of-place method, but an obvious functional form);
* ``setitem`` -> :mod:`setitem_lowering` (an unsupported index keeps the setitem).

Mutating a view (``cache.view(-1, h, d).index_copy_(0, slots, k)``) mutates its base in eager,
so the new view value is written back through the view chain (``reshape_as``, ``transpose``,
``select_scatter``, ...) up to the root, and the root's other views that are still used later are
re-derived from the new root. Run :class:`AliasingOutputRewrite` first: it makes the mutated
inputs graph outputs, which this pass then rewires to their final values.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch.fx import Graph, GraphModule, Node

from ingot.compilation.passes.alias_analysis import (
    GETITEM,
    IDENTITY,
    MOVEDIM,
    NARROW,
    OTHER,
    PERMUTE,
    RESHAPE,
    SELECT,
    SLICE,
    TRANSPOSE,
    T,
    example_value,
    is_inplace_name,
    view_kind,
)
from ingot.compilation.passes.aliasing import ALIAS_INFO_KEY
from ingot.compilation.passes.fx_pass import FXPass
from ingot.compilation.passes.graph_builder import MISSING, GraphBuilder, fake_args
from ingot.compilation.passes.setitem_lowering import lower_setitem, source_for

logger = logging.getLogger("ingot")


def _arg(node: Node, index: int, name: str, default: Any = None) -> Any:
    if index < len(node.args):
        return node.args[index]
    return node.kwargs.get(name, default)


def _dims(node: Node, name: str) -> list[int]:
    """Variadic dims (``permute(0, 2, 1)`` or ``permute((0, 2, 1))`` or ``dims=...``)."""
    if len(node.args) > 1:
        rest = node.args[1:]
        return list(rest[0]) if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else list(
            rest)
    return list(node.kwargs[name])


class InPlaceToOutOfPlace(FXPass):
    """Rewrite in-place methods and setitem into out-of-place ops (see the module docstring)."""

    name = "inplace_to_outofplace"

    def run(self, gm: GraphModule, **kwargs: Any) -> GraphModule:
        rewriter = _Rewriter(gm.graph)
        rewriter.run()
        if ALIAS_INFO_KEY not in gm.meta and rewriter.mutated_inputs:
            # Nothing returns the new values: the writes into these inputs are now lost.
            logger.warning(
                "InPlaceToOutOfPlace dropped writes into graph inputs %s; run "
                "AliasingOutputRewrite first to return them", sorted(rewriter.mutated_inputs))
        gm.recompile()
        return gm


class _Rewriter:
    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.b = GraphBuilder(graph)
        self.nodes = list(graph.nodes)
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        # Decided on the untouched graph, while example values still match the arguments.
        self.kind = {n: view_kind(n) for n in self.nodes}
        self.parent: dict[Node, Node] = {}  # value node -> the value it is a view of
        self.viewdef: dict[Node, Node] = {}  # value node -> original node defining that view
        self.family: dict[Node, list[Node]] = {}  # root value -> its views (creation order)
        self.origin: dict[Node, Node] = {}  # new value node -> original node it replaces
        self.mutated_inputs: set[str] = set()  # names of placeholders written to

    def run(self) -> None:
        for node in self.nodes:
            if node.op == "call_method" and is_inplace_name(node.target):
                self._rewrite(node)
            elif node.op == "call_function" and node.target is operator.setitem:
                self._rewrite(node)
            elif self.kind[node] is not None and node.op in ("call_method", "call_function"):
                self._track_view(node)
        # Views re-derived for a later use that a later mutation then replaced again are dead.
        for node in reversed(self.b.created):
            if not node.users:
                self.graph.erase_node(node)

    # -- bookkeeping -------------------------------------------------------------------------

    def _track_view(self, node: Node) -> None:
        base = node.args[0]
        self.parent[node] = base
        self.viewdef[node] = node
        self.family.setdefault(self._root(base), []).append(node)

    def _root(self, value: Node) -> Node:
        while value in self.parent:
            value = self.parent[value]
        return value

    def _name(self, value: Node) -> str:
        return f"{self.origin.get(value, value).name}_modified"

    def _used_after(self, value: Node, mutation: Node) -> bool:
        at = self.pos[mutation]
        return any(self.pos.get(u, -1) > at for u in value.users)

    def _rewire_later_uses(self, old: Node, new: Node, mutation: Node) -> None:
        # Only original nodes after the mutation: earlier nodes (and the nodes just emitted to
        # compute the new value) must keep seeing the old value.
        at = self.pos[mutation]
        for user in list(old.users):
            if self.pos.get(user, -1) > at:
                user.replace_input_with(old, new)

    # -- the rewrite ---------------------------------------------------------------------------

    def _rewrite(self, mutation: Node) -> None:
        target = mutation.args[0]
        if not isinstance(target, Node):
            return
        with self.graph.inserting_before(mutation.next):
            new_target = self._new_value(mutation, target)
            if new_target is None:
                logger.debug("keeping unsupported %s", mutation.format_node())
                return
            new: dict[Node, Node] = {target: new_target}
            current, current_new = target, new_target
            while current in self.parent:  # write the new view value back up the view chain
                base = self.parent[current]
                new[base] = self._write_back(base, current, current_new)
                current, current_new = base, new[base]
            root = current
            if root.op == "get_attr":
                raise NotImplementedError(
                    f"{mutation.format_node()} mutates module state {root.target!r}; lift it to "
                    "a graph input so the mutation can be returned and copied back")
            for view in self.family.get(root, []):
                if view not in new and self._used_after(view, mutation):
                    self._rederive(view, new)
        # The result of an in-place method is its target itself.
        mutation.replace_all_uses_with(new_target)
        for old, value in new.items():
            self._rewire_later_uses(old, value, mutation)
        self.graph.erase_node(mutation)
        self._adopt(root, new)

    def _adopt(self, root: Node, new: dict[Node, Node]) -> None:
        """Record the new values as the root's new view family, for later mutations."""
        new_root = new[root]
        if self.origin.get(root, root).op == "placeholder":
            self.mutated_inputs.add(self.origin.get(root, root).name)
        family = self.family.setdefault(new_root, [])
        # ``new`` runs from the mutated view up to the root, then the re-derived views. An
        # IDENTITY step maps two old values to one new node; the entry nearer the root wins,
        # since it is the one that relates the node to its base.
        for old, value in new.items():
            self.origin.setdefault(value, self.origin.get(old, old))
            if old is root or value is new_root or new[self.parent[old]] is value:
                continue
            self.parent[value] = new[self.parent[old]]
            self.viewdef[value] = self.viewdef[old]
            if value not in family:
                family.append(value)

    def _rederive(self, view: Node, new: dict[Node, Node]) -> Node:
        if view not in new:
            base_new = self._rederive(self.parent[view], new)
            new[view] = self.b.replay(self.viewdef[view], base_new, node_name=self._name(view))
        return new[view]

    def _new_value(self, mutation: Node, target: Node) -> Node | None:
        """Emit the out-of-place value of ``target`` after ``mutation``."""
        b, name = self.b, self._name(target)
        if mutation.op == "call_function":  # operator.setitem
            return lower_setitem(b, target, mutation.args[1], mutation.args[2], node_name=name)
        method = mutation.target
        if method == "copy_":
            src = b.method("expand_as", mutation.args[1], target)
            t = example_value(target)
            if _dtype(src) != _dtype(target):
                src = b.method("type_as", src, target)
            if isinstance(t, torch.Tensor) and t.ndim == 0:
                return b.method("clone", src, node_name=name)
            return b.function(torch.slice_scatter, target, src, node_name=name)
        if method == "zero_":
            return b.function(torch.zeros_like, target, node_name=name)
        if method == "fill_":
            return source_for(b, target, mutation.args[1], node_name=name)
        out_of_place = method[:-1]
        if not hasattr(torch.Tensor, out_of_place):
            raise NotImplementedError(
                f"in-place method {method!r} ({mutation.format_node()}) has no out-of-place "
                f"torch.Tensor.{out_of_place}; rewrite it in the model or teach "
                "InPlaceToOutOfPlace its functional form")
        cast = _dtype(target) != _expected_dtype(out_of_place, mutation)
        value = b.method(out_of_place, *mutation.args, node_name=None if cast else name,
                         **mutation.kwargs)
        if cast:  # in-place ops keep the target's dtype; out-of-place ones promote
            value = b.method("type_as", value, target, node_name=name)
        return value

    def _write_back(self, base: Node, view: Node, view_new: Node) -> Node:
        """``base`` with the region that ``view`` shows replaced by ``view_new``."""
        vdef = self.viewdef[view]
        kind = self.kind[vdef]
        b, name = self.b, self._name(base)
        if kind == IDENTITY:
            return view_new
        if kind == RESHAPE:
            dtype = next((a for a in vdef.args[1:] if isinstance(a, torch.dtype)), None)
            if dtype is not None:  # x.view(torch.int32) reinterprets bytes
                return b.method("view", view_new, _dtype(base), node_name=name)
            return b.method("reshape_as", view_new, base, node_name=name)
        if kind == TRANSPOSE:
            d0, d1 = _arg(vdef, 1, "dim0"), _arg(vdef, 2, "dim1")
            return b.method("transpose", view_new, d0, d1, node_name=name)
        if kind == T:
            return b.method("t", view_new, node_name=name)
        if kind == PERMUTE:
            ndim = len(_dims(vdef, "dims"))
            dims = [d % ndim for d in _dims(vdef, "dims")]
            inverse = [dims.index(i) for i in range(ndim)]
            return b.method("permute", view_new, inverse, node_name=name)
        if kind == MOVEDIM:
            src, dst = _arg(vdef, 1, "source"), _arg(vdef, 2, "destination")
            return b.method("movedim", view_new, dst, src, node_name=name)
        if kind == SELECT:
            dim, index = _arg(vdef, 1, "dim"), _arg(vdef, 2, "index")
            return b.function(torch.select_scatter, base, view_new, dim, index, node_name=name)
        if kind == NARROW:
            dim, start, length = (_arg(vdef, 1, "dim"), _arg(vdef, 2, "start"),
                                  _arg(vdef, 3, "length"))
            if isinstance(start, int) and isinstance(length, int):
                return b.function(torch.slice_scatter, base, view_new, dim=dim, start=start,
                                  end=start + length, node_name=name)
        if kind == SLICE:
            return b.function(torch.slice_scatter, base, view_new, dim=_arg(vdef, 1, "dim", 0),
                              start=_arg(vdef, 2, "start"), end=_arg(vdef, 3, "end"),
                              step=_arg(vdef, 4, "step", 1), node_name=name)
        if kind == GETITEM:
            value = lower_setitem(b, base, vdef.args[1], view_new, node_name=name)
            if value is not None:
                return value
        assert kind in (OTHER, NARROW, GETITEM), kind
        raise NotImplementedError(
            f"cannot write a mutation through the view {vdef.format_node()} back into its base")


def _dtype(node: Any) -> torch.dtype | None:
    value = example_value(node)
    return value.dtype if isinstance(value, torch.Tensor) else None


def _expected_dtype(out_of_place: str, mutation: Node) -> torch.dtype | None:
    """The dtype the out-of-place op produces, from fake tensors (None if unknown)."""
    fake = fake_args((mutation.args, dict(mutation.kwargs)))
    if fake is MISSING or not isinstance(fake[0][0], torch.Tensor):
        return None
    args, kwargs = fake
    try:
        return getattr(args[0], out_of_place)(*args[1:], **kwargs).dtype
    except Exception:  # noqa: BLE001 - unknown means "cast to be safe"
        return None
