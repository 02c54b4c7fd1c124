"""FX passes on graphs captured the real way: ``torch.compile(fn, backend=capturing_backend)``."""

from __future__ import annotations

import logging
import operator
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._inductor.compile_fx import compile_fx
from torch.fx import GraphModule, Node

from ingot.compilation.passes import (
    AliasingOutputRewrite,
    CopyBackInGraph,
    DeviceRewriter,
    FXPass,
    FXPassManager,
    InPlaceToOutOfPlace,
    copy_back_outputs,
    default_passes,
    get_alias_info,
    wrap_with_copy_back,
)
from ingot.compilation.passes.alias_analysis import is_inplace_name


@torch.library.custom_op("ingot_test::write_row", mutates_args=("cache",))
def _write_row(cache: torch.Tensor, row: torch.Tensor, i: int) -> None:
    cache[i].copy_(row)


@_write_row.register_fake
def _(cache: torch.Tensor, row: torch.Tensor, i: int) -> None:
    return None


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Parametrised cases reuse one code object; without a reset Dynamo would reuse (or, past
    # its cache limit, silently skip) an earlier compile.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def capture(fn: Callable, *args: Any) -> tuple[GraphModule, list[torch.Tensor]]:
    """The Dynamo graph of ``fn`` and clones of its example inputs (in placeholder order)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, [t.clone() if isinstance(t, torch.Tensor) else t
                            for t in example_inputs]))
        return gm.forward

    torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*_clone(args))
    assert len(graphs) == 1
    return graphs[0]


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def compile_with_passes(fn: Callable, manager: FXPassManager | None = None,
                        lower: Callable | None = None) -> tuple[Callable, list[GraphModule]]:
    """``fn`` compiled by a backend that runs the passes, then ``lower`` (default: run the
    rewritten graph as Python), and copies mutated inputs back."""
    manager = manager or FXPassManager()
    seen: list[GraphModule] = []

    def backend(gm, example_inputs):
        gm = manager.run_passes(gm)
        seen.append(gm)
        compiled = lower(gm, example_inputs) if lower else gm.forward
        return wrap_with_copy_back(compiled, get_alias_info(gm))

    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False), seen


def assert_matches_eager(fn: Callable, *args: Any, lower: Callable | None = None) -> GraphModule:
    """Outputs and (mutated) inputs of the compiled ``fn`` equal eager on cloned inputs."""
    eager_args, compiled_args = _clone(args), _clone(args)
    expected = fn(*eager_args)
    compiled, seen = compile_with_passes(fn, lower=lower)
    actual = compiled(*compiled_args)
    assert len(seen) == 1, "the backend did not compile exactly one graph"
    torch.testing.assert_close(actual, expected)
    for got, want in zip(compiled_args, eager_args, strict=True):
        if isinstance(want, torch.Tensor):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    return seen[0]


def mutating_nodes(gm: GraphModule) -> list[Node]:
    return [
        n for n in gm.graph.nodes
        if (n.op == "call_method" and is_inplace_name(n.target))
        or (n.op == "call_function" and n.target is operator.setitem)
    ]


def outputs(gm: GraphModule) -> tuple:
    return tuple(gm.graph.output_node().args[0])


def placeholder(gm: GraphModule, name: str) -> Node:
    return next(n for n in gm.graph.find_nodes(op="placeholder") if n.target == f"L_{name}_")


# -- pass manager ---------------------------------------------------------------------------


def _kv_write(x, kv_cache):
    result = x * 2
    kv_cache.add_(x)
    return result


def test_default_pass_order():
    assert [type(p) for p in FXPassManager().passes] == [
        DeviceRewriter, AliasingOutputRewrite, InPlaceToOutOfPlace]


def test_inplace_rewrite_before_aliasing_is_rejected():
    with pytest.raises(ValueError, match="AliasingOutputRewrite must run before"):
        FXPassManager([InPlaceToOutOfPlace(), AliasingOutputRewrite()])


def test_passes_run_in_order_with_debug_timing_logs(caplog):
    calls = []

    class Recorder(FXPass):
        def __init__(self, name):
            self.name = name

        def run(self, gm, **kwargs):
            calls.append((self.name, kwargs))
            return gm

    gm, _ = capture(_kv_write, torch.ones(3), torch.zeros(3))
    manager = FXPassManager([Recorder("first"), *FXPassManager().passes, Recorder("last")],
                            target_device="meta")
    with caplog.at_level(logging.DEBUG, logger="ingot"):
        manager.run_passes(gm)
    order = ["first", "device_rewriter", "aliasing_output_rewrite", "inplace_to_outofplace",
             "last"]
    timed = [re.fullmatch(r"fx pass (\S+) took [0-9.]+ ms", r.getMessage())
             for r in caplog.records if r.name == "ingot"]
    assert [m.group(1) for m in timed if m] == order
    assert all(r.levelno == logging.DEBUG for r in caplog.records if r.name == "ingot")
    assert list(manager.last_timings) == order
    assert calls == [("first", {"target_device": "meta"}), ("last", {"target_device": "meta"})]


def test_disabled_passes_leave_the_graph_alone(caplog):
    gm, _ = capture(_kv_write, torch.ones(3), torch.zeros(3))
    code = gm.code
    with caplog.at_level(logging.DEBUG, logger="ingot"):
        out = FXPassManager(enable_fx_passes=False).run_passes(gm)
    assert out is gm and gm.code == code and get_alias_info(gm) is None
    assert not any("took" in r.getMessage() for r in caplog.records)
    assert len(mutating_nodes(gm)) == 1


# -- aliasing output rewrite ----------------------------------------------------------------


def test_aliasing_spec_example():
    """``add_(kv_cache, x)`` -> outputs ``(result, kv_cache)``, ``io_map={1: 1}``."""
    gm, _ = capture(_kv_write, torch.ones(3), torch.zeros(3))
    kv_cache = placeholder(gm, "kv_cache")
    (result,) = outputs(gm)

    gm, info = AliasingOutputRewrite().rewrite(gm)

    assert outputs(gm) == (result, kv_cache)
    assert info["io_map"] == {1: 1}
    assert info["original_output_count"] == 1
    assert info["mutated_inputs"] == [1]
    (add_,) = mutating_nodes(gm)
    assert add_.meta["root_input"] is kv_cache


def test_view_chain_resolves_to_its_root():
    def fn(x, cache):
        cache.view(4, 2, 3).transpose(0, 1)[1].select(0, 2).mul_(x)
        return x + 1

    gm, _ = capture(fn, torch.ones(3), torch.ones(24))
    gm, info = AliasingOutputRewrite().rewrite(gm)
    cache = placeholder(gm, "cache")
    (mul_,) = mutating_nodes(gm)
    assert mul_.meta["root_input"] is cache
    assert info["mutated_inputs"] == [list(gm.graph.find_nodes(op="placeholder")).index(cache)]
    assert outputs(gm)[1] is cache


def test_slice_output_is_not_an_alias_but_a_reshape_view_is():
    def fn(x):
        return x[1:3], x.view(-1), x[0], x.unsqueeze(0).detach()

    gm, _ = capture(fn, torch.ones(4, 2))
    _, info = AliasingOutputRewrite().rewrite(gm)
    assert info["io_map"] == {1: 0, 3: 0}
    assert len(outputs(gm)) == 4  # nothing mutated, nothing appended


def test_mutable_schema_custom_op_is_a_mutation():
    def fn(x, cache):
        r = x * 2
        torch.ops.ingot_test.write_row(cache, x, 1)
        return r

    gm, _ = capture(fn, torch.ones(3), torch.zeros(4, 3))
    _, info = AliasingOutputRewrite().rewrite(gm)
    assert info["io_map"] == {1: 1} and info["mutated_inputs"] == [1]


def test_mutation_through_a_slice_marks_its_root_mutated():
    def fn(x, cache):
        cache[1:3].mul_(x)
        return cache.sum(0)

    gm, _ = capture(fn, torch.randn(4), torch.randn(5, 4))
    cache = placeholder(gm, "cache")
    index = list(gm.graph.find_nodes(op="placeholder")).index(cache)
    gm, info = AliasingOutputRewrite().rewrite(gm)
    assert info == {"io_map": {1: index}, "original_output_count": 1, "mutated_inputs": [index]}
    assert outputs(gm)[1] is cache


def test_copy_back_writes_only_mutated_inputs_and_trims_outputs():
    info = {"io_map": {1: 0, 2: 1}, "original_output_count": 1, "mutated_inputs": [1]}
    a, b = torch.zeros(2), torch.zeros(2, 2)
    result = copy_back_outputs([torch.ones(1), torch.full((2,), 7.0), torch.arange(4.0)], [a, b],
                               info)
    assert len(result) == 1 and torch.equal(result[0], torch.ones(1))
    assert torch.equal(a, torch.zeros(2))  # a pass-through of an unmutated input: no copy
    assert torch.equal(b, torch.arange(4.0).view(2, 2))  # a reshape-like alias: copied back


# -- device rewriter ------------------------------------------------------------------------


def _devices(x):
    a = torch.empty(3, device=x.device)
    b = torch.zeros(2, device="cpu")
    c = torch.arange(4, device=torch.device("cpu"))
    d = x.to("cpu")
    return a.sum() * 0 + b.sum() + c.sum() + d.sum()


def test_device_rewriter_retargets_every_device_in_its_format():
    gm, _ = capture(_devices, torch.ones(3))
    before = {n.name: n.kwargs["device"] for n in gm.graph.nodes if "device" in n.kwargs}
    assert {type(v) for v in before.values()} == {str, torch.device}
    assert all(torch.device(v) == torch.device("cpu") for v in before.values())

    gm = DeviceRewriter("meta").run(gm)

    for node in gm.graph.nodes:
        if node.name in before:
            after = node.kwargs["device"]
            assert type(after) is type(before[node.name])
            assert after == ("meta" if isinstance(after, str) else torch.device("meta"))
    (to,) = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert to.args[1] == "meta"
    (out,) = gm(torch.ones(3, device="meta"))
    assert out.device.type == "meta"


def test_device_rewriter_takes_the_managers_target():
    gm, _ = capture(_devices, torch.ones(3))
    FXPassManager([DeviceRewriter()], target_device="meta").run_passes(gm)
    assert gm(torch.ones(3, device="meta"))[0].is_meta


# -- in-place to out-of-place ---------------------------------------------------------------


def _many_mutations(x, cache, idx, k):
    cache.view(-1, 3).index_copy_(0, idx, k)
    cache[0] = 0.25
    cache[1:3, 1].copy_(x)
    cache[0].t().mul_(2)
    x.add_(1).clamp_(max=1.5)
    return cache.sum() + x.sum()


def _many_args():
    return torch.randn(3), torch.randn(4, 2, 3), torch.tensor([5, 1]), torch.randn(2, 3)


def test_rewrite_leaves_no_inplace_method_and_names_new_values_after_their_tensor():
    gm, _ = capture(_many_mutations, *_many_args())
    gm = FXPassManager().run_passes(gm)
    assert mutating_nodes(gm) == []
    assert not [n for n in gm.graph.nodes
                if n.op == "call_method" and n.target.endswith("_") and not n.target.endswith("__")]
    info = get_alias_info(gm)
    names = {p.name for p in gm.graph.find_nodes(op="placeholder")}
    for out_index in info["io_map"]:
        node = outputs(gm)[out_index]
        assert re.fullmatch(r"(\w+)_modified(_\d+)?", node.name), node.name
        assert re.fullmatch(r"(\w+)_modified(_\d+)?", node.name).group(1) in names


def test_repeated_mutations_chain_in_ssa_form(caplog):
    def fn(x):
        x.add_(1)
        x.mul_(2)
        return x * 3

    gm, _ = capture(fn, torch.ones(3))
    with caplog.at_level(logging.WARNING, logger="ingot"):
        gm = InPlaceToOutOfPlace().run(gm)
    # On its own (no aliasing pass) the write into x is not returned: said out loud.
    assert any("dropped writes into graph inputs ['l_x_']" in r.getMessage()
               for r in caplog.records)
    first, second = (n for n in gm.graph.nodes if n.name.startswith("l_x__modified"))
    assert (first.name, first.target, first.args[0].name) == ("l_x__modified", "add", "l_x_")
    assert (second.name, second.target, second.args[0]) == ("l_x__modified_1", "mul", first)
    (mul3,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert mul3.args[0] is second


def test_unknown_inplace_method_raises():
    def fn(x):
        x[0].fill_diagonal_(1.0)
        return x * 1

    gm, _ = capture(fn, torch.zeros(2, 3, 3))
    with pytest.raises(NotImplementedError, match="fill_diagonal_"):
        InPlaceToOutOfPlace().run(gm)


def _stale_view(c, i, k):
    flat = c.view(-1)
    c.mul_(2)
    return flat + 0


def _intermediate(c, i, k):
    h = c * 2
    h[0] = 1.0
    return h


def _cache_args():
    return torch.randn(4, 2, 3), torch.tensor([5, 1]), torch.randn(2, 3, dtype=torch.float64)


MUTATIONS = {
    "spec_example": (_kv_write, lambda: (torch.randn(3), torch.randn(3))),
    "many": (_many_mutations, _many_args),
    "view_index_copy": (lambda c, i, k: (c.view(-1, 3).index_copy_(0, i, k.float()), c * 1)[1],
                        _cache_args),
    "slice_copy_casts": (lambda c, i, k: (c[1:3].copy_(k[0]), c.sum())[1], _cache_args),
    "transpose_select": (lambda c, i, k: (c.transpose(0, 1)[0].add_(1), c * 1)[1], _cache_args),
    "t_zero": (lambda c, i, k: (c[0].t().zero_(), c * 1)[1], _cache_args),
    "permute_fill": (lambda c, i, k: (c.permute(2, 0, 1)[1].fill_(3.0), c * 1)[1], _cache_args),
    "narrow_clamp": (lambda c, i, k: (c.narrow(0, 1, 2).clamp_(max=0.0), c * 1)[1], _cache_args),
    "stale_view_sees_later_write": (_stale_view, _cache_args),
    "inplace_result_reused": (lambda c, i, k: c.add_(1).mul_(2) * 1, _cache_args),
    "promoting_op_keeps_dtype": (lambda c, i, k: c.to(torch.float16).add_(k[0]), _cache_args),
    "intermediate_mutation": (_intermediate, _cache_args),
}


@pytest.mark.parametrize("case", sorted(MUTATIONS))
def test_rewrite_and_copy_back_match_eager(case):
    fn, make_args = MUTATIONS[case]
    gm = assert_matches_eager(fn, *make_args())
    assert mutating_nodes(gm) == []


# setitem: every index type of spec section 13, with the rule it must be lowered with.
SETITEM_CASES = {
    "int": (lambda i, m: 1, "select_scatter"),
    "negative_int": (lambda i, m: -1, "select_scatter"),
    "slice_from_0": (lambda i, m: slice(0, 2), "slice_scatter"),
    "slice_step_2": (lambda i, m: slice(None, None, 2), "slice_scatter"),
    "slice_negative_start": (lambda i, m: slice(-2, None), "slice_scatter"),
    "slice_positive_start": (lambda i, m: slice(1, 3), "where"),
    "tuple_full_slice_then_int": (lambda i, m: (slice(None), 1), "select_scatter"),
    "tuple_ellipsis": (lambda i, m: (Ellipsis, slice(1, 3)), "where"),
    "tuple_int_slice": (lambda i, m: (1, slice(1, 3)), "select_scatter"),
    "tuple_int_full_int": (lambda i, m: (0, slice(None), 2), "select_scatter"),
    "tuple_full_slice_tensor": (lambda i, m: (slice(None), i), "index_put"),
    "tuple_slice_tensor": (lambda i, m: (slice(1, 3), i), "slice_scatter"),
    "tuple_tensor_int": (lambda i, m: (i, 0), "select_scatter"),
    "bool_mask": (lambda i, m: m, "where"),
    "int_tensor": (lambda i, m: i, "index_put"),
}


def _final_op(node: Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(
        target, "__name__", str(target)).split(".")[0]


@pytest.mark.parametrize("value_kind", ["scalar", "tensor"])
@pytest.mark.parametrize("case", sorted(SETITEM_CASES))
def test_setitem_index_types_match_eager(case, value_kind):
    make_index, rule = SETITEM_CASES[case]
    x = torch.randn(4, 5, 6)
    idx = torch.tensor([3, 0])
    mask = torch.rand(4, 5) > 0.5
    region = x[make_index(idx, mask)]
    # A tensor value that broadcasts over the region: exercises expand_as.
    value = 0.5 if value_kind == "scalar" else torch.randn(region.shape[-1:])

    def fn(x, v, idx, mask):
        x[make_index(idx, mask)] = value if value_kind == "scalar" else v
        return x * 1

    gm = assert_matches_eager(fn, x, torch.as_tensor(value), idx, mask)
    assert mutating_nodes(gm) == []
    info = get_alias_info(gm)
    (out_index,) = info["io_map"]
    new_x = outputs(gm)[out_index]
    assert new_x.name == "l_x__modified"
    assert _final_op(new_x) == rule


@pytest.mark.parametrize("index", [0, slice(1, 3)], ids=["int", "slice"])
def test_setitem_casts_the_value_like_eager(index):
    def fn(x, v):
        x[index] = v
        return x * 1

    gm = assert_matches_eager(fn, torch.randn(4, 3), torch.randn(3, dtype=torch.float64))
    (out_index,) = get_alias_info(gm)["io_map"]
    assert outputs(gm)[out_index].meta["example_value"].dtype == torch.float32


def test_unsupported_setitem_index_is_kept_and_still_correct():
    def fn(x):
        x[None, 0] = 1.0  # newaxis: no rule
        return x * 1

    gm = assert_matches_eager(fn, torch.zeros(3, 4))
    (kept,) = mutating_nodes(gm)
    assert kept.target is operator.setitem


# -- whole pipeline through Inductor --------------------------------------------------------


class PagedWrite(torch.nn.Module):
    """A paged-KV-like layer: scatter new rows into a block cache, read some back."""

    def __init__(self, blocks: int = 4, block_size: int = 4, heads: int = 2, dim: int = 8):
        super().__init__()
        self.heads, self.dim = heads, dim
        self.register_buffer("cache", torch.zeros(blocks, block_size, heads, dim))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x, slots, idx, v):
        k = self.proj(x)
        self.cache.view(-1, self.heads, self.dim).index_copy_(0, slots, k)
        self.cache[idx] = v
        return self.cache[idx].sum(dim=(1, 2)) + k.sum()


@pytest.mark.parametrize("copy_back", ["after_graph", "in_graph"])
def test_whole_pipeline_with_inductor_matches_eager(copy_back):
    torch.manual_seed(0)
    eager = PagedWrite()
    compiled_module = PagedWrite()
    compiled_module.load_state_dict(eager.state_dict())
    manager = None
    if copy_back == "in_graph":
        manager = FXPassManager([*default_passes("cpu"), CopyBackInGraph()])
    compiled, seen = compile_with_passes(compiled_module, manager=manager, lower=compile_fx)

    for step in range(2):
        x = torch.randn(3, 2, 8)
        slots = torch.tensor([1, 6, 13]) + step
        idx = torch.tensor([2, 0])
        v = torch.randn(2, 4, 2, 8)
        with torch.no_grad():  # as the engine runs it
            expected = eager(x, slots, idx, v)
            actual = compiled(x, slots, idx, v)
        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(compiled_module.cache, eager.cache)
    assert len(seen) == 1
    assert compiled_module.cache.abs().sum() > 0
    gm = seen[0]
    inplace = [n.target for n in gm.graph.nodes if n.op == "call_method" and n.target[-1] == "_"]
    if copy_back == "in_graph":
        # Only the write-back remains, into the cache placeholder, with the original outputs.
        assert inplace == ["copy_"] and get_alias_info(gm) is None
        (copy,) = [n for n in gm.graph.nodes if n.target == "copy_"]
        assert copy.args[0].op == "placeholder" and "cache" in copy.args[0].target
        assert len(outputs(gm)) == 1
    else:
        assert inplace == [] and len(outputs(gm)) == 2


def test_copy_back_in_graph_must_follow_the_rewrites():
    with pytest.raises(ValueError, match="InPlaceToOutOfPlace must run before CopyBackInGraph"):
        FXPassManager([AliasingOutputRewrite(), CopyBackInGraph(), InPlaceToOutOfPlace()])
    gm, _ = capture(_kv_write, torch.ones(3), torch.zeros(3))
    with pytest.raises(ValueError, match="needs AliasingOutputRewrite"):
        CopyBackInGraph().run(gm)
