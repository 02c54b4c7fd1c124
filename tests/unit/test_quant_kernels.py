"""ingot's GGUF-quantized kernels (cpu_kernels_quant.c) against their float32 restatement: the
file's blocks dequantized as the ``gguf`` package does, activations quantized per 32 as the
kernel states (llama.cpp's Q8_1 scheme), and the kernel's accumulation order restated in numpy
float32, every operation rounded. The library is built without fused multiply-adds, so each build
must equal the restatement bit for bit; the result must also sit within the accumulation's
rounding bound of the float64 product of the dequantized operands. Broken twins (a block's scale
or min ignored, rows repacked out of order) must fail both checks.

Every kernel test runs each build of :data:`cpu_kernels.QUANT_ISAS` this CPU runs (the ``qk``
fixture, tests/kernel_builds.py); a build that does not load there fails, and each build the CPU
cannot run is counted by ``test_build_runs_here`` (test_cpu_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kernel_builds
from ingot.model_executor.layers import cpu_kernels

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize  # noqa: E402

QTYPES = tuple(cpu_kernels.QUANT_TYPES)


@pytest.fixture(params=kernel_builds.over("quant"))
def qk(request) -> cpu_kernels.QuantKernels:
    """Each build of the quantized library this CPU runs, in turn."""
    return kernel_builds.load("quant", request.param)


@pytest.mark.parametrize("isa", kernel_builds.over("quant"))
def test_each_build_runs_the_integer_dot_it_names(isa):
    """vpdpbusd where the build's CPU has VNNI, vpmaddubsw + vpmaddwd in a ``-novnni`` build
    (which a CPU with VNNI tests here for the CPUs without it), lane loops in "portable"."""
    base = isa.removesuffix(cpu_kernels.QUANT_NO_VNNI)
    vnni = cpu_kernels._QUANT_EXTRA[base][2]
    want = 0 if base == "portable" else 1 if isa != base or not cpu_kernels._cpu_has(vnni[0]) \
        else 2
    assert kernel_builds.load("quant", isa).dot_kind == want


def _ggml(qtype: str):  # noqa: ANN202
    return getattr(gguf.GGMLQuantizationType, qtype)


K_QUANTS = cpu_kernels.K_QUANTS
MIN_TYPES = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # w = d q + m
FIVE_BIT = ("Q5_0", "Q5_1", "Q5_K")
_SUPER_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _width(qtype: str, k: int) -> int:
    """K for a test of ``k`` weights a row: a K-quant's rows are whole 256-weight super-blocks."""
    return -(-k // 256) * 256 if qtype in K_QUANTS else k


def _weights(qtype: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """The file's bytes of random [n, k] weights (rows of different scales, one zero block).
    The gguf package quantizes the legacy types; it has no K-quant quantizer, so a K-quant's
    super-blocks are random bytes with f16 d and dmin of a row's scale (every 6-bit scale and
    min, every weight bit, is then a valid file's)."""
    rng = np.random.default_rng(seed)
    if qtype in K_QUANTS:
        size = _SUPER_BYTES[qtype]
        sb = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
        scale = rng.uniform(0.0005, 0.05, (n, 1, 2)) * rng.uniform(0.2, 2.0, (1, k // 256, 1))
        scale[0, 0] = 0.0  # d = dmin = 0: a super-block that contributes nothing
        halves = scale.astype(np.float16).view(np.uint8).reshape(n, k // 256, 4)
        if qtype == "Q6_K":  # its f16 d comes last (scales are int8, the weights 6-bit)
            sb[..., 208:210] = halves[..., 0:2]
        else:
            sb[..., 0:4] = halves
        return sb.reshape(n, -1)
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    w[0, :32] = 0.0  # d = 0 (and Q4_1's m = 0): a block that contributes nothing
    if k > 32 and n > 1:
        w[-1, 32:64] += 3.0  # Q4_1: a block far from zero, a large min
    return quantize(w, _ggml(qtype))


def _parts(raw: np.ndarray, qtype: str, n: int, k: int):  # noqa: ANN202
    """(q [N, K] int64 as stored: Q4 0..15, Q5 0..31, Q8_0 -128..127, Q6_K q - 32; d [N,
    K/32] float32, Q6_K [N, K/16]; m or None), restated from the file's layout (the K-quants:
    d = d * scale, m = -dmin * min, float32, per 32-weight sub-block; Q6_K per 16)."""
    if qtype == "Q6_K":
        sb = raw.reshape(n, k // 256, 210)
        ql = sb[..., :128].astype(np.int64).reshape(n, -1, 2, 1, 64)
        qh = sb[..., 128:192].astype(np.int64).reshape(n, -1, 2, 1, 32)
        low = (ql >> np.array([0, 4]).reshape(1, 1, 1, 2, 1)) & 15
        high = (qh >> np.array([0, 2, 4, 6]).reshape(1, 1, 1, 4, 1)) & 3
        q = low.reshape(n, -1, 8, 32) | (high.reshape(n, -1, 8, 32) << 4)
        sc = sb[..., 192:208].copy().view(np.int8).astype(np.float32)
        d = sb[..., 208:210].copy().view(np.float16).astype(np.float32)  # [n, S, 1]
        return q.reshape(n, k) - 32, (d * sc).reshape(n, -1), None
    if qtype in K_QUANTS:
        sb = raw.reshape(n, k // 256, _SUPER_BYTES[qtype])
        d = sb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = sb[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        a, b, c = sb[..., 4:8].astype(np.int64), sb[..., 8:12].astype(np.int64), \
            sb[..., 12:16].astype(np.int64)
        sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], -1).astype(np.float32)
        mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], -1).astype(np.float32)
        qs = sb[..., -128:].astype(np.int64).reshape(n, k // 256, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=3).reshape(n, k // 256, 8, 32)
        if qtype == "Q5_K":
            qh = sb[..., 16:48].astype(np.int64)
            q = q | (((qh[:, :, None, :] >> np.arange(8)[None, None, :, None]) & 1) << 4)
        return (q.reshape(n, k), (d[..., None] * sc).reshape(n, -1),
                -(dmin[..., None] * mn).reshape(n, -1))
    _, block_bytes, _ = cpu_kernels.QUANT_TYPES[qtype]
    blocks = raw.reshape(n, k // 32, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if qtype == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(n, k).astype(np.int64), d, None
    first = 2 + 2 * (qtype in MIN_TYPES) + 4 * (qtype in FIVE_BIT)
    qs = blocks[..., first:first + 16]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)
    if qtype in FIVE_BIT:
        qh = blocks[..., first - 4:first].copy().view(np.uint32).astype(np.int64)  # [n, nb, 1]
        q = q | (((qh >> np.arange(32)) & 1) << 4)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) \
        if qtype in MIN_TYPES else None
    return q.reshape(n, k), d, m


def _signed(q: np.ndarray, qtype: str) -> np.ndarray:
    return q - {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)  # Q4_0 stores q + 8, Q5_0 q + 16


def _dequantized(raw: np.ndarray, qtype: str, n: int, k: int) -> np.ndarray:
    q, d, m = _parts(raw, qtype, n, k)
    w = np.repeat(d, k // d.shape[1], axis=1) * _signed(q, qtype).astype(np.float32)
    return w + np.repeat(m, 32, axis=1) if m is not None else w


def _q8_1(x: np.ndarray):  # noqa: ANN202
    """The kernel's activation quantization restated: per block of 32, in float32."""
    rows, k = x.shape
    blocks = x.astype(np.float32).reshape(rows, k // 32, 32)
    amax = np.abs(blocks).max(axis=-1)
    d = amax / np.float32(127)
    inv = np.divide(np.float32(127), amax, out=np.zeros_like(amax), where=amax != 0)
    q = np.rint(blocks * inv[..., None]).astype(np.int64)  # nearest, ties to even
    total = q.sum(axis=-1)
    return q.reshape(rows, k), d, d * total.astype(np.float32), total


def _restated(raw: np.ndarray, qtype: str, n: int, k: int, x: np.ndarray,
              bias: np.ndarray | None = None) -> np.ndarray:
    """The kernel's stated float32 order: per block b (and, Q6_K, per 16 of it), acc = acc +
    (dw * dx) * isum, then (the types with a min) acc = acc + mw * sx; then + bias."""
    q, d, m = _parts(raw, qtype, n, k)
    xq, xd, xs, _ = _q8_1(x)
    nb, subs = k // 32, d.shape[1] // (k // 32)  # scales a block
    isum = np.einsum("nbj,mbj->mnb", _signed(q, qtype).reshape(n, nb * subs, 32 // subs),
                     xq.reshape(-1, nb * subs, 32 // subs))
    acc = np.zeros((x.shape[0], n), dtype=np.float32)
    for b in range(nb):
        for j in range(b * subs, (b + 1) * subs):
            p = d[None, :, j] * xd[:, None, b]
            acc = acc + p * isum[:, :, j].astype(np.float32)
        if m is not None:
            acc = acc + m[None, :, b] * xs[:, None, b]
    return acc + bias.astype(np.float32) if bias is not None else acc


def _within_accumulation_bound(y: np.ndarray, raw: np.ndarray, qtype: str, n: int, k: int,
                               x: np.ndarray) -> bool:
    """|y - W_deq (dx qx)| in float64 within the float32 accumulation's rounding bound: per
    block at most 3 roundings of its terms and 2 of the running sum, each 2^-24 relative."""
    q, d, m = _parts(raw, qtype, n, k)
    xq, xd, xs, _ = _q8_1(x)
    nb = k // 32
    ns = d.shape[1]  # scaled sums: a block's, or Q6_K's two a block
    x_deq = (np.repeat(xd, 32, axis=1) * xq).astype(np.float64)
    exact = x_deq @ _dequantized(raw, qtype, n, k).astype(np.float64).T
    terms = np.abs(np.einsum("nbj,mbj->mnb", _signed(q, qtype).reshape(n, ns, k // ns)
                             .astype(np.float64), xq.reshape(-1, ns, k // ns).astype(np.float64))
                   * d[None].astype(np.float64)
                   * np.repeat(xd, ns // nb, axis=1)[:, None].astype(np.float64)).sum(-1)
    if m is not None:
        terms = terms + np.abs(m[None].astype(np.float64) * xs[:, None].astype(np.float64)).sum(-1)
    return bool((np.abs(y.astype(np.float64) - exact) <= (3 + 2 * ns) * 2.0**-24 * terms).all())


def _run(qk, raw, qtype, n, k, x, bias=None, packed=None, threads=None):  # noqa: ANN001, ANN202
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k) if packed is None else packed
    b = None if bias is None else torch.from_numpy(bias)
    return cpu_kernels.quant_matmul(qk, torch.from_numpy(x), packed, qtype, n, b,
                                    out_dtype=torch.float32, threads=threads).numpy()


def _matches(y: np.ndarray, raw: np.ndarray, qtype: str, n: int, k: int, x: np.ndarray) -> bool:
    return np.array_equal(y, _restated(raw, qtype, n, k, x)) and \
        _within_accumulation_bound(y, raw, qtype, n, k, x)


# ---- the restatement itself -----------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_restatement_dequantizes_as_the_gguf_package(qtype):
    k = _width(qtype, 96)
    raw = _weights(qtype, 13, k)
    assert np.array_equal(_dequantized(raw, qtype, 13, k), dequantize(raw, _ggml(qtype)))


# ---- activations -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "k"), [(1, 32), (3, 96), (5, 576)])
def test_activation_quantization_equals_its_restatement(qk, dtype, m, k):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    x[0, :32] = 0  # amax 0: q, d, s all 0
    if k > 32:  # amax 127 -> scale 1: x * 1 lands on ties (2.5, -3.5, 0.5) that round to even
        x[-1, 32:64] = torch.tensor([127.0, 2.5, -3.5, 0.5] + [1.0] * 28)
    q, d, s, total = cpu_kernels.quantize_q8_1(qk, x)
    rq, rd, rs, rtotal = _q8_1(x.float().numpy())
    assert np.array_equal(q.numpy(), rq) and np.array_equal(total.numpy(), rtotal)
    assert np.array_equal(d.numpy(), rd) and np.array_equal(s.numpy(), rs)
    if k > 32:
        assert q[-1, 33:36].tolist() == [2, -4, 0]


# ---- the kernel ------------------------------------------------------------------------------

# (rows of x, weight rows, K): 8-row groups with tails, 4-row activation tiles with tails,
# one block and many
_SHAPES = [(1, 8, 32), (1, 37, 96), (2, 13, 576), (3, 1, 64), (4, 960, 576), (5, 17, 1536),
           (9, 24, 160), (1, 7, 32),
           # from QUANT_AMX_MIN_ROWS rows a build with AMX multiplies on its tiles: 16-row tiles
           # with tails, 32-row items with tails (odd group counts)
           (16, 8, 32), (17, 37, 96), (33, 13, 576), (40, 960, 576)]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("m", "n", "k"), _SHAPES)
def test_kernel_equals_its_float32_restatement(qk, qtype, m, n, k):
    k = _width(qtype, k)
    raw = _weights(qtype, n, k, seed=n + k)
    x = (np.random.default_rng(m).standard_normal((m, k)) * 3).astype(np.float32)
    y = _run(qk, raw, qtype, n, k, x)
    assert y.shape == (m, n)
    assert np.array_equal(y, _restated(raw, qtype, n, k, x))
    assert _within_accumulation_bound(y, raw, qtype, n, k, x)


@pytest.mark.parametrize("qtype", QTYPES)
def test_bias_and_bf16_in_and_out(qk, qtype):
    n, k = 19, _width(qtype, 96)
    raw = _weights(qtype, n, k)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    bias = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    y = cpu_kernels.quant_matmul(qk, x, packed, qtype, n, torch.from_numpy(bias))
    assert y.dtype == torch.bfloat16
    restated = torch.from_numpy(_restated(raw, qtype, n, k, x.float().numpy(), bias))
    assert torch.equal(y, restated.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("threads", [1, 2])
def test_batched_rows_equal_rows_alone_bit_for_bit(qk, qtype, threads):
    n, k = 45, _width(qtype, 192)
    raw = _weights(qtype, n, k, seed=7)
    # 21 rows: batched on AMX tiles where the build has them, alone on the integer dots
    x = np.random.default_rng(7).standard_normal((21, k)).astype(np.float32)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    batched = _run(qk, raw, qtype, n, k, x, packed=packed, threads=threads)
    for i in range(x.shape[0]):
        alone = _run(qk, raw, qtype, n, k, x[i:i + 1], packed=packed, threads=1)
        assert np.array_equal(batched[i:i + 1], alone)


@pytest.fixture(scope="module")
def default_model_tensors(default_gguf_path) -> list[tuple[str, int, np.ndarray]]:
    """(type, K, the file's bytes) of layer 0's Q4_1 q projection and of the first 512 rows of
    the Q8_0 embedding / LM head, read once (the reader parses the whole file)."""
    reader = gguf.GGUFReader(default_gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for name, rows in (("blk.0.attn_q.weight", None), ("token_embd.weight", 512)):
        t = tensors[name]
        raw = np.array(np.asarray(t.data).reshape(int(t.shape[1]), -1)[:rows])
        out.append((t.tensor_type.name, int(t.shape[0]), raw))
    return out


def test_the_default_models_own_tensors(qk, default_model_tensors):
    x = np.random.default_rng(0).standard_normal((2, 576)).astype(np.float32)
    assert [qtype for qtype, _, _ in default_model_tensors] == ["Q4_1", "Q8_0"]
    for qtype, k, raw in default_model_tensors:
        n = raw.shape[0]
        assert np.array_equal(_run(qk, raw, qtype, n, k, x), _restated(raw, qtype, n, k, x))


# ---- broken twins: each must fail the checks -------------------------------------------------

def _set_scale(packed: torch.Tensor, qtype: str, group: int, block: int, row: int,
               value: float, mins: bool = False) -> None:
    """Overwrite one row's scale (or min) in a packed (group, block): f16, float32 for the
    K-quants, as cpu_kernels_quant.c lays them out."""
    dtype = np.float32 if qtype in K_QUANTS else np.float16
    size = np.dtype(dtype).itemsize
    at = (8 * size if mins else 0) + size * row
    packed[group, block, at:at + size] = torch.from_numpy(
        np.array([value], dtype=dtype).view(np.uint8).copy())


def _twin_fails(qk, qtype: str, rows: int, seed: int, breaks) -> None:  # noqa: ANN001
    """The kernel matches its restatement on fresh packed weights, and no longer does once
    ``breaks(packed)`` has damaged them."""
    n, k = 16, _width(qtype, 96)
    raw = _weights(qtype, n, k, seed=seed)
    x = np.random.default_rng(seed).standard_normal((rows, k)).astype(np.float32)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    assert _matches(_run(qk, raw, qtype, n, k, x, packed=packed), raw, qtype, n, k, x)
    breaks(packed)
    assert not _matches(_run(qk, raw, qtype, n, k, x, packed=packed), raw, qtype, n, k, x)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows", [2, 20])  # 20: the AMX tiles where the build has them
def test_twin_with_a_blocks_scale_ignored_fails(qk, qtype, rows):
    # row 13, block 2: scale read as 1
    _twin_fails(qk, qtype, rows, 3, lambda packed: _set_scale(packed, qtype, 1, 2, 5, 1.0))


@pytest.mark.parametrize("qtype", (*MIN_TYPES, "Q6_K"))  # Q6_K: its second scale
@pytest.mark.parametrize("rows", [2, 20])
def test_twin_with_a_blocks_min_ignored_fails(qk, qtype, rows):
    # row 3, block 1: min dropped
    _twin_fails(qk, qtype, rows, 4,
                lambda packed: _set_scale(packed, qtype, 0, 1, 3, 0.0, mins=True))


@pytest.mark.parametrize("qtype", FIVE_BIT)
@pytest.mark.parametrize("rows", [2, 20])
def test_twin_with_the_fifth_bits_ignored_fails(qk, qtype, rows):
    at = (2 if qtype in MIN_TYPES else 1) * (32 if qtype in K_QUANTS else 16)
    # block 1 of every row: weights read as 4-bit
    _twin_fails(qk, qtype, rows, 8, lambda packed: packed[:, 1, at:at + 32].zero_())


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("swap", [(0, 1), (3, 11)])  # within a group, across groups
@pytest.mark.parametrize("rows", [2, 20])
def test_twin_with_rows_repacked_out_of_order_fails(qk, qtype, swap, rows):
    n, k = 16, _width(qtype, 64)
    raw = _weights(qtype, n, k, seed=5)
    x = np.random.default_rng(5).standard_normal((rows, k)).astype(np.float32)
    order = list(range(n))
    order[swap[0]], order[swap[1]] = order[swap[1]], order[swap[0]]
    packed = cpu_kernels.pack_quant_weight(raw[order], qtype, n, k)
    assert not _matches(_run(qk, raw, qtype, n, k, x, packed=packed), raw, qtype, n, k, x)


# ---- packing ---------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_packed_bytes_are_the_files_rearranged(qtype):
    n, k = 13, _width(qtype, 64)
    raw = _weights(qtype, n, k)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    groups = -(-n // cpu_kernels.QUANT_GROUP_ROWS)
    assert packed.shape == (groups, k // 32, cpu_kernels.QUANT_TYPES[qtype][2])
    # the same multiset of bytes as the file plus zero padding rows (nibbles regrouped for Q4)
    if qtype == "Q8_0":
        padding = (groups * 8 - n) * raw.shape[1]
        assert sorted(packed.flatten().tolist()) == sorted(raw.flatten().tolist() + [0] * padding)
    # the legacy types' bytes, rearranged; a K-quant's f16 d, dmin and 6-bit scales and mins
    # become float32 scale and min per 32 (Q4_K 18 -> 24 bytes per 32 weights, Q5_K 22 -> 28),
    # Q6_K's f16 d and int8 scale per 16 two float32 scales and its 6 bits one byte (26.25 -> 40)
    grown = {"Q4_K": 24 / 18, "Q5_K": 28 / 22, "Q6_K": 320 / 210}.get(qtype, 1)
    assert packed.numel() == pytest.approx(groups * 8 * raw.shape[1] * grown)


def test_pack_rejects_other_types_and_partial_blocks():
    with pytest.raises(ValueError, match="no quantized kernel for Q3_K"):
        cpu_kernels.pack_quant_weight(np.zeros((1, 110), np.uint8), "Q3_K", 1, 256)
    with pytest.raises(ValueError, match="not whole 32-weight blocks"):
        cpu_kernels.pack_quant_weight(np.zeros((1, 20), np.uint8), "Q4_1", 1, 48)
    with pytest.raises(ValueError, match="not whole 256-weight blocks"):
        cpu_kernels.pack_quant_weight(np.zeros((1, 72), np.uint8), "Q4_K", 1, 128)


def test_matmul_rejects_a_mismatched_width(qk):
    packed = cpu_kernels.pack_quant_weight(_weights("Q8_0", 8, 64), "Q8_0", 8, 64)
    with pytest.raises(ValueError, match="does not take 96-wide activations"):
        cpu_kernels.quant_matmul(qk, torch.zeros(1, 96), packed, "Q8_0", 8)


# ---- serving: the embedding lookup and fused linears' shards (layers/quantized.py) -----------

@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_from_packed_rows_equals_the_gguf_dequantization(qk, qtype, dtype):
    n, k = 21, _width(qtype, 96)  # a padded last group
    raw = _weights(qtype, n, k, seed=9)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    ids = torch.tensor([[0, 20, 7], [8, 8, 13]])
    want = torch.from_numpy(dequantize(raw, _ggml(qtype))).to(dtype)[ids]
    got = cpu_kernels.quant_dequantize_rows(qk, packed, qtype, ids, dtype)
    assert got.shape == (2, 3, k) and torch.equal(got, want)
    # Broken twin: the neighbouring row of the same group is another row's values.
    assert not torch.equal(
        cpu_kernels.quant_dequantize_rows(qk, packed, qtype, ids + 1, dtype)[0, 0], want[0, 0])
    with pytest.raises(IndexError, match=r"row ids must be in \[0, 24\)"):
        cpu_kernels.quant_dequantize_rows(qk, packed, qtype, torch.tensor([24]), dtype)


@pytest.mark.parametrize("qtype", QTYPES)
def test_fused_linear_packs_its_shards_in_row_order(qk, qtype):
    """Shards of 13 and 11 rows (not whole groups of 8), loaded in either order, pack into the
    weight of their concatenated rows: the linear's output equals the kernel on that weight."""
    from ingot.model_executor.layers.bindable import Kernels
    from ingot.model_executor.layers.linear import MergedLinear
    from ingot.model_executor.layers.quantized import QuantizedWeight

    k = _width(qtype, 64)
    shards = [_weights(qtype, 13, k, seed=1), _weights(qtype, 11, k, seed=2)]
    linear = MergedLinear(k, [13, 11])
    for i in (1, 0):
        linear.weight.weight_loader(
            linear.weight, QuantizedWeight(torch.from_numpy(shards[i]), qtype, k), i)
    assert linear.weight.numel() == 0  # the plain values are released at load
    assert linear.bind_kernels(Kernels(cpu=True))
    raw = np.concatenate(shards)
    x = np.random.default_rng(0).standard_normal((3, k)).astype(np.float32)
    assert np.array_equal(linear(torch.from_numpy(x)).numpy(), _restated(raw, qtype, 24, k, x))
    # Broken twin: the shards packed in the other order.
    swapped = np.concatenate(shards[::-1])
    assert not np.array_equal(linear(torch.from_numpy(x)).numpy(),
                              _restated(swapped, qtype, 24, k, x))


# ---- dequantize: the dense weight a prefill step runs on oneDNN where AMX makes that faster ----


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("n", "k"), [(16, 96), (13, 64), (960, 576)])  # 13: a padded group
def test_dequantize_equals_the_gguf_package(qk, qtype, n, k):
    """Every value is the ``gguf`` package's dequantization in float32, rounded once to bf16."""
    k = _width(qtype, k)
    raw = _weights(qtype, n, k, seed=6)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    want = torch.from_numpy(dequantize(raw, _ggml(qtype)).reshape(n, k).astype(np.float32))
    dense = cpu_kernels.quant_dequantize(qk, packed, qtype, n, torch.float32)
    assert torch.equal(dense, want)
    assert torch.equal(cpu_kernels.quant_dequantize(qk, packed, qtype, n, torch.bfloat16),
                       want.to(torch.bfloat16))


@pytest.mark.parametrize("qtype", QTYPES)
def test_twin_dequantize_with_a_blocks_scale_ignored_fails(qk, qtype):
    n, k = 16, _width(qtype, 96)
    raw = _weights(qtype, n, k, seed=7)
    packed = cpu_kernels.pack_quant_weight(raw, qtype, n, k)
    _set_scale(packed, qtype, 1, 2, 5, 1.0)  # row 13, block 2: scale read as 1
    want = torch.from_numpy(dequantize(raw, _ggml(qtype)).reshape(n, k).astype(np.float32))
    assert not torch.equal(cpu_kernels.quant_dequantize(qk, packed, qtype, n, torch.float32), want)


# ---- AMX tiles (the avx512 build, where the CPU has amx_int8) ---------------------------------

def test_amx_tiles_serve_many_rows_with_the_integer_dots_bits():
    """From QUANT_AMX_MIN_ROWS rows the avx512 build multiplies on AMX tiles: exact per-block
    integer sums scaled in the integer dots' float32 order, so every row's bits are the same
    on either path (and a batch's rows equal the rows alone). Off (INGOT_CPU_QUANT_AMX=off, or
    ``amx_setup(0)``), every row count runs the integer dots."""
    if not cpu_kernels._cpu_has("amx_tile", "amx_int8"):
        pytest.skip("this CPU has no AMX int8 tiles (amx_tile, amx_int8)")
    qk = kernel_builds.load("quant", "avx512")
    assert qk.amx, "the avx512 build on a CPU with AMX should have its tiles"
    try:
        for qtype in QTYPES:
            for m, n, k in [(16, 40, 96), (37, 100, 576)]:
                k = _width(qtype, k)
                raw = _weights(qtype, n, k, seed=m)
                x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
                qk.amx_setup(cpu_kernels.QUANT_AMX_MIN_ROWS)
                tiles = _run(qk, raw, qtype, n, k, x)
                qk.amx_setup(0)
                dots = _run(qk, raw, qtype, n, k, x)
                assert np.array_equal(tiles, dots) and _matches(tiles, raw, qtype, n, k, x)
    finally:
        qk.amx_setup(cpu_kernels.quant_amx_rows())


def test_amx_switch_takes_auto_and_off(monkeypatch):
    monkeypatch.setenv("INGOT_CPU_QUANT_AMX", "off")
    assert cpu_kernels.quant_amx_rows() == 0
    monkeypatch.setenv("INGOT_CPU_QUANT_AMX", "auto")
    assert cpu_kernels.quant_amx_rows() == cpu_kernels.QUANT_AMX_MIN_ROWS
    monkeypatch.setenv("INGOT_CPU_QUANT_AMX", "yes")
    with pytest.raises(ValueError, match="INGOT_CPU_QUANT_AMX must be auto or off"):
        cpu_kernels.quant_amx_rows()


# ---- tensor-parallel shards of a kept weight (layers/quantized.py) ----------------------------

@pytest.mark.parametrize("qtype", QTYPES)
def test_column_shards_are_whole_blocks_of_every_row(qk, qtype):
    """A row-parallel rank's shard of the blocks multiplies its half of the input: the two
    ranks' partial products add up to the whole weight's (the restated kernel per shard)."""
    from ingot.model_executor.layers.quantized import QuantizedWeight

    n, k = 16, _width(qtype, 128) * 2
    raw = _weights(qtype, n, k, seed=11)
    weight = QuantizedWeight(torch.from_numpy(raw), qtype, k)
    x = np.random.default_rng(11).standard_normal((3, k)).astype(np.float32)
    halves = [weight.column_shard(i, 2) for i in (0, 1)]
    assert [h.in_features for h in halves] == [k // 2, k // 2]
    for i, half in enumerate(halves):
        xs = x[:, i * k // 2:(i + 1) * k // 2]
        got = _run(qk, half.raw.numpy(), qtype, n, k // 2, xs)
        assert np.array_equal(got, _restated(half.raw.numpy(), qtype, n, k // 2, xs))
    whole = _dequantized(raw, qtype, n, k)
    parts = [_dequantized(h.raw.numpy(), qtype, n, k // 2) for h in halves]
    assert np.array_equal(np.concatenate(parts, axis=1), whole)
    # Broken twin: the shards in the other order are not the weight's columns.
    assert not np.array_equal(np.concatenate(parts[::-1], axis=1), whole)


def test_a_split_inside_a_block_is_refused():
    from ingot.model_executor.layers.quantized import QuantizedWeight

    weight = QuantizedWeight(torch.zeros(4, 3 * 18, dtype=torch.uint8), "Q4_0", 96)
    with pytest.raises(ValueError, match="do not split into 2 tensor-parallel shards of whole "
                                         "32-weight blocks; serve this model with "
                                         "--quantization none"):
        weight.column_shard(0, 2)
    k_quant = QuantizedWeight(torch.zeros(4, 2 * 144, dtype=torch.uint8), "Q4_K", 512)
    with pytest.raises(ValueError, match="whole 256-weight blocks"):
        k_quant.column_shard(0, 4)
