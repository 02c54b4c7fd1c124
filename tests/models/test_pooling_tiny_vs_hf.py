"""Pooling models vs HF transformers on tiny random-weight models, fp32, same weights.

BertModel with CLS, MEAN and LAST pooling; BertForSequenceClassification logits and pair scores
(token type ids); a Qwen3 causal LM turned into an embedder (--convert embed: last token,
normalised), chunked and one-shot. Each gate has a broken twin that must fail it: a causal mask
on BERT, the wrong pooling type, token types dropped.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from tiny import bert_config, make_tiny_cross_encoder, make_tiny_model, randomise

from ingot import LLM
from ingot.model_executor.models import bert as ingot_bert
from ingot.pooling_params import PoolingParams

COS_MIN = 0.99999
PROMPTS = [
    [2, 17, 92, 45, 300, 11, 3],
    [2, 8, 250, 77, 5, 133, 40, 41, 42, 43, 44, 45, 46, 3],
    [2, 9, 3],
    [2, *range(50, 90), 3],
]
@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-bert")
    config = bert_config(vocab_size=512)
    hf = transformers.BertModel(config).eval()
    randomise(hf)
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf


def _hf_pool(hf, ids: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    vec = {"CLS": h[0], "MEAN": h.mean(0), "LAST": h[-1]}[kind]
    return torch.nn.functional.normalize(vec, dim=-1)


def _cosines(outs, refs) -> list[float]:
    return [
        torch.nn.functional.cosine_similarity(torch.tensor(o.outputs.embedding), r, dim=0).item()
        for o, r in zip(outs, refs, strict=True)
    ]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("max_num_seqs", 4)
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, **kwargs)


@pytest.mark.parametrize("kind", ["CLS", "MEAN", "LAST"])
def test_bert_pooling_types_match_hf(tiny_bert, kind):
    path, hf = tiny_bert
    llm = _llm(path, pooler_config={"pooling_type": kind, "normalize": True})
    try:
        outs = llm.embed(PROMPTS)  # packed into one prefill step
        refs = [_hf_pool(hf, p, kind) for p in PROMPTS]
        assert min(_cosines(outs, refs)) >= COS_MIN
        for o in outs:
            assert abs(torch.tensor(o.outputs.embedding).norm().item() - 1) < 1e-6
        # Broken twin: the wrong pooling type is caught by the same gate.
        wrong = {"CLS": "MEAN", "MEAN": "LAST", "LAST": "CLS"}[kind]
        assert min(_cosines(outs, [_hf_pool(hf, p, wrong) for p in PROMPTS])) < COS_MIN
        # Alone, batched, and across padding buckets: the same vectors.
        alone = [llm.embed([p])[0].outputs.embedding for p in PROMPTS]
        batched = [o.outputs.embedding for o in outs]
        assert torch.allclose(torch.tensor(alone), torch.tensor(batched), atol=1e-6)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("gemm", ["onednn", "mkl"])
def test_bert_fp32_linears_through_either_gemm(tiny_bert, monkeypatch, gemm):
    """``INGOT_CPU_F32_GEMM`` runs an encoder's fp32 linears on oneDNN's packed kernels (every
    linear: qkv, attention output, intermediate and output per layer, the pooler) or MKL's;
    both pass the HF gate, batched equal to alone. Broken twin: one packed weight made from
    other values fails it (the packed copies are what runs)."""
    from ingot.model_executor.layers import linear

    path, hf = tiny_bert
    monkeypatch.setenv("INGOT_CPU_F32_GEMM", gemm)
    packed: list = []
    real = linear.LinearBase.pack_f32_weight

    def pack(layer, perturb=False):  # noqa: ANN001, ANN202
        packed.append(layer)
        if perturb and len(packed) == 3:
            layer.weight.data.copy_(layer.weight.data.flip(0))  # outputs out of order
        real(layer)

    for broken in (False, True):
        packed.clear()
        monkeypatch.setattr(linear.LinearBase, "pack_f32_weight",
                            lambda layer, broken=broken: pack(layer, broken))
        llm = _llm(path, pooler_config={"pooling_type": "MEAN"})
        try:
            outs = llm.embed(PROMPTS)
            cos = min(_cosines(outs, [_hf_pool(hf, p, "MEAN") for p in PROMPTS]))
            alone = [llm.embed([p])[0].outputs.embedding for p in PROMPTS]
        finally:
            llm.llm_engine.shutdown()
        layers = bert_config(vocab_size=512).num_hidden_layers
        assert len(packed) == (4 * layers + 1 if gemm == "onednn" else 0)
        if broken and gemm == "onednn":
            assert cos < COS_MIN
        else:
            assert cos >= COS_MIN
            assert torch.allclose(torch.tensor(alone), torch.tensor([o.outputs.embedding for o in outs]),
                                  atol=1e-6)


def test_bert_padding_buckets_change_nothing(tiny_bert, monkeypatch):
    """An encoder runs unbucketed by default; with bucketing on, a lone prompt pads to its
    token bucket (padded keys carry no slot and must not be attended to) and packed prompts
    pad their step: the vectors stay those of the unpadded run. Broken twin: padding that is
    attended to (every key treated as real) changes them."""
    path, _ = tiny_bert
    kind = {"pooling_type": "MEAN", "normalize": True}
    buckets = {"enable_bucketing": True, "num_batched_tokens_buckets": [64, 128]}
    plain = _llm(path, pooler_config=kind)
    padded = _llm(path, pooler_config=kind, additional_config=buckets)
    try:
        ref = torch.tensor([o.outputs.embedding for o in plain.embed(PROMPTS)])
        alone = torch.tensor([padded.embed([p])[0].outputs.embedding for p in PROMPTS])
        batched = torch.tensor([o.outputs.embedding for o in padded.embed(PROMPTS)])
        assert torch.allclose(alone, ref, atol=1e-6)
        assert torch.allclose(batched, ref, atol=1e-6)

        original = ingot_bert.encoder_attention

        def attend_padding(query, key, value, meta, scale):
            meta.slot_mapping = meta.slot_mapping.clamp(min=0)  # every key looks real
            return original(query, key, value, meta, scale)

        monkeypatch.setattr(ingot_bert, "encoder_attention", attend_padding)
        wrong = torch.tensor(padded.embed([PROMPTS[2]])[0].outputs.embedding)
        assert not torch.allclose(wrong, ref[2], atol=1e-6)
    finally:
        plain.llm_engine.shutdown()
        padded.llm_engine.shutdown()


def test_matryoshka_dimensions_renormalise(tiny_bert):
    """Declared Matryoshka, ``dimensions`` cuts the vector and re-normalises it; otherwise it
    is refused."""
    path, _ = tiny_bert
    plain = _llm(path, pooler_config={"pooling_type": "MEAN"})
    try:
        with pytest.raises(ValueError, match="matryoshka"):
            plain.embed(PROMPTS[0], PoolingParams(dimensions=16))
    finally:
        plain.llm_engine.shutdown()
    llm = _llm(path, pooler_config={"pooling_type": "MEAN"},
               hf_overrides={"matryoshka_dimensions": [16, 32, 64]})
    try:
        full = torch.tensor(llm.embed(PROMPTS[0])[0].outputs.embedding)
        cut = torch.tensor(llm.embed(PROMPTS[0], PoolingParams(dimensions=16))[0].outputs.embedding)
        assert cut.shape == (16,)
        assert abs(cut.double().norm().item() - 1) < 1e-6
        assert torch.allclose(cut, torch.nn.functional.normalize(full[:16], dim=0), atol=1e-6)
        with pytest.raises(ValueError, match="one of"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=20))
        raw = llm.embed(PROMPTS[0], PoolingParams(normalize=False))[0].outputs.embedding
        assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3
    finally:
        llm.llm_engine.shutdown()


def test_bert_causal_mask_breaks_the_gate(tiny_bert, monkeypatch):
    """A BERT with causal attention (the decoder's mask) must fail the HF comparison."""
    path, hf = tiny_bert

    def causal(query, key, value, meta, scale):
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(0, 1).reshape(query.shape[0], -1)

    monkeypatch.setattr(ingot_bert, "encoder_attention", causal)
    llm = _llm(path, pooler_config={"pooling_type": "MEAN"},
               additional_config={"max_num_prefills_per_step": 1})
    try:
        outs = llm.embed(PROMPTS)
        assert min(_cosines(outs, [_hf_pool(hf, p, "MEAN") for p in PROMPTS])) < COS_MIN
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.needs_f32_kernels
def test_bert_fp32_blocks_bind_the_fused_epilogues(tiny_bert, monkeypatch):
    """Every fp32 block takes ingot's fused epilogue kernels at load (the gates above run
    through them); a GELU kernel handed a zero bias must then break the HF gate, and bf16
    blocks (oneDNN's own fused linears) take none."""
    from ingot.model_executor.binding import bind
    from ingot.model_executor.layers.attention_backend import TORCH_ATTENTION
    from ingot.model_executor.layers.bindable import Kernels

    def bound_kernel_layers(model):  # noqa: ANN001, ANN202
        return bind(model, TORCH_ATTENTION, Kernels(cpu=True)).kernel_layers

    config = bert_config(vocab_size=512)
    assert bound_kernel_layers(ingot_bert.BertModel(config)) == 1 + 3 * config.num_hidden_layers
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        assert bound_kernel_layers(ingot_bert.BertModel(config)) == 0
    finally:
        torch.set_default_dtype(previous)

    path, hf = tiny_bert
    real = ingot_bert.bias_gelu_f32_
    monkeypatch.setattr(ingot_bert, "bias_gelu_f32_",
                        lambda kernels, x, bias: real(kernels, x, torch.zeros_like(bias)))
    llm = _llm(path, pooler_config={"pooling_type": "MEAN"})
    try:
        outs = llm.embed(PROMPTS)
        assert min(_cosines(outs, [_hf_pool(hf, p, "MEAN") for p in PROMPTS])) < COS_MIN
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny_cross_encoder(tmp_path_factory):
    path, hf = make_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-ce"))
    return path, hf, transformers.AutoTokenizer.from_pretrained(path)


def test_cross_encoder_scores_match_hf(tiny_cross_encoder):
    path, hf, tok = tiny_cross_encoder
    query = "the cat sat on a mat"
    docs = ["the dog ran far away", "a big red house", "the cat sat on a mat", "green tree"]
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    try:
        assert llm.llm_engine.model_config.runner == "pooling"  # from the architecture
        scores = [s.outputs.score for s in llm.score(query, docs)]
        enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
        with torch.no_grad():
            logits = hf(**enc).logits[:, 0]
        assert torch.allclose(torch.tensor(scores), torch.sigmoid(logits), atol=1e-5)
        # Raw logits through classify (activation off).
        pair = tok(query, docs[0])
        raw = llm.classify(
            [{"prompt_token_ids": pair["input_ids"], "token_type_ids": pair["token_type_ids"]}],
            PoolingParams(activation=False),
        )[0].outputs.probs
        assert abs(raw[0] - logits[0].item()) < 1e-4
        # Broken twin: the same pair with its token types dropped fails the gate.
        no_types = llm.classify([pair["input_ids"]], PoolingParams(activation=False))[0]
        assert abs(no_types.outputs.probs[0] - logits[0].item()) > 1e-2
    finally:
        llm.llm_engine.shutdown()


def test_classifier_softmax_matches_hf(tmp_path):
    _classifier_softmax_matches_hf(tmp_path)


def test_classifier_softmax_twin_over_the_wrong_dim_fails(tmp_path):
    from faults import fails, injected

    with injected("classifier_softmax_wrong_dim"), fails():
        _classifier_softmax_matches_hf(tmp_path)


def _classifier_softmax_matches_hf(tmp_path) -> None:
    torch.manual_seed(2)
    hf = transformers.BertForSequenceClassification(bert_config(num_labels=3, vocab_size=512)).eval()
    randomise(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = _llm(tmp_path)
    try:
        probs = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS[:3])])
        with torch.no_grad():
            ref = torch.stack([torch.softmax(hf(torch.tensor([p])).logits[0], -1) for p in PROMPTS[:3]])
        assert torch.allclose(probs, ref, atol=1e-5)
        with pytest.raises(ValueError, match="one label"):
            llm.score("a", "b")
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    path = make_tiny_model("qwen3", tmp_path_factory.mktemp("tiny-qwen3"))
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def _hf_causal(hf, ids: list[int], kind: str) -> torch.Tensor:
    with torch.no_grad():
        h = hf(torch.tensor([ids])).last_hidden_state[0]
    return torch.nn.functional.normalize(h[-1] if kind == "LAST" else h.mean(0), dim=-1)


@pytest.mark.parametrize("kind", ["LAST", "MEAN"])
def test_causal_lm_convert_embed_chunked_matches_hf(tiny_qwen3, kind):
    """--convert embed (last token by default) equals HF's last hidden state normalised; a
    prompt chunked over several steps (16-token budget) pools as in one step."""
    path, hf = tiny_qwen3
    extra = {} if kind == "LAST" else {"pooler_config": {"pooling_type": "MEAN"}}
    one_shot = _llm(path, runner="pooling", **extra)
    chunked = _llm(path, runner="pooling", max_num_batched_tokens=16,
                   additional_config={"num_batched_tokens_buckets": [16]}, **extra)
    try:
        assert one_shot.llm_engine.model_config.convert == "embed"
        assert one_shot.llm_engine.model_config.pooler_config.pooling_type == kind
        refs = [_hf_causal(hf, p, kind) for p in PROMPTS]
        a = one_shot.embed(PROMPTS)
        steps = chunked.llm_engine.engine_core.num_steps
        b = chunked.embed(PROMPTS)
        assert chunked.llm_engine.engine_core.num_steps - steps > len(PROMPTS)  # it did chunk
        assert min(_cosines(a, refs)) >= COS_MIN
        assert min(_cosines(b, refs)) >= COS_MIN
        wrong = "MEAN" if kind == "LAST" else "LAST"
        assert min(_cosines(a, [_hf_causal(hf, p, wrong) for p in PROMPTS])) < COS_MIN
    finally:
        one_shot.llm_engine.shutdown()
        chunked.llm_engine.shutdown()


@pytest.mark.slow
def test_mp_executor_pools_like_uni(tiny_bert):
    """The worker in a child process: pooling params and pooled vectors cross the pipe."""
    path, hf = tiny_bert
    llm = _llm(path, pooler_config={"pooling_type": "MEAN"}, distributed_executor_backend="mp")
    try:
        outs = llm.embed(PROMPTS)
        assert min(_cosines(outs, [_hf_pool(hf, p, "MEAN") for p in PROMPTS])) >= COS_MIN
    finally:
        llm.llm_engine.shutdown()


def test_causal_lm_classifier_matches_hf(tmp_path, tiny_qwen3):
    """Qwen3ForSequenceClassification (last token -> score head) equals HF's logits; a plain
    causal LM checkpoint has no head to convert."""
    torch.manual_seed(3)
    config = transformers.Qwen3Config(**{**transformers.AutoConfig.from_pretrained(
        tiny_qwen3[0]).to_dict(), "num_labels": 3, "architectures": None})
    hf = transformers.Qwen3ForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    llm = _llm(tmp_path)
    try:
        got = torch.tensor([o.outputs.probs for o in llm.classify(PROMPTS, PoolingParams(activation=False))])
        with torch.no_grad():
            ref = torch.stack([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
        assert torch.allclose(got, ref, atol=1e-4)
        assert not torch.allclose(got[:, [1, 2, 0]], ref, atol=1e-4)  # the gate can fail
    finally:
        llm.llm_engine.shutdown()
    with pytest.raises(ValueError, match="score.weight"):
        _llm(tiny_qwen3[0], runner="pooling", convert="classify")
