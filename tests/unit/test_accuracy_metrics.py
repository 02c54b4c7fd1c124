"""Accuracy toolkit metrics and logic on hand-computed inputs (no model)."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from ingot.accuracy.capture import expand_patterns, match_names
from ingot.accuracy.compare import compare_captures
from ingot.accuracy.kv_analysis import compare_kv, gather_paged_kv, scatter_paged_kv
from ingot.accuracy.logit_validation import (
    TokenStatus,
    aggregate,
    check_token,
    validate_prompt,
)
from ingot.accuracy.metrics import (
    allclose_error,
    bhattacharyya,
    cosine,
    error_ratio,
    l2_rel,
    linf_rel,
    module_gate,
    remove_shift,
    sigma_ratio,
    three_way,
    topk_errors,
    ulp_tolerance,
)

# ---- basic errors -----------------------------------------------------------------------------


def test_linf_and_l2_relative_hand_computed():
    ref = torch.tensor([3.0, 4.0])
    act = torch.tensor([3.0, 5.0])  # d = [0, 1]
    assert linf_rel(ref, act) == pytest.approx(1 / 4)  # max|d| / max|ref|
    assert l2_rel(ref, act) == pytest.approx(1 / 5)  # ||d|| / ||ref|| = 1 / 5


def test_zero_error_is_zero_even_for_a_zero_reference():
    ref = torch.tensor([3.0, -4.0])
    assert linf_rel(ref, ref.clone()) == 0.0
    assert l2_rel(ref, ref.clone()) == 0.0
    zero = torch.zeros(3)
    assert linf_rel(zero, zero) == 0.0 and l2_rel(zero, zero) == 0.0
    assert linf_rel(zero, torch.tensor([0.0, 1.0, 0.0])) == math.inf


def test_error_ratio_edge_cases():
    assert error_ratio(2.0, 1.0) == 2.0
    assert error_ratio(0.0, 0.0) == 1.0  # as good as the dtype allows
    assert error_ratio(1e-3, 0.0) == math.inf
    assert math.isnan(error_ratio(math.nan, 1.0))


def test_cosine():
    assert cosine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0])) == pytest.approx(0.0)
    assert cosine(torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0])) == pytest.approx(1.0)
    assert cosine(torch.zeros(2), torch.zeros(2)) == 1.0


# ---- sigma-ratio and BC -----------------------------------------------------------------------


def test_sigma_ratio_hand_computed_and_edges():
    base = torch.tensor([1.0, -1.0, 1.0, -1.0])  # RMS 1
    target = torch.tensor([2.0, 2.0, -2.0, -2.0])  # RMS 2
    assert sigma_ratio(base, target) == pytest.approx(2.0)
    assert sigma_ratio(target, base) == pytest.approx(0.5)
    assert sigma_ratio(base, base) == 1.0
    assert sigma_ratio(torch.zeros(4), torch.zeros(4)) == 1.0  # both exact
    assert sigma_ratio(torch.zeros(4), target) == math.inf  # exact base, noisy target
    assert sigma_ratio(torch.zeros(4), torch.zeros(4)) <= 1.0  # passes the criterion
    assert math.isnan(sigma_ratio(base, torch.tensor([math.nan, 0.0, 0.0, 0.0])))


def test_bhattacharyya_hand_computed():
    # 2 bins over the shared range [0, 1]: p = [1/2, 1/2], q = [0, 1] -> sqrt(1/2 * 1)
    assert bhattacharyya([0.0, 1.0], [1.0, 1.0], bins=2) == pytest.approx(math.sqrt(0.5))
    # disjoint histograms
    assert bhattacharyya([0.0, 0.0], [1.0, 1.0], bins=2) == pytest.approx(0.0)
    # identical distributions; the sign of an error does not matter (|errors|)
    assert bhattacharyya([-1.0, 0.5, 2.0], [1.0, -0.5, 2.0]) == pytest.approx(1.0)


def test_bhattacharyya_edge_cases():
    # All-zero errors on both sides: np.histogram cannot bin an empty range; defined as 1.
    assert bhattacharyya(torch.zeros(10), torch.zeros(10)) == 1.0
    # Every value equal (non-zero) on both sides: the same point mass.
    assert bhattacharyya(torch.full((5,), 0.3), torch.full((3,), -0.3)) == 1.0
    # One side all zero, the other not: a normal histogram, far apart.
    assert bhattacharyya(torch.zeros(4), torch.ones(4), bins=2) == pytest.approx(0.0)
    # NaN / inf errors never look like noise.
    assert bhattacharyya(torch.zeros(4), torch.tensor([0.0, math.nan, 0.0, 0.0])) == 0.0
    assert bhattacharyya(torch.tensor([math.inf]), torch.zeros(1)) == 0.0
    with pytest.raises(ValueError):
        bhattacharyya(torch.zeros(0), torch.zeros(3))


def test_bhattacharyya_reads_noise_scale():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(50_000, generator=g)
    same = torch.randn(50_000, generator=g)
    assert bhattacharyya(a, same) > 0.99
    assert bhattacharyya(a, 3 * same) < 0.95


def test_three_way_and_identical_inputs():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    exp = base + torch.tensor([0.1, -0.1, 0.1, -0.1])
    r = three_way(base, exp, exp.clone())
    assert r.l2_ratio == pytest.approx(1.0) and r.linf_ratio == pytest.approx(1.0)
    assert r.bc == pytest.approx(1.0) and r.sigma_ratio == pytest.approx(1.0)
    r2 = three_way(base, exp, base + 2 * (exp - base))
    assert r2.l2_ratio == pytest.approx(2.0) and r2.sigma_ratio == pytest.approx(2.0)


# ---- allclose, shift, top-k, ULP ---------------------------------------------------------------


def test_allclose_error_uses_the_global_max_of_expected():
    e = torch.tensor([1.0, 2.0])
    a = torch.tensor([1.0, 2.1])
    assert allclose_error(a, e, atol=0.0) == pytest.approx(0.1 / 2)
    assert allclose_error(a, e, atol=0.1) == pytest.approx(0.0, abs=1e-6)


def test_remove_shift_subtracts_only_the_shift():
    e = torch.tensor([1.0, 2.0, 5.0, -3.0])
    assert torch.allclose(remove_shift(e + 3.0, e), e.double())
    # slope 2, shift 1: only the 1 goes
    assert torch.allclose(remove_shift(2 * e + 1.0, e), (2 * e).double())
    # a constant expected has no slope to fit: the means are aligned
    c = torch.full((3,), 7.0)
    assert torch.allclose(
        remove_shift(torch.tensor([1.0, 2.0, 3.0]), c), torch.tensor([6.0, 7.0, 8.0]).double()
    )


def test_ulp_tolerance():
    assert ulp_tolerance(19.0, 7) == 0.125  # one bf16 step at a logit of 19
    assert ulp_tolerance(-19.0, 7, n_ulps=2) == 0.25
    assert ulp_tolerance(19.0, 23) == 2.0 ** (4 - 23)
    assert ulp_tolerance(0.0, 7) == 0.0


def _logits(seed: int = 0, vocab: int = 2000) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(vocab, generator=g) * 3
    x[7] = 19.0  # a clear top-1
    return x


def test_topk_constant_shift_passes():
    e = _logits()
    res = topk_errors(remove_shift(e + 4.0, e), e)
    assert all(v["passed"] for v in res.values())
    assert res["5"]["error"] <= 0.0


def test_topk_five_percent_on_top5_fails_k5():
    e = _logits()
    a = e.clone()
    top5 = torch.topk(e, 5).indices
    a[top5] *= 1.05
    res = topk_errors(remove_shift(a, e), e)
    assert not res["5"]["passed"]


def test_topk_drops_masked_entries():
    e = _logits()
    a = e.clone()
    a[100] = -math.inf
    e2 = e.clone()
    e2[200] = -math.inf
    res = topk_errors(a, e2)
    assert all(v["passed"] for v in res.values())


# ---- per-token checks (spec §2 test (c)) -------------------------------------------------------


def test_token_matched_and_constant_shift():
    e = _logits()
    r, _, _ = check_token(e + 2.5, e, reference_token=7)
    assert r.status == TokenStatus.MATCHED and r.passed


def test_top2_swap_within_one_ulp_is_acceptable():
    e = _logits()
    e[8] = 19.0 - 0.1  # runner-up 0.1 below: under one bf16 ULP (0.125) at 19
    a = e.clone()
    a[8] = 19.0 + 0.05  # the target flips the near-tie
    r, _, _ = check_token(a, e, reference_token=7, mantissa_bits=7)
    assert r.status == TokenStatus.ACCEPTABLE_DIVERGENCE
    assert r.divergence_gap == pytest.approx(0.05, abs=1e-5) and r.divergence_tol == 0.125
    assert r.passed


def test_swap_beyond_the_ulp_diverges():
    e = _logits()
    a = e.clone()
    a[8] = 25.0
    r, _, _ = check_token(a, e, reference_token=7, mantissa_bits=7)
    assert r.status == TokenStatus.DIVERGED and not r.passed


def test_nan_fails():
    e = _logits()
    a = e.clone()
    a[3] = math.nan
    r, _, _ = check_token(a, e, reference_token=7)
    assert r.status == TokenStatus.NAN and not r.passed


# ---- the teacher-forcing loop (spec §2 test (d)) ----------------------------------------------


def _reference(num: int = 6, vocab: int = 50) -> tuple[torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(num, vocab, generator=g)
    tokens = [10 + i for i in range(num)]
    for i, t in enumerate(tokens):
        logits[i, t] = 10.0
    return logits, tokens


def test_flip_at_token_3_triggers_one_reprompt():
    baseline, ref_tokens = _reference()
    prompt = [1, 2, 3]
    calls: list[tuple[list[int], int]] = []

    def generate(input_ids: list[int], n: int):
        calls.append((list(input_ids), n))
        start = len(input_ids) - len(prompt)
        logits = baseline[start : start + n].clone()
        if start == 0:
            logits[3, 40] = 20.0  # the first run picks token 40 at index 3
        return logits, logits.argmax(-1).tolist()

    res = validate_prompt(prompt, generate, baseline, ref_tokens, mantissa_bits=7)
    assert res.calls == 2
    assert calls[0] == (prompt, 6)
    assert calls[1] == (prompt + ref_tokens[:4], 2)  # re-prompted with the *reference* tokens
    assert res.run_starts == [0, 4]
    assert res.divergence_index == 3
    assert [t.status for t in res.tokens][:4] == [TokenStatus.MATCHED] * 3 + [TokenStatus.DIVERGED]
    assert [t.phase for t in res.tokens] == ["prefill"] + ["decode"] * 3 + ["prefill", "decode"]
    assert len(res.tokens) == 6 and not res.passed_two_way


def test_nan_stops_the_loop():
    baseline, ref_tokens = _reference()

    def generate(input_ids: list[int], n: int):
        logits = baseline[:n].clone()
        logits[1, 0] = math.nan
        return logits, None

    res = validate_prompt([1], generate, baseline, ref_tokens)
    assert res.nan and len(res.tokens) == 2 and res.calls == 1
    assert not aggregate([res], three_way=False).passed


def _noisy(baseline: torch.Tensor, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return baseline + scale * torch.randn(baseline.shape, generator=g)


def test_three_way_verdict_noise_passes_and_bug_fails():
    vocab, num = 4000, 4
    g = torch.Generator().manual_seed(5)
    base_logits = [torch.randn(num, vocab, generator=g) * 3 for _ in range(3)]
    for b in base_logits:
        b[:, 0] = 30.0  # token 0 wins everywhere by far: no divergence
    expected = [_noisy(b, 0.2, 100 + i) for i, b in enumerate(base_logits)]

    def run(scale: float) -> object:
        results = []
        for i, b in enumerate(base_logits):
            target = _noisy(b, scale, 200 + i)
            results.append(
                validate_prompt(
                    [1], lambda ids, n, t=target: (t[len(ids) - 1 :], None), b, None, expected[i]
                )
            )
        return aggregate(results, three_way=True)

    same = run(0.2)  # same noise level as the dtype: pass by BC
    assert same.passed and same.criteria["bc"]
    assert not same.criteria["two_way"]  # the static thresholds alone would fail this noise
    bug = run(0.6)  # 3x the dtype noise
    assert not bug.passed
    assert bug.sigma_ratio == pytest.approx(3.0, rel=0.05) and bug.bc_min < 0.9


def test_two_way_verdict():
    baseline, ref_tokens = _reference()
    ok = validate_prompt([1], lambda ids, n: (baseline[len(ids) - 1 :][:n] + 1.0, None), baseline)
    assert aggregate([ok], three_way=False).passed


# ---- module test gate (spec §7) ---------------------------------------------------------------


def test_module_gate_pools_seeded_inputs():
    g = torch.Generator().manual_seed(0)
    fp32 = [torch.randn(64, 32, generator=g) for _ in range(10)]
    dtype_out = [x + 0.01 * torch.randn(x.shape, generator=g) for x in fp32]
    good = [x + 0.01 * torch.randn(x.shape, generator=g) for x in fp32]
    bad = [x * 1.05 for x in fp32]
    assert module_gate(fp32, dtype_out, good).passed
    r = module_gate(fp32, dtype_out, bad)
    assert not r.passed and r.worst_l2_ratio > 3.0


# ---- capture patterns -------------------------------------------------------------------------


def test_expand_patterns_layer_range():
    assert expand_patterns(["model.layers.0-2", "lm_head"]) == [
        "model.layers.0",
        "model.layers.1",
        "model.layers.2",
        "lm_head",
    ]
    with pytest.raises(ValueError):
        expand_patterns(["model.layers.3-1"])


def test_glob_semantics():
    names = [
        "model.embed_tokens",
        "model.layers.0",
        "model.layers.0.mlp",
        "model.layers.0.mlp.down_proj",
        "model.layers.12.mlp",
    ]
    assert match_names(names, ["model.layers.*"]) == ["model.layers.0"]
    assert match_names(names, ["model.layers.*.mlp"]) == [
        "model.layers.0.mlp",
        "model.layers.12.mlp",
    ]
    assert match_names(names, ["model.layers.0.**"]) == [
        "model.layers.0.mlp",
        "model.layers.0.mlp.down_proj",
    ]
    assert match_names(names, ["model.layers.1?.mlp"]) == ["model.layers.12.mlp"]


# ---- KV reconstruction ------------------------------------------------------------------------


def test_paged_kv_round_trip_through_shuffled_blocks():
    g = torch.Generator().manual_seed(0)
    seq, heads, dim, bs = 23, 2, 8, 4
    k, v = torch.randn(seq, heads, dim, generator=g), torch.randn(seq, heads, dim, generator=g)
    cache = torch.zeros(2, 16, bs, heads, dim)
    blocks = list(range(1, 16))
    random.Random(0).shuffle(blocks)
    blocks = blocks[:6]
    scatter_paged_kv(cache, blocks, k, v)
    k2, v2 = gather_paged_kv(cache, blocks, seq)
    assert torch.equal(k2, k) and torch.equal(v2, v)
    with pytest.raises(ValueError):
        gather_paged_kv(cache, blocks[:2], seq)
    # A wrong block table reads other positions: errors of order one.
    wrong = compare_kv([gather_paged_kv(cache, blocks[::-1], seq)], [(k, v)])[0]
    assert wrong.k_max_abs > 0.5 and wrong.k_cos < 0.5
    right = compare_kv([(k2, v2)], [(k, v)])[0]
    assert right.k_max_abs == 0.0 and right.k_cos == pytest.approx(1.0)


def test_compare_kv_rejects_shape_mismatch():
    a = [(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8))]
    b = [(torch.zeros(4, 3, 8), torch.zeros(4, 3, 8))]
    with pytest.raises(ValueError):
        compare_kv(a, b)
    with pytest.raises(ValueError):
        compare_kv(a, a + a)


# ---- tensor compare on hand-made captures -----------------------------------------------------

MODULES = [
    "model.embed_tokens",
    "model.layers.0.mlp",
    "model.layers.0",
    "model.layers.1.mlp",
    "model.layers.1",
]


def _write_capture(root, source, steps, modules=MODULES):
    """steps: [(phase, positions, input_ids, {module: tensor})] in the documented layout."""
    root.mkdir(parents=True)
    dirs = []
    for i, (phase, positions, ids, tensors) in enumerate(steps):
        d = f"step_{i:04d}_{phase}"
        (root / d).mkdir()
        meta_modules = {}
        for name, t in tensors.items():
            torch.save(t, root / d / f"{name}.pt")
            meta_modules[name] = {"file": f"{name}.pt", "dtype": "float32", "shape": list(t.shape)}
        meta = {
            "step": i, "phase": phase, "num_real_tokens": len(positions), "num_padded_tokens": len(positions),
            "positions": positions, "input_ids": ids, "req_ids": ["r"] * len(positions), "modules": meta_modules,
        }  # fmt: skip
        (root / d / "meta.json").write_text(json.dumps(meta))
        dirs.append(d)
    index = {
        "format_version": 1,
        "source": source,
        "patterns": [],
        "modules": modules,
        "steps": dirs,
        "metadata": {},
    }
    (root / "index.json").write_text(json.dumps(index))
    return root


def _hidden(seed: int, rows: int = 6, dim: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {m: torch.randn(rows, dim, generator=g) for m in MODULES}


def _as_steps(tensors, ids, decode_order=(4, 5)):
    """Prefill of positions 0-3 then decode steps for the given positions (any order)."""
    steps = [("prefill", [0, 1, 2, 3], ids[:4], {m: t[:4] for m, t in tensors.items()})]
    for p in decode_order:
        steps.append(("decode", [p], [ids[p]], {m: t[p : p + 1] for m, t in tensors.items()}))
    return steps


def _noise(tensors, scale, seed):
    g = torch.Generator().manual_seed(seed)
    return {m: t + scale * torch.randn(t.shape, generator=g) for m, t in tensors.items()}


def test_identical_captures_give_ratio_one_and_bc_one(tmp_path):
    ids = [5, 6, 7, 8, 9, 10]
    base = _hidden(0)
    exp = _noise(base, 1e-2, 1)
    hf = _write_capture(tmp_path / "hf", "hf", [("prefill", list(range(6)), ids, base)])
    hfd = _write_capture(tmp_path / "hfd", "hfd", [("prefill", list(range(6)), ids, exp)])
    tgt = _write_capture(tmp_path / "ingot", "ingot", _as_steps(exp, ids, decode_order=(5, 4)))
    rep = compare_captures(hf, tgt, hfd)
    assert rep.passed and rep.first_failure is None and rep.compared_positions == 6
    for m in rep.modules:
        for c in m.phases.values():
            assert c.l2_ratio == pytest.approx(1.0) and c.bc == pytest.approx(1.0)
    assert set(rep.modules[0].phases) == {"prefill", "decode"}
    assert rep.modules[0].phases["decode"].num_rows == 2  # out-of-order decode steps align


def test_injected_error_names_the_first_failing_module(tmp_path):
    ids = [5, 6, 7, 8, 9, 10]
    base = _hidden(0)
    exp = _noise(base, 1e-3, 1)
    tgt = _noise(base, 1e-3, 2)
    tgt["model.layers.1.mlp"] = tgt["model.layers.1.mlp"] * 1.01
    tgt["model.layers.1"] = tgt["model.layers.1"] * 1.01
    hf = _write_capture(tmp_path / "hf", "hf", [("prefill", list(range(6)), ids, base)])
    hfd = _write_capture(tmp_path / "hfd", "hfd", [("prefill", list(range(6)), ids, exp)])
    ing = _write_capture(tmp_path / "ingot", "ingot", _as_steps(tgt, ids))
    rep = compare_captures(hf, ing, hfd)
    assert not rep.passed
    assert rep.first_failure.name == "model.layers.1.mlp"
    for name in MODULES[:3]:
        assert rep.module(name).passed
    assert "FAIL (first)" in rep.table()
    out = tmp_path / "cmp.json"
    rep.write_json(out)
    assert json.loads(out.read_text())["first_failure"] == "model.layers.1.mlp"


def test_rows_after_ingot_leaves_the_reference_are_not_compared(tmp_path):
    ids = [5, 6, 7, 8, 9, 10]
    base = _hidden(0)
    tgt = {m: t.clone() for m, t in base.items()}
    for m in tgt:
        tgt[m][5] += 100.0  # garbage after the divergence
    other = ids[:5] + [99]  # ingot was fed another token at position 5
    hf = _write_capture(tmp_path / "hf", "hf", [("prefill", list(range(6)), ids, base)])
    ing = _write_capture(tmp_path / "ingot", "ingot", _as_steps(tgt, other))
    rep = compare_captures(hf, ing, max_l2_rel=1e-6)
    assert rep.passed and rep.first_mismatch_position == 5 and rep.compared_positions == 5
