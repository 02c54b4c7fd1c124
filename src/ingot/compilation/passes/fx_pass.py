"""The FX pass interface (spec section 10): one graph rewrite over the Dynamo-level graph a
``torch.compile(backend=fn)`` backend receives, before it is lowered."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch.fx import GraphModule


class FXPass(ABC):
    """One graph rewrite. ``run`` may edit ``gm`` in place; it returns the module to use next."""

    #: Short identifier used in logs.
    name: str = "fx_pass"

    @abstractmethod
    def run(self, gm: GraphModule, **kwargs: Any) -> GraphModule:
        """Rewrite ``gm``; ``kwargs`` are the manager's pass options (e.g. ``target_device``)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
