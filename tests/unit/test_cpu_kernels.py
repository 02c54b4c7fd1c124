"""ingot's AVX512-BF16 GEMV kernel against float32 math on the same bf16 inputs."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from ingot.model_executor.layers import cpu_kernels
from ingot.model_executor.layers.linear import ReplicatedLinear

fn = cpu_kernels.load_cpu_kernels()
needs_kernel = pytest.mark.skipif(fn is None, reason="no AVX512-BF16 or no C compiler here")


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


@needs_kernel
@pytest.mark.parametrize(
    ("m", "k", "n", "bias"),
    [(1, 576, 960, False), (3, 1536, 576, True), (8, 100, 37, True), (1, 64, 5, False),
     (2, 31, 9, False)],
)
def test_kernel_matches_float32_math_within_one_bf16_rounding(m, k, n, bias):
    torch.manual_seed(0)
    x = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    y = cpu_kernels.gemv_bf16(fn, x, w, None if b is None else b.float())
    ref = _reference(x, w, b)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # One rounding to bf16 (half an ulp: 2^-9 relative) plus float32 summation-order noise.
    assert ((y.float() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3 * k**0.5).all()


@needs_kernel
def test_a_wrong_result_is_caught():
    """The tolerance above is tight enough to see one dropped K chunk."""
    torch.manual_seed(1)
    x = torch.randn(1, 96).to(torch.bfloat16)
    w = torch.randn(16, 96).to(torch.bfloat16)
    broken = cpu_kernels.gemv_bf16(fn, x[:, :64].contiguous(), w[:, :64].contiguous(), None)
    ref = _reference(x, w, None)
    assert not ((broken.float() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3 * 96**0.5).all()


@needs_kernel
def test_packed_linear_uses_the_kernel_for_small_batches_only():
    torch.manual_seed(2)
    layer = ReplicatedLinear(64, 48, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.pack_weight()
    assert layer.cpu_kernels is not None
    for rows in (1, cpu_kernels.GEMV_MAX_ROWS, cpu_kernels.GEMV_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        ref = _reference(x, layer.weight, layer.bias)
        assert ((layer(x).float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-2).all()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", cpu_kernels._UNSET)
    monkeypatch.setenv("INGOT_CPU_KERNELS", "0")
    assert cpu_kernels.load_cpu_kernels() is None



def _paged_reference(q, cache, block_table, seq_lens, scale, block_size):
    """SDPA in float32 over the gathered blocks, keys past each sequence masked."""
    num_reqs, width = block_table.shape
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = cache.shape[3]
    length = width * block_size
    k = cache[0][block_table].view(num_reqs, length, num_kv_heads, head_dim).transpose(1, 2)
    v = cache[1][block_table].view(num_reqs, length, num_kv_heads, head_dim).transpose(1, 2)
    mask = (torch.arange(length) < seq_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.float(), v.float(), attn_mask=mask, scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.view(num_reqs, num_heads * head_dim)


@needs_kernel
@pytest.mark.parametrize(
    ("num_reqs", "width", "heads", "kv_heads", "head_dim", "block_size"),
    [(1, 8, 9, 3, 64, 32), (5, 3, 4, 4, 32, 16), (16, 2, 8, 1, 16, 8)],
)
def test_paged_decode_matches_sdpa_over_the_gathered_blocks(
    num_reqs, width, heads, kv_heads, head_dim, block_size
):
    torch.manual_seed(4)
    cache = torch.randn(2, 40, block_size, kv_heads, head_dim).to(torch.bfloat16)
    table = torch.randint(1, 40, (num_reqs, width))
    seq_lens = torch.randint(1, width * block_size + 1, (num_reqs,))
    q = torch.randn(num_reqs, heads, head_dim).to(torch.bfloat16)
    got = cpu_kernels.paged_decode_bf16(fn, q, cache, table, seq_lens, head_dim**-0.5).float()
    ref = _paged_reference(q, cache, table, seq_lens, head_dim**-0.5, block_size)
    # One bf16 rounding of the output (half an ulp) plus float32 noise.
    assert ((got - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3).all()
    # A sequence one key shorter gives a visibly different answer (the length is honoured).
    shorter = cpu_kernels.paged_decode_bf16(fn, q, cache, table, (seq_lens - 1).clamp(min=1),
                                            head_dim**-0.5).float()
    assert not torch.allclose(shorter, ref, atol=1e-3) or (seq_lens == 1).all()
