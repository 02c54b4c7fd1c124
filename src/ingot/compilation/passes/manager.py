"""The manager that runs FX passes in order, and the default passes (spec section 10).

Passes operate on the Dynamo-level graph a ``torch.compile(backend=fn)`` backend receives, before
it is lowered (to Inductor, or stored by the compile cache). Each pass is timed and logged at
DEBUG on the ``ingot`` logger so a slow pass shows up in compile-time profiles.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.fx import GraphModule

from ingot.compilation.passes.aliasing import AliasingOutputRewrite, CopyBackInGraph
from ingot.compilation.passes.device_rewrite import DeviceRewriter
from ingot.compilation.passes.fx_pass import FXPass
from ingot.compilation.passes.inplace_to_outofplace import InPlaceToOutOfPlace

logger = logging.getLogger("ingot")


def default_passes(target_device: str | torch.device = "cpu") -> list[FXPass]:
    """DeviceRewriter, AliasingOutputRewrite, InPlaceToOutOfPlace, in that order.

    Aliasing must come before the in-place rewrite: it makes mutated inputs graph outputs by
    looking for the in-place ops that the rewrite then removes.
    """
    return [DeviceRewriter(target_device), AliasingOutputRewrite(), InPlaceToOutOfPlace()]


def _check_order(passes: Sequence[FXPass]) -> None:
    def first(kind: type) -> int | None:
        return next((i for i, p in enumerate(passes) if isinstance(p, kind)), None)

    # (earlier, later, why): the later pass consumes what the earlier one leaves.
    rules = [
        (AliasingOutputRewrite, InPlaceToOutOfPlace,
         "once the in-place ops are gone, the mutated inputs can no longer be found"),
        (AliasingOutputRewrite, CopyBackInGraph, "it needs the alias map"),
        (InPlaceToOutOfPlace, CopyBackInGraph, "the rewrite would remove the copy-back"),
    ]
    for earlier, later, why in rules:
        i, j = first(earlier), first(later)
        if i is not None and j is not None and j < i:
            raise ValueError(f"{earlier.__name__} must run before {later.__name__}: {why}")


class FXPassManager:
    """Runs FX passes in order over a graph module.

    Args:
        passes: the passes, in order; default :func:`default_passes` for ``target_device``
            (``"cpu"`` if that is None too).
        enable_fx_passes: when False, :meth:`run_passes` returns the graph untouched (a switch to
            rule the passes out when debugging a miscompile).
        target_device: handed to every pass's ``run`` as ``target_device`` when not None.
        **pass_kwargs: further options handed to every pass's ``run``.
    """

    def __init__(
        self,
        passes: Sequence[FXPass] | None = None,
        *,
        enable_fx_passes: bool = True,
        target_device: str | torch.device | None = None,
        **pass_kwargs: Any,
    ) -> None:
        if passes is None:
            passes = default_passes("cpu" if target_device is None else target_device)
        self.passes = list(passes)
        _check_order(self.passes)
        self.enable_fx_passes = enable_fx_passes
        self.pass_kwargs = dict(pass_kwargs)
        if target_device is not None:
            self.pass_kwargs["target_device"] = target_device
        #: Seconds spent in each pass by the last :meth:`run_passes`, in run order.
        self.last_timings: dict[str, float] = {}

    def run_passes(self, gm: GraphModule) -> GraphModule:
        """Run every pass in order; each one's wall time is logged at DEBUG."""
        self.last_timings = {}
        if not self.enable_fx_passes:
            logger.debug("fx passes disabled (enable_fx_passes=False)")
            return gm
        for fx_pass in self.passes:
            start = time.perf_counter()
            gm = fx_pass.run(gm, **self.pass_kwargs)
            # Fail at the pass that broke the graph, not later inside Inductor.
            gm.graph.lint()
            elapsed = time.perf_counter() - start
            self.last_timings[fx_pass.name] = elapsed
            logger.debug("fx pass %s took %.3f ms", fx_pass.name, elapsed * 1e3)
        return gm
