"""ingot's bf16 kernels against torch: float32 math on the same bf16 inputs for the GEMV, GEMM
and attention, bit-equality with torch's bf16 ops for the elementwise kernels and argmax. Every
test of a kernel runs each build this CPU runs (tests/kernel_builds.py: the ``fn`` fixture for
the bf16 library, ``isa`` for the float32 one; an AVX-512 CPU tests its AVX2 and portable builds
too); each build it cannot run is one skip of ``test_build_runs_here``, which says how many
kernel tests that build did not run."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import kernel_builds
from ingot.model_executor.layers import cpu_kernels
from ingot.model_executor.layers.bindable import Kernels
from ingot.model_executor.layers.layernorm import RMSNorm
from ingot.model_executor.layers.linear import ReplicatedLinear, cpu_packed_linear_supported
from ingot.model_executor.layers.rotary import RotaryEmbedding
from ingot.model_executor.layers.sampler import greedy_argmax


@pytest.fixture(params=kernel_builds.over("bf16"))
def fn(request) -> cpu_kernels.CpuKernels:
    """One build of the bf16 library this CPU runs (each in turn)."""
    return kernel_builds.load("bf16", request.param)


@pytest.mark.parametrize("isa", kernel_builds.every_build())
def test_build_runs_here(isa, monkeypatch):
    """A build this CPU runs loads (each library it is a build of) with the vector width and
    bf16 dot product it was built for, as the library itself reports them; a build it cannot
    run is this one skip, which counts the kernel tests that did not run for it."""
    if not kernel_builds.runs(isa):
        pytest.skip(kernel_builds.not_run(isa))
    reported = {}
    check = cpu_kernels._check_build

    def spy(lib, build):  # noqa: ANN001, ANN202
        reported[build] = (lib.ingot_cpu_lanes(), bool(lib.ingot_cpu_native_bf16_dot()))
        check(lib, build)

    monkeypatch.setattr(cpu_kernels, "_check_build", spy)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})  # load afresh, through the check
    assert kernel_builds.load("bf16", isa).isa == isa
    assert reported == {isa: (cpu_kernels.ISAS[isa].lanes, cpu_kernels.ISAS[isa].native_bf16_dot)}
    if isa in cpu_kernels.F32_ISAS:
        f32 = kernel_builds.load("f32", isa)
        assert f32.isa == isa and f32.lanes == cpu_kernels.ISAS[isa].lanes
    if isa in kernel_builds.LIBRARIES["quant"][1]:
        assert kernel_builds.load("quant", isa).isa == isa


@pytest.fixture
def default_fn() -> cpu_kernels.CpuKernels:
    """The build the loader picks for this CPU (what models bind)."""
    return cpu_kernels.load_cpu_kernels()


def _reference(x, w, b):
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _within_one_rounding(y, ref, k):
    # One rounding to bf16 (half an ulp: 2^-9 relative) plus float32 summation-order noise.
    return ((y.float() - ref).abs() <= ref.abs() * 2.0**-8 + 1e-3 * k**0.5).all()


def _pack_and_run(fn, kind: str):  # noqa: ANN001, ANN202
    if kind == "gemv":
        return cpu_kernels.pack_gemv_weight, cpu_kernels.gemv_bf16
    return (lambda w: cpu_kernels.pack_gemm_weight(fn, w)), cpu_kernels.gemm_bf16


_SHAPES = [(1, 576, 960, False), (3, 1536, 576, True), (8, 100, 37, True), (1, 64, 5, False),
           (4, 576, 960, True), (37, 1536, 576, False), (9, 100, 37, True), (70, 64, 200, True),
           (300, 576, 49, False)]


@pytest.mark.needs_kernels
@pytest.mark.parametrize(
    ("kind", "m", "k", "n", "bias"),
    [(kind, *shape) for kind in ("gemv", "gemm") for shape in _SHAPES]
    + [("gemv", 2, 31, 9, False)],  # an odd K: the GEMV's tail (the GEMM's K is even)
)
def test_packed_matmul_matches_float32_math_within_one_bf16_rounding(fn, kind, m, k, n, bias):
    """Both kernels on every row-tile (8) and output-tile (48) tail, K not a multiple of 32."""
    torch.manual_seed(0)
    x = torch.randn(m, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n).to(torch.bfloat16) if bias else None
    pack, run = _pack_and_run(fn, kind)
    y = run(fn, x, pack(w), n, None if b is None else b.float())
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert _within_one_rounding(y, _reference(x, w, b), k)


@pytest.mark.needs_kernels
def test_gemv_tolerance_catches_a_dropped_k_chunk(fn):
    torch.manual_seed(1)
    x = torch.randn(1, 96).to(torch.bfloat16)
    w = torch.randn(16, 96).to(torch.bfloat16)
    short = cpu_kernels.pack_gemv_weight(w[:, :64].contiguous())
    broken = cpu_kernels.gemv_bf16(fn, x[:, :64].contiguous(), short, 16)
    assert not _within_one_rounding(broken, _reference(x, w, None), 96)


@pytest.mark.needs_kernels
@pytest.mark.parametrize(("k", "n"), [(576, 960), (70, 100), (1536, 13)])
def test_gemv_rows_are_the_same_whatever_the_row_count(fn, k, n):
    """Speculative decoding's bit-exact greedy rests on this: a verification step computes
    1 + d rows per request with the GEMV, a plain decode step one; each row must come out the
    same bit for bit (rows are taken in pairs and singly). Its broken twin is below."""
    torch.manual_seed(4)
    x = torch.randn(7, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    b = torch.randn(n)
    packed = cpu_kernels.pack_gemv_weight(w)
    together = cpu_kernels.gemv_bf16(fn, x, packed, n, b)
    alone = torch.cat([cpu_kernels.gemv_bf16(fn, x[i : i + 1], packed, n, b) for i in range(7)])
    assert torch.equal(together, alone)


@pytest.mark.needs_kernels
def test_gemv_and_the_wider_kernels_round_differently(fn):
    """Broken twin of the row-count gate above, and why decode and verification rows must not
    mix kernels: at the default model's gate_up shape, ingot's GEMM (what rows above the GEMV's
    run on CPUs without AMX) rounds a few outputs differently from the GEMV (3-4 of 21,504 in
    every build), and so does oneDNN's bf16 linear (torch's bf16 linear where the CPU has no
    oneDNN bf16); ``torch.equal`` sees either switch. (On AMX, oneDNN's tiles round as the GEMV
    does at the qkv shape, 960 x 576: 0 of 6,720 outputs differ; not at this one.)"""
    torch.manual_seed(4)
    k, n = 576, 3072
    x = torch.randn(7, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    gemv = cpu_kernels.gemv_bf16(fn, x, cpu_kernels.pack_gemv_weight(w), n)
    gemm = cpu_kernels.gemm_bf16(fn, x, cpu_kernels.pack_gemm_weight(fn, w), n)
    assert not torch.equal(gemm, gemv)
    torch.testing.assert_close(gemm, gemv)  # the same products: a rounding apart
    if cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu")):
        onednn = torch.ops.mkldnn._linear_pointwise(
            x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
        assert not torch.equal(onednn, gemv)
    else:
        assert not torch.equal(F.linear(x, w), gemv)


@pytest.mark.needs_kernels
def test_gemm_tolerance_catches_a_misread_pair(fn):
    """Broken twin: weights packed with each k pair swapped (the layout read the wrong way)."""
    torch.manual_seed(1)
    x = torch.randn(16, 96).to(torch.bfloat16)
    w = torch.randn(40, 96).to(torch.bfloat16)
    swapped = w.view(40, 48, 2).flip(-1).reshape(40, 96).contiguous()
    broken = cpu_kernels.gemm_bf16(fn, x, cpu_kernels.pack_gemm_weight(fn, swapped), 40)
    assert not _within_one_rounding(broken, _reference(x, w, None), 96)


@pytest.mark.needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_rows_are_the_same_whatever_the_batch(fn, threads):
    """Each output is one FMA chain over k whatever rows share the call, their tiling or the
    thread that takes the item: a request's prefill or decode row is bit-identical batched
    and alone (batch invariance)."""
    torch.manual_seed(4)
    x = torch.randn(45, 576).to(torch.bfloat16)
    w = torch.randn(200, 576).to(torch.bfloat16)
    b = torch.randn(200)
    packed = cpu_kernels.pack_gemm_weight(fn, w)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = cpu_kernels.gemm_bf16(fn, x, packed, 200, b)
        alone = torch.cat([cpu_kernels.gemm_bf16(fn, x[i : i + 1], packed, 200, b)
                           for i in range(45)])
        pieces = torch.cat([cpu_kernels.gemm_bf16(fn, x[i : i + 9], packed, 200, b)
                            for i in range(0, 45, 9)])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(together, alone) and torch.equal(together, pieces)


@pytest.mark.parametrize(("env", "amx", "expected"),
                         [("auto", False, True), ("auto", True, False), ("1", True, True),
                          ("0", False, False)])
def test_gemm_is_preferred_without_amx(monkeypatch, env, amx, expected):
    flags = "flags : fpu avx512f avx512_bf16" + (" amx_bf16 amx_tile" if amx else "") + "\n"
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: flags)
    monkeypatch.setenv("INGOT_CPU_GEMM", env)
    assert cpu_kernels.gemm_preferred() is expected


@pytest.mark.parametrize(("env", "vendor", "expected"),
                         [("auto", "AuthenticAMD", True), ("auto", "GenuineIntel", False),
                          ("mkl", "AuthenticAMD", False), ("onednn", "GenuineIntel", True)])
def test_f32_gemm_choice_follows_the_vendor(monkeypatch, env, vendor, expected):
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: f"vendor_id\t: {vendor}\nflags : fpu avx2\n")
    monkeypatch.setenv("INGOT_CPU_F32_GEMM", env)
    assert cpu_kernels.onednn_f32_preferred() is expected


def test_f32_gemm_choice_rejects_a_bad_value(monkeypatch):
    monkeypatch.setenv("INGOT_CPU_F32_GEMM", "yes")
    with pytest.raises(ValueError, match="INGOT_CPU_F32_GEMM must be auto, onednn or mkl"):
        cpu_kernels.onednn_f32_preferred()


def test_gemm_choice_rejects_a_bad_value(monkeypatch):
    monkeypatch.setenv("INGOT_CPU_GEMM", "yes")
    with pytest.raises(ValueError, match="INGOT_CPU_GEMM must be auto, 0 or 1"):
        cpu_kernels.gemm_preferred()


@pytest.mark.needs_kernels
@pytest.mark.parametrize("gemm", ["1", "0"])
def test_packed_linear_takes_one_layout_for_many_rows(fn, monkeypatch, gemm):
    """More rows than the GEMV serves run on ingot's GEMM (INGOT_CPU_GEMM=1: its layout only)
    or on oneDNN (0: its packing only); both within one rounding of float32 math."""
    if gemm == "0" and not cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("this CPU has no oneDNN bf16 linear (AVX512-BF16 or AVX-NE-CONVERT)")
    monkeypatch.setenv("INGOT_CPU_GEMM", gemm)
    torch.manual_seed(3)
    layer = ReplicatedLinear(64, 48, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    layer.pack_weight(fn)
    assert (layer.gemm_weight is not None) == (gemm == "1")
    assert (layer.packed_weight is not None) == (gemm == "0")
    x = torch.randn(2, 5, 64).to(torch.bfloat16)  # 10 rows, 3-D as attention heads give them
    y = layer(x)
    assert y.shape == (2, 5, 48)
    assert _within_one_rounding(y, _reference(x, weight, layer.bias), 64)


@pytest.mark.needs_kernels
def test_packed_linear_uses_the_kernel_for_single_rows_only(fn):
    torch.manual_seed(2)
    layer = ReplicatedLinear(64, 48, bias=True).to(torch.bfloat16)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight = layer.weight.detach().clone()
    layer.pack_weight(fn)
    assert layer.gemv_weight is not None and layer.weight.numel() == 0  # plain copy released
    for rows in (1, cpu_kernels.GEMV_MAX_ROWS, cpu_kernels.GEMV_MAX_ROWS + 1, 64):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        ref = _reference(x, weight, layer.bias)
        assert ((layer(x).float() - ref).abs() <= ref.abs() * 2.0**-7 + 1e-2).all()


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("INGOT_CPU_KERNELS", "0")
    assert cpu_kernels.load_cpu_kernels() is None
    assert cpu_kernels.load_f32_kernels() is None


@pytest.mark.needs_kernels
@pytest.mark.parametrize(("rows", "width"), [(1, 576), (64, 576), (3, 100), (2, 16)])
def test_rms_norm_equals_torch_bit_for_bit(fn, rows, width):
    torch.manual_seed(3)
    norm = RMSNorm(width, 1e-5).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(rows, width).to(torch.bfloat16)
    residual = torch.randn(rows, width).to(torch.bfloat16)
    assert torch.equal(cpu_kernels.rms_norm_bf16(fn, x, norm.weight, 1e-5), norm(x))
    out, new_residual = cpu_kernels.rms_norm_bf16(fn, x, norm.weight, 1e-5, residual)
    ref_out, ref_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual)
    assert torch.equal(out, ref_out)
    # The comparison sees a wrong epsilon (a broken kernel would look like this).
    assert not torch.equal(cpu_kernels.rms_norm_bf16(fn, x, norm.weight, 1e-1), norm(x))


@pytest.mark.needs_kernels
def test_rms_norm_module_uses_the_kernel_once_attached(default_fn):
    norm = RMSNorm(64, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = torch.randn(5, 64).to(torch.bfloat16)
    expected = norm(x)
    norm.bind_kernels(Kernels(cpu=True, pack="bf16"))
    assert norm.cpu_kernels is default_fn
    assert torch.equal(norm(x), expected)


@pytest.mark.needs_kernels
@pytest.mark.parametrize(("rows", "width"), [(1, 640), (64, 640), (3, 100), (4, 256)])
def test_zero_centred_rms_norm_equals_torch(fn, rows, width):
    """Gemma's RMSNorm (1 + weight, float32, one rounding) against its torch path; its twin:
    the weight used without the 1 (Llama's rule) is caught."""
    from ingot.model_executor.models.gemma3 import GemmaRMSNorm

    torch.manual_seed(4)
    norm = GemmaRMSNorm(width, 1e-6).to(torch.bfloat16)
    norm.weight.data.normal_()
    x = (torch.randn(rows, width) * 4).to(torch.bfloat16)
    residual = torch.randn(rows, width).to(torch.bfloat16)
    w1 = 1.0 + norm.weight.float()

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        # rsqrt's sum of squares adds in another order than torch's mean: a float32 ulp can
        # move an output across a bf16 rounding boundary, so allow one bf16 ulp, rarely.
        ulp = (a.float() - b.float()).abs() <= b.float().abs() * 2.0**-7
        return bool(ulp.all()) and (a != b).float().mean().item() <= 0.01

    assert close(cpu_kernels.rms_norm_bf16(fn, x, w1, 1e-6, zero_centred=True), norm(x))
    out, new_residual = cpu_kernels.rms_norm_bf16(fn, x, w1, 1e-6, residual, zero_centred=True)
    ref_out, ref_residual = norm(x, residual)
    assert torch.equal(new_residual, ref_residual)
    assert close(out, ref_out)
    assert not close(cpu_kernels.rms_norm_bf16(fn, x, norm.weight.float(), 1e-6,
                                               zero_centred=True), norm(x))


@pytest.mark.needs_kernels
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (64, 1536), (2, 37)])
def test_act_mul_equals_torch(fn, rows, inter, act):
    torch.manual_seed(5)
    gate_up = (torch.randn(rows, 2 * inter) * 3).to(torch.bfloat16)
    gate, up = gate_up.chunk(2, dim=-1)
    fns = {"silu": F.silu, "gelu_pytorch_tanh": lambda g: F.gelu(g, approximate="tanh")}
    ref = fns[act](gate) * up
    got = cpu_kernels.act_mul_bf16(fn, gate_up, act)
    # exp's last float32 bit may differ from torch's: a bf16 rounding flips rarely. torch's
    # own vectorized tanh saturates to -1 earlier than its scalar one (GELU(-5.1): 0 against
    # -1.5e-7), as ingot's may: the atol covers such ~1e-7 values.
    assert (got != ref).float().mean() <= 1e-2
    assert torch.allclose(got.float(), ref.float(), rtol=2.0**-7, atol=1e-5)
    other = next(name for name in fns if name != act)  # the other activation is caught
    assert not torch.allclose(cpu_kernels.act_mul_bf16(fn, gate_up, other).float(),
                              ref.float(), rtol=2.0**-7, atol=1e-5)


@pytest.mark.needs_kernels
def test_argmax_equals_torch_including_ties_nan_and_inf(fn):
    torch.manual_seed(6)
    logits = torch.randn(9, 49152).to(torch.bfloat16)
    logits[1, 100] = logits[1, 200] = 50.0  # tie: the first index wins
    logits[2, 7] = logits[2, 9] = float("nan")  # NaN wins, the first one
    logits[3] = float("-inf")
    logits[4] = 1.0
    for rows, cols in ((9, 49152), (1, 37), (3, 16), (2, 1)):
        part = logits[:rows, :cols]
        assert torch.equal(cpu_kernels.argmax_bf16(fn, part), part.argmax(dim=-1))
        assert torch.equal(greedy_argmax(part), part.argmax(dim=-1))


def _attention_reference(q, cache, block_table, seq_lens, scale, block_size, window=None):
    """SDPA in float32 over the gathered blocks, keys past each sequence (and outside the
    sliding window) masked."""
    num_reqs, width = block_table.shape
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = cache.shape[3]
    length = width * block_size
    k = cache[0][block_table].view(num_reqs, length, num_kv_heads, head_dim).transpose(1, 2)
    v = cache[1][block_table].view(num_reqs, length, num_kv_heads, head_dim).transpose(1, 2)
    key_pos = torch.arange(length)
    mask = key_pos < seq_lens[:, None]
    if window is not None:
        mask &= key_pos >= seq_lens[:, None] - window
    out = F.scaled_dot_product_attention(
        q.float().unsqueeze(2), k.float(), v.float(), attn_mask=mask[:, None, None, :],
        scale=scale, enable_gqa=num_heads != num_kv_heads,
    )
    return out.view(num_reqs, num_heads * head_dim)


def _close(got, ref):
    # The output's bf16 rounding (half an ulp) and, as in torch's CPU flash attention, the
    # probabilities rounded to bf16 before p.v.
    return ((got.float() - ref).abs() <= ref.abs() * 2.0**-7 + 4e-3).all()


def _attention_case(num_reqs, width, heads, kv_heads, head_dim, block_size, seed=4):
    torch.manual_seed(seed)
    num_blocks = num_reqs * width + 4
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).to(torch.bfloat16)
    # Disjoint blocks per sequence, as the cache manager hands out for writable slots.
    table = (torch.randperm(num_blocks - 1)[: num_reqs * width] + 1).view(num_reqs, width)
    seq_lens = torch.randint(1, width * block_size + 1, (num_reqs,))
    positions = seq_lens - 1
    slots = table[torch.arange(num_reqs), positions // block_size] * block_size
    slots += positions % block_size
    qkv = torch.randn(num_reqs, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(num_reqs, heads, head_dim)  # strided views into qkv, as in the model
    k = k.view(num_reqs, kv_heads, head_dim)
    v = v.view(num_reqs, kv_heads, head_dim)
    return cache, table, seq_lens, positions, slots, q, k, v


@pytest.mark.needs_kernels
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize(
    ("num_reqs", "width", "heads", "kv_heads", "head_dim", "block_size", "window"),
    [(1, 8, 9, 3, 64, 32, None), (5, 3, 4, 4, 32, 16, None), (16, 2, 8, 1, 128, 8, None),
     (7, 6, 6, 2, 64, 16, 20), (64, 8, 9, 3, 64, 32, None), (3, 2, 2, 1, 256, 16, None)],
)
def test_decode_attention_writes_the_cache_and_matches_sdpa(
    fn, num_reqs, width, heads, kv_heads, head_dim, block_size, window, rotary
):
    cache, table, seq_lens, positions, slots, q, k, v = _attention_case(
        num_reqs, width, heads, kv_heads, head_dim, block_size
    )
    if num_reqs > 2:
        slots[1] = -1  # a padding row: its k/v must not be written
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    cos_sin = rope.cos_sin_cache.to(torch.bfloat16)
    rope.cos_sin_cache = cos_sin
    scale = head_dim**-0.5

    got_cache = cache.clone()
    got = cpu_kernels.decode_attention_bf16(
        fn, q, k, v, got_cache, slots, table, seq_lens, scale, window,
        positions if rotary else None, cos_sin if rotary else None,
    )
    # Reference: torch's rotary, torch's cache write, float32 SDPA.
    q_ref, k_ref = rope(positions, q, k) if rotary else (q, k)
    ref_cache = cache.clone()
    written = slots >= 0
    ref_cache[0].view(-1, kv_heads, head_dim)[slots[written]] = k_ref[written]
    ref_cache[1].view(-1, kv_heads, head_dim)[slots[written]] = v[written]
    assert torch.equal(got_cache, ref_cache)  # rotary is bit-exact with torch's
    ref = _attention_reference(q_ref, ref_cache, table, seq_lens, scale, block_size, window)
    assert got.shape == (num_reqs, heads * head_dim)
    assert _close(got, ref)
    if rotary:
        # Broken case: attention over unrotated queries must fail the same check.
        assert not _close(
            cpu_kernels.decode_attention_bf16(
                fn, q, k, v, cache.clone(), slots, table, seq_lens, scale, window
            ),
            ref,
        )
    # A sequence one key shorter gives a visibly different answer (the length is honoured).
    shorter = cpu_kernels.decode_attention_bf16(
        fn, q_ref, k_ref, v, ref_cache.clone(), torch.full_like(slots, -1), table,
        (seq_lens - 1).clamp(min=1), scale, window,
    )
    assert not _close(shorter, ref) or (seq_lens == 1).all()


@pytest.mark.needs_kernels
def test_write_kv_equals_the_torch_write_and_skips_padding(fn):
    from ingot.model_executor.layers.attention import write_kv_cache

    torch.manual_seed(7)
    cache = torch.randn(2, 6, 4, 3, 32).to(torch.bfloat16)
    qkv = torch.randn(10, 5 * 3 * 32).to(torch.bfloat16)
    key = qkv[:, 96:192].view(10, 3, 32)  # strided views, as the model passes them
    value = qkv[:, 192:288].view(10, 3, 32)
    slots = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11, -1, -1])
    got, ref = cache.clone(), cache.clone()
    cpu_kernels.write_kv_bf16(fn, key, value, got, slots)
    write_kv_cache(ref, key, value, slots)
    assert torch.equal(got, ref)
    assert not torch.equal(got, cache)


@pytest.mark.needs_kernels
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (8, 2, 128)])
def test_rope_write_kv_equals_torch_rotary_and_write(fn, heads, kv_heads, head_dim):
    from ingot.model_executor.layers.attention import write_kv_cache

    torch.manual_seed(3)
    tokens = 40
    rope = RotaryEmbedding(head_dim, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    rope.cos_sin_cache = rope.cos_sin_cache.to(torch.bfloat16)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    qkv = torch.randn(tokens, q_size + 2 * kv_size).to(torch.bfloat16)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)  # strided views, as the model
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    positions = torch.randint(0, 4000, (tokens,))
    slots = 16 + torch.randperm(7 * 16)[:tokens]  # block 0 is the null block
    slots[-5:] = -1  # padding
    cache = torch.randn(2, 8, 16, kv_heads, head_dim).to(torch.bfloat16)
    got_cache, ref_cache = cache.clone(), cache.clone()
    q_rot, k_rot = cpu_kernels.rope_write_kv_bf16(
        fn, q, k, v, positions, rope.cos_sin_cache, got_cache, slots
    )
    q_ref, k_ref = rope(positions, q, k)
    write_kv_cache(ref_cache, k_ref, v, slots)
    assert torch.equal(q_rot, q_ref) and torch.equal(k_rot, k_ref)
    assert torch.equal(got_cache, ref_cache)
    # Broken case: rotating at the wrong positions must not pass the same comparison.
    q_off, _ = rope(positions + 1, q, k)
    assert not torch.equal(q_rot, q_off)


def _per_sequence_sdpa(q, k, v, lens):
    out, s = [], 0
    for n in lens:
        qs, ks, vs = (x[s : s + n].transpose(0, 1) for x in (q, k, v))
        out.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1).reshape(n, -1))
        s += n
    return torch.cat(out)


# Every float32 build this CPU runs (an AVX-512 CPU tests its AVX2 build too).
F32_BUILDS = kernel_builds.over("f32")


def _f32(isa: str) -> cpu_kernels.F32Kernels:
    return kernel_builds.load("f32", isa)


@pytest.mark.parametrize("isa", F32_BUILDS)
@pytest.mark.parametrize(("heads", "head_dim"), [(12, 32), (2, 16), (4, 64), (3, 48)])
def test_encoder_attention_matches_per_sequence_sdpa(isa, heads, head_dim):
    """Packed sequences of 1-130 rows (tails of 8-row, 32-key and 16-column blocks), read in place from a
    fused qkv output; padded rows after the last sequence come out zero; a sequence alone gives
    the very same rows. Broken twin: one bidirectional attention over the whole packed batch
    (neighbours leaking into each other) fails the same tolerance."""
    kernels = _f32(isa)
    torch.manual_seed(0)
    lens = [1, 5, 16, 17, 64, 130, 3]
    total, pad = sum(lens), 6
    qkv = torch.randn(total + pad, 3 * heads * head_dim)
    q, k, v = (x.reshape(-1, heads, head_dim) for x in qkv.chunk(3, dim=-1))
    starts = torch.tensor([0, *lens]).cumsum(0)
    out = cpu_kernels.encoder_attention_f32(kernels, q, k, v, starts, head_dim**-0.5, max(lens))
    ref = _per_sequence_sdpa(q, k, v, lens)
    assert torch.allclose(out[:total], ref, atol=1e-5)
    assert out[total:].eq(0).all()
    s, n = int(starts[5]), lens[5]
    alone = cpu_kernels.encoder_attention_f32(
        kernels, q[s : s + n], k[s : s + n], v[s : s + n], torch.tensor([0, n]), head_dim**-0.5, n)
    assert torch.equal(alone, out[s : s + n])
    leaky = _per_sequence_sdpa(q, k, v, [total])
    assert not torch.allclose(out[:total], leaky, atol=1e-5)


@pytest.mark.parametrize("isa", F32_BUILDS)
@pytest.mark.parametrize(("rows", "width"), [(64, 1536), (3, 20)])
def test_bias_gelu_equals_torch_erf_gelu(isa, rows, width):
    """Within float32 noise of F.gelu(x + bias) in float64, as close as torch's own (row tails
    of a vector, large |x| where erf saturates). Broken twin: the tanh GELU fails the bound."""
    kernels = _f32(isa)
    torch.manual_seed(6)
    x = torch.randn(rows, width) * 4
    x[0, :4] = torch.tensor([-30.0, 30.0, -9.0, 0.0])
    bias = torch.randn(width)
    ref = F.gelu((x + bias).double())
    tol = 2e-6 * (1 + ref.abs())
    assert ((F.gelu(x + bias) - ref).abs() <= tol).all()  # the bound holds torch's own GELU
    got = cpu_kernels.bias_gelu_f32_(kernels, x.clone(), bias)
    assert ((got - ref).abs() <= tol).all()
    assert not ((F.gelu(x + bias, approximate="tanh") - ref).abs() <= tol).all()


@pytest.mark.parametrize("isa", F32_BUILDS)
@pytest.mark.parametrize(("rows", "width"), [(64, 384), (3, 20)])
def test_add_layernorm_equals_torch(isa, rows, width):
    """LayerNorm(x + bias + residual) in one pass, in place or not, bias or residual absent.
    Broken twin: without the residual it fails the same tolerance."""
    kernels = _f32(isa)
    torch.manual_seed(7)
    x, residual = torch.randn(rows, width) * 3, torch.randn(rows, width)
    bias, w, b = torch.randn(width), torch.randn(width), torch.randn(width)

    def ref(h):
        return F.layer_norm(h.double(), (width,), w.double(), b.double(), 1e-12).float()

    got = cpu_kernels.add_layernorm_f32(kernels, x, bias, residual, w, b, 1e-12)
    assert torch.allclose(got, ref(x + bias + residual), atol=1e-5)
    inplace = x.clone()
    cpu_kernels.add_layernorm_f32(kernels, inplace, None, residual, w, b, 1e-12, out=inplace)
    assert torch.allclose(inplace, ref(x + residual), atol=1e-5)
    assert torch.allclose(cpu_kernels.add_layernorm_f32(kernels, x, None, None, w, b, 1e-12), ref(x),
                          atol=1e-5)
    assert not torch.allclose(cpu_kernels.add_layernorm_f32(kernels, x, bias, None, w, b, 1e-12),
                              ref(x + bias + residual), atol=1e-5)


def _moe_reference(x, weights, ids, w13, w2, expert_start):
    """The experts in float32 math: sum_j w[t, j] * down(silu(gate(x_t)) * up(x_t))."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j]) - expert_start
            if 0 <= e < w13.shape[0]:
                h = w13[e].float() @ x[t].float()
                act = F.silu(h[:inter]) * h[inter:]
                out[t] += weights[t, j] * (w2[e].float() @ act)
    return out


@pytest.mark.needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "hidden", "inter"), [(1, 64, 48), (7, 256, 96), (16, 96, 40)])
def test_fused_moe_matches_float32_math(fn, dtype, tokens, hidden, inter):
    """The fused experts on every build: 1-16 tokens (the 4/2/1-token tiles), sizes that are
    not whole vectors, an expert id outside the local range (an EP shard's other experts add
    nothing). Broken twin: routing weights swapped between a token's experts fails the same
    tolerance."""
    torch.manual_seed(8)
    experts, top_k, start = 4, 2, 1
    x = torch.randn(tokens, hidden).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter) / inter**0.5).to(dtype)
    ids = torch.randint(start, start + experts + 1, (tokens, top_k))  # start + experts: not local
    ids[:, 1] = (ids[:, 0] - start + 1) % experts + start  # two different experts per token
    weights = torch.rand(tokens, top_k)
    if dtype == torch.bfloat16:
        w13k, w2k = cpu_kernels.pack_moe_weights(fn, w13, w2)
    else:
        w13k, w2k = w13, w2
    got = cpu_kernels.fused_moe(fn, x, weights, ids, w13k, w2k, start, experts, inter)
    ref = _moe_reference(x, weights, ids, w13, w2, start)
    tol = (2.0**-5 if dtype == torch.bfloat16 else 1e-5) * (1 + ref.abs())
    assert ((got.float() - ref).abs() <= tol).all()
    swapped = _moe_reference(x, weights.flip(1), ids, w13, w2, start)
    assert not ((got.float() - swapped).abs() <= tol).all()


# /proc/cpuinfo flags of the AMD EPYC (Zen 3): AVX2 + FMA, no AVX-512.
_ZEN3_FLAGS = ("vendor_id\t: AuthenticAMD\nflags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c "
               "avx2 bmi1 bmi2 vaes vpclmulqdq\n")


def test_an_avx2_cpu_chooses_the_avx2_build_and_ingots_bf16_path(monkeypatch):
    """What an AVX2-only CPU (Zen 3) chooses: the avx2 build (portable beside it), bf16 models
    on ingot's packed linears (GEMV/GEMM over bf16 weights widened in registers) and its
    attention backend; float32 models on torch ops and oneDNN's packed float32 linears (not
    made by Intel). Broken twin: with INGOT_CPU_ISA capped to the portable build, that build is
    what loads."""
    from ingot.model_executor.binding import select_kernels
    from ingot.model_executor.layers.attention_backend import select_attention_backend

    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: _ZEN3_FLAGS)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.delenv("INGOT_CPU_ISA", raising=False)  # uncapped, whatever the shell set
    monkeypatch.delenv("INGOT_CPU_F32_GEMM", raising=False)
    assert cpu_kernels.cpu_isas() == ("avx2", "portable")
    assert cpu_kernels.f32_isas() == ("avx2", "portable")
    assert cpu_kernels.load_cpu_kernels().isa == "avx2"
    assert cpu_kernels.load_f32_kernels().isa == "avx2"
    assert cpu_kernels.gemm_preferred()  # no AMX
    cpu = torch.device("cpu")
    model = torch.nn.Linear(4, 4)
    assert select_kernels(model, torch.bfloat16, cpu).pack == "bf16"
    assert select_kernels(model, torch.float32, cpu).pack == "f32"
    backend = select_attention_backend(cpu, torch.bfloat16, torch.bfloat16, False, (9, 3, 64))
    assert backend.name == "cpu-kernels" and backend.kernels.isa == "avx2"
    assert select_attention_backend(cpu, torch.float32, torch.float32, False, (9, 3, 64)).name \
        == "torch"
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("INGOT_CPU_ISA", "portable")
    assert cpu_kernels.load_cpu_kernels().isa == "portable"


def test_isa_cap_rejects_an_unknown_build(monkeypatch):
    monkeypatch.setenv("INGOT_CPU_ISA", "avx3")
    with pytest.raises(ValueError, match="INGOT_CPU_ISA must be one of"):
        cpu_kernels.load_cpu_kernels()
