"""Emit new nodes into a Dynamo-level graph, each with a fake ``example_value``.

The rewrites decide shapes and dtypes from ``meta["example_value"]`` (which dim a bool mask
spans, whether a cast is needed, how far to pad). Giving every node we create an example value,
computed by running the op on the fake tensors of its inputs, lets a later rewrite treat our nodes
exactly like Dynamo's own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch.fx import Graph, Node
from torch.fx.node import map_aggregate

logger = logging.getLogger("ingot")

MISSING = object()


def fake_args(args: Any) -> Any:
    """``args`` with every node replaced by its example value, or ``MISSING`` if one has none."""
    missing = False

    def fake(a: Any) -> Any:
        nonlocal missing
        if isinstance(a, Node):
            v = a.meta.get("example_value", MISSING)
            missing = missing or v is MISSING
            return v
        return a

    out = map_aggregate(args, fake)
    return MISSING if missing else out


class GraphBuilder:
    """Creates call nodes at the graph's current insertion point (set with ``inserting_*``)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.created: list[Node] = []

    def rollback(self, mark: int) -> None:
        """Erase the nodes created since ``len(self.created) == mark`` (an abandoned rewrite)."""
        for node in reversed(self.created[mark:]):
            self.graph.erase_node(node)
        del self.created[mark:]

    def method(self, name: str, *args: Any, node_name: str | None = None, **kwargs: Any) -> Node:
        """``args[0].<name>(*args[1:], **kwargs)`` as a ``call_method`` node."""
        return self._emit("call_method", name, args, kwargs, node_name)

    def function(
        self, fn: Callable[..., Any], *args: Any, node_name: str | None = None, **kwargs: Any
    ) -> Node:
        """``fn(*args, **kwargs)`` as a ``call_function`` node."""
        return self._emit("call_function", fn, args, kwargs, node_name)

    def replay(self, node: Node, first_arg: Node, node_name: str | None = None) -> Node:
        """Repeat ``node``'s op on a different first argument (re-derive a view from a new base)."""
        return self._emit(node.op, node.target, (first_arg, *node.args[1:]), dict(node.kwargs),
                          node_name)

    def _emit(self, op: str, target: Any, args: tuple, kwargs: dict, name: str | None) -> Node:
        node = self.graph.create_node(op, target, tuple(args), kwargs, name=name)
        self.created.append(node)
        fake = fake_args((args, kwargs))
        if fake is not MISSING:
            fargs, fkwargs = fake
            try:
                if op == "call_method":
                    value = getattr(fargs[0], target)(*fargs[1:], **fkwargs)
                else:
                    value = target(*fargs, **fkwargs)
            except Exception as e:  # noqa: BLE001 - the value is a hint; the graph is still right
                logger.debug("no example value for %s: %s", node.format_node(), e)
            else:
                node.meta["example_value"] = value
        return node
