"""DeviceRewriter: retarget devices frozen at trace time (spec section 12).

``torch.empty(..., device=x.device)`` is traced with the device of the example input (often
``cpu``); compiling for another device would then move data across devices inside the graph.
One O(n) pass replaces every ``device`` kwarg (and the device argument of ``Tensor.to``) that is
not the target with the target, in the original's format: a ``str`` stays a ``str``, a
``torch.device`` stays a ``torch.device``, anything else (an int index) becomes the string.

Trade-offs, as the spec states them: some rewrites are unnecessary, and a tensor deliberately
kept on the host (a CPU-side index table) is retargeted too. ``device=None`` (the default device)
and devices computed at run time (a node) are left alone.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.fx import GraphModule, Node

from ingot.compilation.passes.fx_pass import FXPass


def _retarget(value: Any, target: torch.device) -> Any:
    """``value`` pointing at ``target`` in its own format, or ``value`` if nothing to do."""
    if value is None or isinstance(value, Node):
        return value
    if isinstance(value, torch.device):
        return value if value == target else torch.device(target)
    if isinstance(value, str):
        return value if torch.device(value) == target else str(target)
    return str(target)


def _is_device_like(value: Any) -> bool:
    if isinstance(value, torch.device):
        return True
    if isinstance(value, str):
        try:
            torch.device(value)
        except RuntimeError:
            return False
        return True
    return False


class DeviceRewriter(FXPass):
    """Point every device argument at ``target_device``.

    Args:
        target_device: where the graph will run. If None, the ``target_device`` option the pass
            manager hands to ``run`` is used.
    """

    name = "device_rewriter"

    def __init__(self, target_device: str | torch.device | None = None) -> None:
        self.target_device = target_device

    def run(self, gm: GraphModule, **kwargs: Any) -> GraphModule:
        target = self.target_device if self.target_device is not None else kwargs.get(
            "target_device")
        if target is None:
            raise ValueError("DeviceRewriter needs a target_device")
        target = torch.device(target)
        changed = False
        for node in gm.graph.nodes:
            if "device" in node.kwargs:
                new = _retarget(node.kwargs["device"], target)
                if new is not node.kwargs["device"]:
                    node.update_kwarg("device", new)
                    changed = True
            if node.op == "call_method" and node.target == "to":
                for i, arg in enumerate(node.args[1:], start=1):
                    if _is_device_like(arg):
                        new = _retarget(arg, target)
                        if new is not arg:
                            node.update_arg(i, new)
                            changed = True
        if changed:
            gm.recompile()
        return gm
