"""`ingot serve --runner pooling` with no --model (the default embedder) driven with the
official `openai` client and raw HTTP: /v1/embeddings (texts, token ids, float and base64),
/pooling, /score and /rerank (bi-encoder cosine), the 400s (dimensions on a non-Matryoshka
model, sampling fields, generation routes); and a tiny cross-encoder behind /rerank and /score
against HF's sigmoid logits."""

from __future__ import annotations

import base64
import struct
import sys
from pathlib import Path

import openai
import pytest
import torch
import transformers
from server_utils import run_server

from ingot.model_executor.loader.packaged_models import default_embedder_path

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import make_tiny_cross_encoder  # noqa: E402

pytestmark = pytest.mark.slow

TEXTS = ["The weather is lovely today.", "It is sunny outside!", "He drove to the stadium."]


def _decode(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--runner", "pooling", "--dtype", "float32", "--max-num-seqs", "8"]
    with run_server(args, tmp_path_factory.mktemp("logs")) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=f"{server.base}/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers' computation for this model, with transformers (fp32)."""
    path = default_embedder_path()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    hf = transformers.AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def embed(texts: list[str]) -> torch.Tensor:
        enc = tok(texts, padding=True, return_tensors="pt")
        with torch.no_grad():
            h = hf(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1)

    return tok, embed


def test_openai_client_embeddings_float_and_base64(client, reference):
    tok, embed = reference
    model = client.models.list().data[0].id
    assert model == "all-MiniLM-L6-v2"  # the default embedder, by name
    ref = embed(TEXTS)
    for fmt in ("float", "base64"):
        resp = client.embeddings.create(model=model, input=TEXTS, encoding_format=fmt)
        # Asked for explicitly, base64 comes back as the string (the client decodes only the
        # base64 it chose itself, below).
        got = torch.tensor([_decode(d.embedding) if fmt == "base64" else d.embedding
                            for d in resp.data])
        assert [d.index for d in resp.data] == [0, 1, 2]
        assert got.shape == (3, 384)
        assert torch.nn.functional.cosine_similarity(got, ref).min().item() >= 0.99999
        assert resp.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in TEXTS)
        assert resp.usage.total_tokens == resp.usage.prompt_tokens
    # The client's default asks for base64 and decodes it itself.
    default = client.embeddings.create(model=model, input=TEXTS[0])
    assert torch.allclose(torch.tensor(default.data[0].embedding), ref[0], atol=1e-5)


def test_embeddings_token_ids_and_raw_base64(server, reference):
    tok, embed = reference
    ids = [tok(t)["input_ids"] for t in TEXTS]
    status, body = server.json("POST", "/v1/embeddings", {"input": ids})
    assert status == 200, body
    ref = embed(TEXTS)
    got = torch.tensor([d["embedding"] for d in body["data"]])
    assert torch.nn.functional.cosine_similarity(got, ref).min().item() >= 0.99999
    status, one = server.json("POST", "/v1/embeddings",
                              {"input": ids[0], "encoding_format": "base64"})
    assert status == 200 and len(one["data"]) == 1
    vec = torch.tensor(_decode(one["data"][0]["embedding"]))
    assert torch.allclose(vec, got[0], atol=1e-6)
    assert one["object"] == "list" and one["data"][0]["object"] == "embedding"
    status, pooled = server.json("POST", "/pooling", {"input": TEXTS[0]})
    assert status == 200 and pooled["data"][0]["object"] == "pooling"
    assert torch.allclose(torch.tensor(pooled["data"][0]["data"]), ref[0], atol=1e-5)


def test_pooling_errors_are_400_and_the_server_keeps_serving(server):
    cases = [
        ("/v1/embeddings", {"input": "hi", "dimensions": 64}, "matryoshka"),
        ("/v1/embeddings", {"input": "hi", "temperature": 0.5}, "sampling parameters"),
        ("/v1/embeddings", {"input": []}, "empty"),
        ("/v1/embeddings", {"input": [[1, 2, 10**6]]}, "vocabulary"),
        ("/v1/embeddings", {"input": "word " * 400}, "truncate_prompt_tokens"),
        ("/v1/completions", {"prompt": "hi"}, "--runner pooling"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         "--runner pooling"),
        ("/classify", {"input": "hi"}, "not supported"),
        ("/v1/rerank", {"query": "q", "documents": []}, "empty"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_1"),
    ]
    for path, body, fragment in cases:
        status, err = server.json("POST", path, body)
        assert status == 400, (path, body, err)
        assert fragment in err["error"]["message"], (path, err)
    status, body = server.json("POST", "/v1/embeddings", {"input": "still serving"})
    assert status == 200 and len(body["data"][0]["embedding"]) == 384
    metrics = server.metrics_text()  # pooling requests are counted like any other
    assert 'finished_reason="stop"' in metrics and "prompt_tokens_total" in metrics
    status, body = server.json(
        "POST", "/v1/embeddings", {"input": "word " * 400, "truncate_prompt_tokens": 16}
    )
    assert status == 200 and body["usage"]["prompt_tokens"] == 16


def test_bi_encoder_score_and_rerank(server, reference):
    _, embed = reference
    docs = ["A sunny day.", "Stock prices fell sharply.", "The weather is lovely today!"]
    query = "What is the weather like?"
    vecs = embed([query, *docs])
    expected = (vecs[1:] @ vecs[0]).tolist()
    status, body = server.json("POST", "/score", {"text_1": query, "text_2": docs})
    assert status == 200, body
    scores = [d["score"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert max(abs(a - b) for a, b in zip(scores, expected, strict=True)) < 1e-5
    # N x N pairs one to one.
    status, pairs = server.json("POST", "/v1/score", {"text_1": [query, docs[0]], "text_2": docs[:2]})
    assert status == 200 and len(pairs["data"]) == 2
    status, body = server.json("POST", "/v1/rerank", {"query": query, "documents": docs, "top_n": 2})
    assert status == 200, body
    order = sorted(range(3), key=lambda i: -expected[i])[:2]
    assert [r["index"] for r in body["results"]] == order
    assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
    rel = [r["relevance_score"] for r in body["results"]]
    assert rel == sorted(rel, reverse=True)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    path, hf = make_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-ce"))
    with run_server([str(path), "--dtype", "float32"], tmp_path_factory.mktemp("ce-logs")) as s:
        yield s, hf, transformers.AutoTokenizer.from_pretrained(path)


def test_cross_encoder_rerank_matches_hf(cross_encoder):
    server, hf, tok = cross_encoder
    query = "the cat sat on a mat"
    docs = ["the dog ran far away", "a big red house", "the cat sat on a mat", "green tree"]
    enc = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = torch.sigmoid(hf(**enc).logits[:, 0]).tolist()
    status, body = server.json("POST", "/rerank", {"query": query, "documents": docs})
    assert status == 200, body
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    assert [r["index"] for r in body["results"]] == order
    for r in body["results"]:
        assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-5
    status, body = server.json("POST", "/score", {"text_1": query, "text_2": docs[1]})
    assert status == 200 and abs(body["data"][0]["score"] - expected[1]) < 1e-5
    status, body = server.json("POST", "/classify", {"input": query})
    assert status == 200 and body["data"][0]["num_classes"] == 1
    status, err = server.json("POST", "/v1/embeddings", {"input": query})
    assert status == 400 and "embed" in err["error"]["message"]
