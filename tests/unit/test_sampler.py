"""Unit tests for the batched sampler (hand-built logits, small vocab)."""

from __future__ import annotations

import math

import pytest
import torch

from ingot.model_executor.layers.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    make_padded_token_tensor,
)
from ingot.sampling_params import SamplingParams

V = 50
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


def make_meta(
    params: list[SamplingParams],
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    vocab_size: int = V,
    device: str = "cpu",
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.from_params(
        params,
        outputs if outputs is not None else [[] for _ in range(n)],
        prompts if prompts is not None else [[] for _ in range(n)],
        generators or {},
        vocab_size,
        torch.device(device),
    )


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return Sampler()(logits, meta).sampled_token_ids.cpu()


def peaked_logits(batch: int, top: int, vocab: int = V) -> torch.Tensor:
    """Logits whose argmax is ``top`` but which leave plenty of mass elsewhere."""
    logits = torch.zeros(batch, vocab)
    logits[:, top] = 1.0
    return logits


# ---------------------------------------------------------------------------------------------
# Metadata
# ---------------------------------------------------------------------------------------------


def test_from_params_defaults_leave_knobs_off() -> None:
    meta = make_meta([SamplingParams(), SamplingParams(temperature=0.0)])
    assert meta.top_k is None and meta.top_p is None and meta.min_p is None
    assert meta.no_penalties and meta.prompt_token_ids is None
    assert meta.max_num_logprobs is None
    assert not meta.all_greedy and not meta.all_random
    assert meta.min_tokens == {}
    assert meta.temperature.dtype == torch.float32


def test_from_params_fills_tensors() -> None:
    params = [
        SamplingParams(top_k=-1, logprobs=2),
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1, logprobs=4, repetition_penalty=1.1),
    ]
    meta = make_meta(params, prompts=[[1, 2, 3], [4]])
    assert meta.top_k is not None and meta.top_k.tolist() == [0, 5]
    assert meta.top_k.dtype == torch.int64
    assert meta.top_p is not None and meta.top_p.tolist() == pytest.approx([1.0, 0.5])
    assert meta.min_p is not None and meta.min_p.tolist() == pytest.approx([0.0, 0.1])
    assert meta.max_num_logprobs == 4
    assert meta.all_random and not meta.all_greedy
    assert not meta.no_penalties
    assert meta.prompt_token_ids is not None
    assert meta.prompt_token_ids.tolist() == [[1, 2, 3], [4, V, V]]


def test_from_params_min_tokens_only_while_short() -> None:
    p = SamplingParams(min_tokens=3, stop_token_ids=[7])
    p.all_stop_token_ids.add(9)  # what the engine does for eos
    meta = make_meta([p, p.clone(), SamplingParams()], outputs=[[1], [1, 2, 3], []])
    assert meta.min_tokens == {0: (3, {7, 9})}


def test_make_padded_token_tensor() -> None:
    t = make_padded_token_tensor([[1, 2], [], [3, 4, 5]], 99, "cpu")
    assert t.tolist() == [[1, 2, 99], [99, 99, 99], [3, 4, 5]]
    assert make_padded_token_tensor([[], []], 7, "cpu").tolist() == [[7], [7]]


# ---------------------------------------------------------------------------------------------
# Greedy / temperature
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, V, device=device)
    meta = make_meta([SamplingParams(temperature=0.0)] * 8, device=device)
    assert meta.all_greedy
    out = Sampler()(logits, meta)
    assert out.logprobs_tensors is None
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids.device.type == device
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_accepts_half_precision_and_leaves_input_alone() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, presence_penalty=1.0, min_p=0.5)] * 4
    meta = make_meta(params, outputs=[[1], [2], [3], [4]])
    Sampler()(logits, meta)
    assert torch.equal(logits, before)  # float32 input must not be modified in place
    out = sample(logits.to(torch.bfloat16), make_meta([SamplingParams(temperature=0.0)] * 4))
    assert torch.equal(out, logits.to(torch.bfloat16).argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_and_random_rows_mixed(device: str) -> None:
    torch.manual_seed(0)
    n = 256
    logits = peaked_logits(n, top=17).to(device)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(n)]
    meta = make_meta(params, device=device)
    assert not meta.all_greedy and not meta.all_random
    out = sample(logits, meta)
    assert (out[0::2] == 17).all()
    # Token 17 has prob e/(e+49) ~ 5%: random rows must mostly pick something else.
    random_rows = out[1::2]
    assert (random_rows != 17).sum() > 100
    assert len(set(random_rows.tolist())) > 20


def test_low_temperature_concentrates_on_argmax() -> None:
    torch.manual_seed(0)
    logits = peaked_logits(200, top=3)
    for first in (0.01, 0.0):  # all-random batch, and one with a greedy row in it
        params = [SamplingParams(temperature=first)] + [SamplingParams(temperature=0.01)] * 199
        assert (sample(logits, make_meta(params)) == 3).all()


# ---------------------------------------------------------------------------------------------
# top-k / top-p / min-p
# ---------------------------------------------------------------------------------------------


def test_top_k_1_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    out = sample(logits, make_meta([SamplingParams(temperature=1.5, top_k=1)] * 64))
    assert torch.equal(out, logits.argmax(-1))


def test_top_k_samples_only_from_top_k() -> None:
    torch.manual_seed(0)
    base = torch.randn(V)
    logits = base.expand(2000, V).clone()
    out = sample(logits, make_meta([SamplingParams(top_k=4)] * 2000))
    allowed = set(base.topk(4).indices.tolist())
    assert set(out.tolist()) == allowed


def test_top_p_small_keeps_only_top_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(64, V)
    for top_p in (1e-3, 1e-8):  # 1 - 1e-8 rounds to 1.0 in float32: the top must survive
        out = sample(logits, make_meta([SamplingParams(top_p=top_p)] * 64))
        assert torch.equal(out, logits.argmax(-1))


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3], [0.1, 0.4, 0.2, 0.3]])
    logits = probs.log()
    out = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.5, 0.75, 0.35]))
    kept = torch.isfinite(out)
    # 0.5: {0.4, 0.3} (0.4 alone < 0.5); 0.75: {0.4, 0.3, 0.2}; 0.35: {0.4}
    assert kept.tolist() == [
        [False, True, False, True],
        [False, True, True, True],
        [False, True, False, False],
    ]
    assert torch.equal(out[kept], logits[kept])


def test_top_k_then_top_p_renormalises() -> None:
    # top-k=2 leaves {0.4, 0.3} -> renormalised 0.571/0.429, so top_p=0.5 keeps just the top.
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    out = apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.5]))
    assert torch.isfinite(out).tolist() == [[False, True, False, False]]


def test_disabled_knobs_leave_rows_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    logits[0, 5] = -200.0  # a zero-probability (underflowing) token that top_p=1.0 must not drop
    out = apply_top_k_top_p(logits.clone(), torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert torch.equal(out[0], logits[0])
    assert torch.isfinite(out[1]).sum() == 3
    assert torch.isfinite(out[2]).sum() < V
    out = apply_min_p(logits.clone(), torch.tensor([0.0, 0.5, 0.0]))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert torch.isfinite(out[1]).sum() < V


def test_min_p_filters_low_probability_tokens() -> None:
    torch.manual_seed(0)
    n = 3000
    logits = torch.full((n, V), -2.0)
    logits[:, :3] = 0.0  # other tokens have e^-2 ~ 0.135 x the max prob
    out = sample(logits, make_meta([SamplingParams(min_p=0.2)] * n))
    assert set(out.tolist()) == {0, 1, 2}
    # Control: without min_p most draws (~68%) land outside the top three.
    out = sample(logits, make_meta([SamplingParams()] * n))
    assert (out >= 3).sum() > n // 2


# ---------------------------------------------------------------------------------------------
# Seeds and distribution
# ---------------------------------------------------------------------------------------------


def _seeded_run(position: int, neighbours: list[SamplingParams], seed: int, device: str):
    """Five decode steps of one seeded request placed at ``position`` among ``neighbours``."""
    params = list(neighbours)
    params.insert(position, SamplingParams(seed=seed, top_k=30))
    gen = torch.Generator(device=device).manual_seed(seed)
    generators = {position: gen}
    for i, p in enumerate(params):
        if p.seed is not None and i != position:
            generators[i] = torch.Generator(device=device).manual_seed(p.seed)
    logits = torch.linspace(0, 1, V, device=device).expand(len(params), V).contiguous()
    tokens = []
    for _ in range(5):
        meta = make_meta(params, generators=generators, device=device)
        tokens.append(sample(logits, meta)[position].item())
    return tokens


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_rows_reproduce_regardless_of_batch(device: str) -> None:
    torch.manual_seed(123)
    alone = _seeded_run(0, [], seed=42, device=device)
    torch.manual_seed(7)  # different global RNG state for the unseeded neighbours
    crowded = _seeded_run(
        2,
        [
            SamplingParams(),
            SamplingParams(temperature=0.0),
            SamplingParams(seed=5),
            SamplingParams(top_p=0.3),
        ],
        seed=42,
        device=device,
    )
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples
    other_seed = _seeded_run(0, [], seed=43, device=device)
    assert other_seed != alone


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_random_sampling_matches_softmax(temperature: float) -> None:
    torch.manual_seed(0)
    vocab, n = 10, 40_000
    base = torch.linspace(-1.0, 1.5, vocab)
    logits = base.expand(n, vocab).contiguous()
    out = sample(logits, make_meta([SamplingParams(temperature=temperature)] * n, vocab_size=vocab))
    counts = torch.bincount(out, minlength=vocab).double()
    probs = (base / temperature).softmax(-1).double()
    # df = 9; the 99.9% quantile is ~27.9.
    assert _chi_square(counts, probs) < 27.9


def test_top_k_distribution_is_renormalised() -> None:
    torch.manual_seed(1)
    vocab, n = 10, 40_000
    base = torch.linspace(-1.0, 1.5, vocab)
    logits = base.expand(n, vocab).contiguous()
    out = sample(logits, make_meta([SamplingParams(top_k=3)] * n, vocab_size=vocab))
    counts = torch.bincount(out, minlength=vocab).double()
    assert counts[:-3].sum() == 0
    probs = base[-3:].softmax(-1).double()
    assert _chi_square(counts[-3:], probs) < 13.8  # df = 2, 99.9%


# ---------------------------------------------------------------------------------------------
# Penalties and min_tokens
# ---------------------------------------------------------------------------------------------


def test_apply_penalties_matches_formulas() -> None:
    torch.manual_seed(0)
    vocab = 12
    logits = torch.randn(3, vocab) * 3
    prompts = [[1, 2, 2, 3], [], [4]]
    outputs = [[3, 5, 5, 5], [6, 0], []]
    presence = [0.5, -0.3, 1.0]
    frequency = [0.2, 1.0, 0.0]
    repetition = [1.3, 0.8, 2.0]

    expected = logits.clone()
    for b in range(3):
        for t in range(vocab):
            x = expected[b, t].item()
            if t in prompts[b] or t in outputs[b]:
                x = x / repetition[b] if x > 0 else x * repetition[b]
            count = outputs[b].count(t)
            x -= frequency[b] * count
            x -= presence[b] * (count > 0)
            expected[b, t] = x

    got = apply_penalties(
        logits.clone(),
        make_padded_token_tensor(prompts, vocab, "cpu"),
        make_padded_token_tensor(outputs, vocab, "cpu"),
        torch.tensor(presence),
        torch.tensor(frequency),
        torch.tensor(repetition),
    )
    torch.testing.assert_close(got, expected)


def _flip_logits(top: float, second: float) -> torch.Tensor:
    logits = torch.full((1, V), -10.0)
    logits[0, 5] = top
    logits[0, 7] = second
    return logits


@pytest.mark.parametrize(
    ("kwargs", "prompt", "output", "logits", "expected"),
    [
        ({}, [5], [5, 5], _flip_logits(2.0, 1.5), 5),
        ({"presence_penalty": 1.0}, [], [5], _flip_logits(2.0, 1.5), 7),  # 2 - 1 < 1.5
        ({"presence_penalty": 1.0}, [5], [], _flip_logits(2.0, 1.5), 5),  # prompt doesn't count
        ({"presence_penalty": 0.4}, [], [5, 5, 5], _flip_logits(2.0, 1.5), 5),  # 1.6 > 1.5
        ({"frequency_penalty": 0.3}, [], [5, 5], _flip_logits(2.0, 1.5), 7),  # 2 - .6 < 1.5
        ({"frequency_penalty": 0.3}, [], [5], _flip_logits(2.0, 1.5), 5),  # 2 - .3 > 1.5
        ({"repetition_penalty": 1.5}, [5], [], _flip_logits(2.0, 1.5), 7),  # 2/1.5 < 1.5
        ({"repetition_penalty": 1.5}, [], [5], _flip_logits(2.0, 1.5), 7),
        ({"repetition_penalty": 1.5}, [5], [], _flip_logits(-1.0, -1.2), 7),  # -1.5 < -1.2
        ({"repetition_penalty": 1.1}, [5], [], _flip_logits(2.0, 1.5), 5),  # 1.82 > 1.5
        ({"repetition_penalty": 0.5}, [7], [], _flip_logits(2.0, 1.5), 7),  # 1.5/.5 = 3 > 2
    ],
)
def test_penalties_flip_greedy(kwargs, prompt, output, logits, expected) -> None:
    meta = make_meta([SamplingParams(temperature=0.0, **kwargs)], [output], [prompt])
    assert sample(logits, meta).item() == expected


def test_min_tokens_masks_stop_ids() -> None:
    logits = torch.full((2, V), -1.0)
    logits[:, 5] = 3.0  # stop token
    logits[:, 9] = 2.0  # eos
    logits[:, 11] = 1.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5])
    p.all_stop_token_ids.add(9)
    outputs = [[1], [1, 2, 3]]
    meta = make_meta([p, p.clone()], outputs=outputs)
    assert sample(logits, meta).tolist() == [11, 5]
    # Metadata reused after the row has grown must stop masking.
    outputs[0].extend([2, 3])
    assert sample(logits, meta).tolist() == [5, 5]


def test_min_tokens_ignores_out_of_range_stop_ids() -> None:
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5, V + 100])
    logits = peaked_logits(1, top=5)
    assert sample(logits, make_meta([p], outputs=[[]])).item() != 5


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_are_raw_and_ranked(device: str) -> None:
    torch.manual_seed(0)
    logits = (torch.randn(4, V) * 2).to(device)
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.8, top_k=10, presence_penalty=2.0, logprobs=1),
        SamplingParams(temperature=2.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=0),
    ]
    outputs = [[1], [int(logits[1].argmax())], [2, 3], [int(logits[3].argmax())] * 3]
    meta = make_meta(params, outputs=outputs, prompts=[[4], [], [5], []], device=device)
    out = Sampler()(logits, meta)
    lp = out.logprobs_tensors
    assert lp is not None
    sampled = out.sampled_token_ids
    raw = torch.log_softmax(logits.float(), dim=-1)

    assert lp.token_ids.shape == (4, 4) and lp.logprobs.shape == (4, 4)
    assert lp.token_ids.dtype == torch.int64 and lp.logprobs.dtype == torch.float32
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(3, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()  # sorted descending
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.ranks, expected_ranks)
    assert lp.ranks[0].item() == 1  # greedy without penalties picks the top token
    # Row 3 is greedy but the frequency penalty pushed it off the raw argmax.
    assert lp.ranks[3].item() > 1


def test_logprobs_zero_gives_only_sampled_column() -> None:
    logits = torch.randn(2, V)
    meta = make_meta([SamplingParams(temperature=0.0, logprobs=0)] * 2)
    lp = Sampler()(logits, meta).logprobs_tensors
    assert lp is not None and lp.token_ids.shape == (2, 1) and lp.logprobs.shape == (2, 1)


def test_compute_prompt_logprobs_matches_manual() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, V, dtype=torch.bfloat16)
    targets = torch.tensor([3, 0, 49, 7, 7, 12])
    lp = compute_prompt_logprobs(logits, targets, 5)
    raw = logits.float().log_softmax(-1)
    assert torch.equal(lp.token_ids[:, 0], targets)
    torch.testing.assert_close(lp.logprobs[:, 0], raw[torch.arange(6), targets])
    top = raw.topk(5, dim=-1)
    torch.testing.assert_close(lp.logprobs[:, 1:], top.values)
    torch.testing.assert_close(lp.logprobs[:, 1], raw.max(-1).values)
    expected_ranks = (raw >= raw[torch.arange(6), targets][:, None]).sum(-1)
    assert torch.equal(lp.ranks, expected_ranks)
    assert math.isfinite(float(lp.logprobs.sum()))
