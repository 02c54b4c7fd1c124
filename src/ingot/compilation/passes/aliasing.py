"""AliasingOutputRewrite: make input mutations visible as graph outputs (spec section 11).

A compiled graph gives every output its own buffer, so a write into an input (the KV cache) must
be returned and copied back, or declared as an input/output alias. This pass

1. collects the placeholders in order;
2. scans the graph once, following view chains (``alias_chain``) so that a write through
   ``cache.view(-1, h, d)`` or ``cache[0]`` counts as a write to ``cache``; writers are in-place
   methods, ``operator.setitem``, ops whose schema has ``Tensor(a!)`` (custom ops), ``out=`` and
   ``inplace=True``; each writer gets ``meta["root_input"]``;
3. scans the outputs for pass-through aliases of an input (the input itself, an in-place result,
   or a reshape-like view); slices, selects and transposes are not aliases of the whole input and
   are left out, since their bytes cannot be copied back as the input;
4. appends every mutated input that is not already such an output.

The result is ``{"io_map": {output_index: input_index}, "original_output_count": k,
"mutated_inputs": [...]}``, stored on ``gm.meta`` (see :func:`get_alias_info`). At run time
:func:`copy_back_outputs` writes the io_map outputs of mutated inputs back into those inputs and
drops the extra outputs, so the caller sees the original signature and eager's side effects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import torch
from torch.fx import GraphModule, Node

from ingot.compilation.passes.alias_analysis import (
    IDENTITY,
    RESHAPE,
    mutated_args,
    resolve_root,
    view_kind,
)
from ingot.compilation.passes.fx_pass import FXPass

ALIAS_INFO_KEY = "ingot_alias_info"


class AliasInfo(TypedDict):
    """What :class:`AliasingOutputRewrite` found; indices are output / placeholder positions."""

    io_map: dict[int, int]
    original_output_count: int
    mutated_inputs: list[int]


def _whole_input_alias(node: Node) -> Node:
    """Follow only the views that show all of their base's elements in the same order."""
    while view_kind(node) in (IDENTITY, RESHAPE):
        node = node.args[0]
    return node


class AliasingOutputRewrite(FXPass):
    """Append mutated inputs to the outputs and record the output->input alias map."""

    name = "aliasing_output_rewrite"

    def run(self, gm: GraphModule, **kwargs: Any) -> GraphModule:
        gm, info = self.rewrite(gm)
        gm.meta[ALIAS_INFO_KEY] = info
        return gm

    def rewrite(self, gm: GraphModule) -> tuple[GraphModule, AliasInfo]:
        """The spec's interface: ``(gm, {"io_map": ..., "original_output_count": ...})``."""
        graph = gm.graph
        placeholders = {n: i for i, n in enumerate(graph.find_nodes(op="placeholder"))}
        alias_chain: dict[Node, Node] = {}
        mutated: dict[int, Node] = {}
        for node in graph.nodes:
            for written in mutated_args(node):
                root = resolve_root(written, alias_chain)
                node.meta["root_input"] = root
                if root in placeholders:
                    mutated.setdefault(placeholders[root], root)

        output = graph.output_node()
        outs = output.args[0]
        if not isinstance(outs, (tuple, list)):
            raise ValueError(
                f"{self.name} expects the tuple of outputs Dynamo produces, got {type(outs)}")
        outs = list(outs)
        original = len(outs)
        io_map: dict[int, int] = {}
        for i, out in enumerate(outs):
            if isinstance(out, Node):
                source = _whole_input_alias(out)
                if source in placeholders:
                    io_map[i] = placeholders[source]
        covered = set(io_map.values())
        for index, placeholder in sorted(mutated.items()):
            if index not in covered:
                io_map[len(outs)] = index
                outs.append(placeholder)
        output.args = (tuple(outs),)
        gm.recompile()
        info = AliasInfo(io_map=io_map, original_output_count=original,
                         mutated_inputs=sorted(mutated))
        return gm, info


def _shape(node: Node) -> tuple[int, ...] | None:
    value = node.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


class CopyBackInGraph(FXPass):
    """Turn the appended outputs back into in-graph ``input.copy_(new_value)`` writes.

    Runs after AliasingOutputRewrite (and usually InPlaceToOutOfPlace). The graph regains its
    original outputs, and the write-back happens inside it, which is what a backend that
    functionalises input mutations itself wants: Inductor then updates the input buffer in
    place (an ``index_put_`` into the KV cache), whereas :func:`copy_back_outputs` after the
    graph costs a fresh output buffer and a full copy of every mutated input per call.
    """

    name = "copy_back_in_graph"

    def run(self, gm: GraphModule, **kwargs: Any) -> GraphModule:
        info = gm.meta.pop(ALIAS_INFO_KEY, None)
        if info is None:
            raise ValueError(f"{self.name} needs AliasingOutputRewrite to run before it")
        graph = gm.graph
        output = graph.output_node()
        outs = list(output.args[0])
        placeholders = list(graph.find_nodes(op="placeholder"))
        done: set[int] = set()
        with graph.inserting_before(output):
            for out_index, in_index in info["io_map"].items():
                if in_index in info["mutated_inputs"] and in_index not in done:
                    done.add(in_index)
                    src, dst = outs[out_index], placeholders[in_index]
                    if src is dst:
                        continue  # still mutated in place (the in-place rewrite did not run)
                    if _shape(src) is None or _shape(src) != _shape(dst):
                        src = graph.call_method("reshape_as", (src, dst))
                    graph.call_method("copy_", (dst, src))
        output.args = (tuple(outs[: info["original_output_count"]]),)
        gm.recompile()
        return gm


def get_alias_info(gm: GraphModule) -> AliasInfo | None:
    """The info :class:`AliasingOutputRewrite` stored on ``gm`` (None if it did not run)."""
    return gm.meta.get(ALIAS_INFO_KEY)


def copy_back_outputs(
    outputs: Sequence[Any], inputs: Sequence[Any], info: AliasInfo
) -> tuple[Any, ...]:
    """Write the new values of mutated inputs back into them; return the original outputs.

    Outputs that merely pass an unmutated input through are not copied (the bytes are equal).
    """
    mutated = set(info["mutated_inputs"])
    done: set[int] = set()
    with torch.no_grad():
        for out_index, in_index in info["io_map"].items():
            if in_index not in mutated or in_index in done:
                continue
            done.add(in_index)
            src, dst = outputs[out_index], inputs[in_index]
            if src is dst or (src.data_ptr() == dst.data_ptr() and src.shape == dst.shape
                              and src.stride() == dst.stride()):
                continue  # the graph wrote in place already (e.g. the rewrite did not run)
            dst.copy_(src if src.shape == dst.shape else src.reshape(dst.shape))
    return tuple(outputs[: info["original_output_count"]])


def wrap_with_copy_back(
    compiled: Callable[..., Any], info: AliasInfo | None
) -> Callable[..., Any]:
    """Wrap a compiled graph so that calling it behaves like the eager function.

    ``compiled`` takes the inputs as positional arguments, as a Dynamo backend's result is called
    (``compile_fx``'s result is, whatever its inherited ``_boxed_call`` attribute says).
    """
    if info is None:
        return compiled

    def run(*args: Any) -> tuple[Any, ...]:
        return copy_back_outputs(compiled(*args), args, info)

    return run
