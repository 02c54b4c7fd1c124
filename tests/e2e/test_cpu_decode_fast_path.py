"""The CPU-kernel attention backend's decode program (layers/cpu_decode_program.py), run by the
worker's step program (worker/execution/decode_program.py): the same kernel calls as the module
path (GEMV up to 3 rows, oneDNN above), so the same tokens and logprobs at every batch size, and
out of the way whenever a hook is installed."""

from __future__ import annotations

import pytest
import torch
from tiny import make_byte_tokenizer, make_tiny_model

from ingot import LLM, SamplingParams

pytestmark = pytest.mark.needs_kernels


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma3"])
def engine(request, tmp_path_factory):
    # head_dim 32: the decode-attention kernel needs a multiple of 32. qwen2 has q/k/v biases,
    # qwen3 q/k norms, gemma3 Gemma's norms (1 + weight, sandwiched), GeGLU, a local layer
    # (window 8) beside a global one, each with its rope table, and scaled embeddings.
    path = tmp_path_factory.mktemp(f"fast-{request.param}")
    make_tiny_model(request.param, path, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160, head_dim=32)
    make_byte_tokenizer(path)
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=4)
    return llm, llm.llm_engine.engine_core.executor.worker.model_runner


def _run(llm, prompt):
    (result,) = _run_batch(llm, [prompt])
    return result


def _run_batch(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _count_calls(fast):
    calls = {"n": 0}
    forward = fast.forward

    def counted(*args, **kwargs):
        calls["n"] += 1
        return forward(*args, **kwargs)

    fast.forward = counted
    return calls, forward


@pytest.mark.parametrize("batch", [1, 2, 4])  # rows 1 and 2: ingot's GEMV; 4: oneDNN
def test_fast_path_equals_the_module_path_bit_for_bit(engine, batch):
    llm, runner = engine
    program = runner.program
    fast = program.decode_program
    assert fast is not None
    prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(batch)]
    calls, forward = _count_calls(fast)
    try:
        got = _run_batch(llm, prompts)
    finally:
        fast.forward = forward
    assert calls["n"] == 23  # every decode step after the prefills' tokens
    runner.program = program.inner  # the program it wraps: the modules, every step
    try:
        assert runner.program.decode_program is None
        want = _run_batch(llm, prompts)
    finally:
        runner.program = program
    # Same kernels, same order: identical tokens and logprobs, not just close.
    assert got == want


def _count_native(fast):
    calls = {"n": 0}
    native = fast._native_layers

    def counted(*args, **kwargs):
        calls["n"] += 1
        return native(*args, **kwargs)

    fast._native_layers = counted
    return calls, native


@pytest.mark.parametrize("batch", [1, 2, 4])
def test_the_c_layer_loop_equals_the_python_loop(engine, batch):
    """The program's layer loop in C (CpuKernels.decode_layers) makes the Python loop's kernel
    calls in its order: identical tokens and logprobs. It runs wherever every linear is
    ingot's kernel at the step's rows (the GEMV; above it, ingot's GEMM where that is chosen);
    oneDNN's rows keep the Python loop, which calls the modules."""
    llm, runner = engine
    fast = runner.program.decode_program
    prompts = [list(range(5 + i, 44 + 2 * i)) for i in range(batch)]
    calls, native = _count_native(fast)
    try:
        got = _run_batch(llm, prompts)
        fast.native = False
        want = _run_batch(llm, prompts)
    finally:
        fast.native = True
        fast._native_layers = native
    assert calls["n"] == (23 if batch < 3 or fast.gemm else 0)
    assert got == want
    if calls["n"]:
        # Broken: the C loop reads its own layer table (layer 0's post-attention RMSNorm eps
        # changed there alone changes its output, not the Python loop's).
        saved = fast.c_layers[0].post_eps
        fast.c_layers[0].post_eps = 1.0
        try:
            assert _run_batch(llm, prompts) != want
        finally:
            fast.c_layers[0].post_eps = saved


def test_hooks_take_the_module_path(engine):
    llm, runner = engine
    model = runner.model
    fast = runner.program.decode_program
    calls, forward = _count_calls(fast)
    seen = []
    handle = model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        _run(llm, list(range(5, 20)))
        assert calls["n"] == 0 and len(seen) == 24  # the hook saw the prefill and every decode
        handle.remove()
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [7, 8, 9]}, {"prompt_token_ids": [9, 8]}], params,
                     use_tqdm=False)
        assert calls["n"] == 3  # hook gone: batch 2 decodes through the fast path again
        # torch's global hooks count too (a pre-hook: every module's forward runs)
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda m, i: seen.append(type(m)))
        before = len(seen)
        _run(llm, list(range(5, 20)))
        assert calls["n"] == 3 and len(seen) > before
    finally:
        handle.remove()
        fast.forward = forward


def test_a_corrupted_weight_pointer_would_be_seen(engine):
    """Broken case: the fast path really reads its own resolved weights (a zeroed layer-0
    gate-up copy changes the output), so the equality above is not a tautology."""
    llm, runner = engine
    model = runner.model
    fast = runner.program.decode_program
    packed = model.model.layers[0].mlp.gate_up_proj.gemv_weight
    saved = packed.clone()
    prompt = list(range(3, 40))
    before, _ = _run(llm, prompt)
    try:
        with torch.no_grad():
            packed.zero_()
        after, _ = _run(llm, prompt)
    finally:
        with torch.no_grad():
            packed.copy_(saved)
    assert fast is runner.program.decode_program
    assert after != before


def test_packed_linears_hold_one_copy_per_kernel_layout(engine):
    """Each linear keeps only the layouts its kernels read (GEMV-blocked, and for more rows
    ingot's GEMM layout on CPUs without AMX or oneDNN's packing, never both): the plain weight
    is released, except a weight another module shares (a tied head is the embedding's
    table). The model's tokens above come from exactly these layouts."""
    from ingot.model_executor.layers.cpu_kernels import gemm_preferred
    from ingot.model_executor.layers.linear import LinearBase, resident_weight_bytes

    llm, runner = engine
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    for lin in linears:
        wide = (lin.gemm_weight, lin.packed_weight) if gemm_preferred() else \
            (lin.packed_weight, lin.gemm_weight)
        assert wide[0] is not None and wide[1] is None and lin.gemv_weight is not None
        kept = lin is model.lm_head and tied
        assert (lin.weight.numel() > 0) == kept, lin
    plain = sum(p.numel() * p.element_size() for p in model.parameters())
    derived = sum(2 * (lin.gemv_weight.numel() + (lin.gemm_weight if gemm_preferred() else
                                                  lin.packed_weight).numel())
                  for lin in linears)
    biases = sum(lin.bias_f32.numel() * 4 for lin in linears if lin.bias_f32 is not None)
    assert resident_weight_bytes(model) == plain + derived + biases
    # The GEMV copies (what a decode step streams) lie in one buffer, in the order of the layers
    # (binding.place_streamed_weights).
    assert len({lin.gemv_weight.untyped_storage().data_ptr() for lin in linears}) == 1
    layer_gemv = [lin.gemv_weight.data_ptr() for lin in linears if lin is not model.lm_head]
    assert layer_gemv == sorted(layer_gemv)
    assert llm.llm_engine.startup_stats()["load_bytes"] == resident_weight_bytes(model)
