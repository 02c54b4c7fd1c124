"""FX passes over the Dynamo-level graph a ``torch.compile(backend=...)`` backend receives.

Typical backend::

    manager = FXPassManager(target_device="cpu")

    def backend(gm, example_inputs):
        gm = manager.run_passes(gm)           # device rewrite, aliasing, in-place -> functional
        compiled = compile_fx(gm, example_inputs)
        return wrap_with_copy_back(compiled, get_alias_info(gm))
"""

from ingot.compilation.passes.aliasing import (
    AliasInfo,
    AliasingOutputRewrite,
    copy_back_outputs,
    get_alias_info,
    wrap_with_copy_back,
)
from ingot.compilation.passes.base import FXPass, FXPassManager, default_passes
from ingot.compilation.passes.device_rewrite import DeviceRewriter
from ingot.compilation.passes.inplace_to_outofplace import InPlaceToOutOfPlace

__all__ = [
    "AliasInfo",
    "AliasingOutputRewrite",
    "DeviceRewriter",
    "FXPass",
    "FXPassManager",
    "InPlaceToOutOfPlace",
    "copy_back_outputs",
    "default_passes",
    "get_alias_info",
    "wrap_with_copy_back",
]
