"""The attention backend is chosen once per model (layers/attention_backend.py): which one serves
which (device, dtype, KV dtype, compilation, heads); the CPU-kernel backend's prefill, decode and
verification equal the torch backend's on the same inputs; and an engine binds its choice to
every attention layer, with the decode program only where the backend has one for the model."""

from __future__ import annotations

import pytest
import torch

from ingot.model_executor.layers import cpu_kernels
from ingot.model_executor.layers.attention import AttentionMetadata, KVScales
from ingot.model_executor.layers.attention_backend import (
    TORCH_ATTENTION,
    AttentionBindable,
    CpuKernelAttention,
    select_attention_backend,
)
from ingot.model_executor.layers.rotary import RotaryEmbedding

kernels = cpu_kernels.load_cpu_kernels()
CPU, BF16 = torch.device("cpu"), torch.bfloat16
HEADS = (4, 2, 32)


@pytest.mark.needs_kernels
def test_cpu_kernels_serve_an_eager_bf16_model_over_a_bf16_cache():
    backend = select_attention_backend(CPU, BF16, BF16, False, HEADS)
    assert isinstance(backend, CpuKernelAttention) and backend.name == "cpu-kernels"


@pytest.mark.parametrize(
    ("device", "dtype", "kv_dtype", "compiled", "heads"),
    [
        ("cpu", torch.float32, torch.float32, False, HEADS),  # fp32 model
        ("cpu", BF16, torch.float8_e4m3fn, False, HEADS),  # FP8 cache (and its calibration)
        ("cpu", BF16, BF16, True, HEADS),  # compiled layers: Dynamo cannot trace ctypes calls
        ("cpu", BF16, BF16, False, (4, 2, 48)),  # head_dim not a multiple of 32
        ("cpu", BF16, BF16, False, (34, 2, 32)),  # 17 query heads per KV head: over the limit
        ("cuda", BF16, BF16, False, HEADS),
    ],
)
def test_torch_serves_everything_else(device, dtype, kv_dtype, compiled, heads):
    backend = select_attention_backend(torch.device(device), dtype, kv_dtype, compiled, heads)
    assert backend is TORCH_ATTENTION and backend.name == "torch"


class _Layer:
    def __init__(self, head_dim: int) -> None:
        torch.set_default_dtype(BF16)
        try:
            self.rotary = RotaryEmbedding(head_dim, 256, {"rope_type": "default", "rope_theta": 10000.0})
        finally:
            torch.set_default_dtype(torch.float32)
        self.scale = head_dim**-0.5
        self.sliding_window = None
        self.kv_scales = KVScales()


def _qkv(n: int, heads: int, kv_heads: int, d: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(n, h, d, generator=g).to(BF16) for h in (heads, kv_heads, kv_heads))


def _run(backend, layer, cache, steps):
    """Each step: (positions, query_lens, slots, block_table, is_decode, rows_share)."""
    outs = []
    for i, (pos, lens, slots, table, is_decode, share) in enumerate(steps):
        meta = backend.build_metadata(pos, lens, slots, table, block_size=4, is_decode=is_decode,
                                      rows_share_sequences=share)
        q, k, v = _qkv(pos.numel(), 4, 2, 32, seed=i)
        outs.append(backend.attend(layer, pos, q, k, v, cache, meta).float())
    return outs


def _steps():
    table = torch.tensor([[1, 2, 3]])
    prefill = (torch.arange(6), [6], torch.arange(6) + 4, table, False, False)
    decode = (torch.tensor([6]), [1], torch.tensor([10]), table, True, False)
    # Verification: positions 7 and 8 of the same sequence, one row each.
    verify = (torch.tensor([7, 8]), [1, 1], torch.tensor([11, 12]), table.expand(2, -1), True,
              True)
    return [prefill, decode, verify]


@pytest.mark.needs_kernels
def test_cpu_kernels_equal_torch_on_prefill_decode_and_verification():
    layer = _Layer(32)
    caches = [torch.zeros(2, 4, 4, 2, 32, dtype=BF16) for _ in range(2)]
    got = _run(CpuKernelAttention(kernels), layer, caches[0], _steps())
    want = _run(TORCH_ATTENTION, layer, caches[1], _steps())
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g, w, atol=2e-2, rtol=2e-2), (g - w).abs().max()
    assert torch.allclose(caches[0].float(), caches[1].float(), atol=1e-2)
    # The broken case: verification rows that could not see each other's keys (each attends
    # only up to its own row's predecessor) must not pass the same check.
    layer2 = _Layer(32)
    cache = torch.zeros(2, 4, 4, 2, 32, dtype=BF16)
    steps = _steps()
    pos, lens, slots, table, _, _ = steps[2]
    steps[2] = (pos, lens, torch.tensor([11, -1]), table, True, True)  # row 8's key unwritten
    broken = _run(CpuKernelAttention(kernels), layer2, cache, steps)
    assert not torch.allclose(broken[2], want[2], atol=2e-2, rtol=2e-2)


@pytest.mark.needs_kernels
def test_the_cpu_kernel_backend_builds_no_decode_mask():
    table = torch.tensor([[1, 2]])
    args = (torch.tensor([5]), [1], torch.tensor([9]), table)
    cpu = CpuKernelAttention(kernels).build_metadata(*args, block_size=4, is_decode=True)
    torch_meta = TORCH_ATTENTION.build_metadata(*args, block_size=4, is_decode=True)
    assert cpu.attn_mask is None and torch_meta.attn_mask is not None
    assert torch.equal(cpu.seq_lens, torch_meta.seq_lens)
    prefill = CpuKernelAttention(kernels).build_metadata(
        torch.arange(3), [3], torch.arange(3) + 4, table, block_size=4)
    assert isinstance(prefill, AttentionMetadata) and prefill.attn_mask is not None


def _bound(path, dtype):
    from ingot import LLM

    llm = LLM(model=str(path), dtype=dtype, max_model_len=128, max_num_seqs=2)

    def report(worker):  # noqa: ANN001, ANN202
        model = worker.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, AttentionBindable)]
        names = {m.attn_backend.name for m in layers}
        return (worker.attn_backend.name, names, len(layers),
                worker.model_runner.program.decode_program is not None)

    (result,) = llm.llm_engine.collective_rpc(report)
    return result


def _dense(path):  # noqa: ANN001, ANN202
    from tiny import make_byte_tokenizer, make_tiny_model

    make_tiny_model("llama", path, hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160, num_hidden_layers=2)
    make_byte_tokenizer(path)
    return path


def test_an_fp32_engine_binds_torch_to_every_layer(tmp_path):
    """Needs no kernels: a float32 model runs torch attention wherever it runs."""
    assert _bound(_dense(tmp_path / "dense"), "float32") == ("torch", {"torch"}, 2, False)


@pytest.mark.needs_kernels
def test_an_engine_binds_one_backend_to_every_layer(tmp_path):
    from tiny import make_byte_tokenizer, make_tiny_model

    dense = _dense(tmp_path / "dense")
    assert _bound(dense, "bfloat16") == ("cpu-kernels", {"cpu-kernels"}, 2, True)
    # q/k norm (Qwen3): the kernels attend, and the decode program runs its norms per head.
    make_tiny_model("qwen3", tmp_path / "qwen3", hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=160, num_hidden_layers=2,
                    head_dim=32)
    make_byte_tokenizer(tmp_path / "qwen3")
    assert _bound(tmp_path / "qwen3", "bfloat16") == ("cpu-kernels", {"cpu-kernels"}, 2, True)
    # Sparse layers (Qwen3-MoE): the kernels attend, the decode program (dense MLPs only) does
    # not build, so decode runs the modules.
    make_tiny_model("qwen3_moe", tmp_path / "moe", hidden_size=128, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, head_dim=32)
    make_byte_tokenizer(tmp_path / "moe")
    assert _bound(tmp_path / "moe", "bfloat16") == ("cpu-kernels", {"cpu-kernels"}, 2, False)
