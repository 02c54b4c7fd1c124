"""Embedding throughput of the default embedder (all-MiniLM-L6-v2): ingot against
sentence-transformers on the same weights, 2,000 sentences of 8-128 tokens, one process,
alternating rounds; then the p50 latency of one short embedding request through
`ingot serve --runner pooling`.

sentence-transformers is not a dependency of ingot; install it beside the venv, e.g.
  pip install --no-deps -t /tmp/st sentence-transformers scipy scikit-learn joblib \\
      threadpoolctl cloudpickle narwhals
  PYTHONPATH=/tmp/st .venv/bin/python bench/embedding_throughput.py
Without it only ingot's figures are printed. vLLM's CPU backend is not run by this script.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request

import torch
from serve_util import ingot_server

from ingot import LLM
from ingot.model_executor.loader.packaged_models import default_embedder_path

WORDS = ("the of and to in is was for on that with as by at from his her an which were are "
         "river engine model token memory sentence quick brown fox jumps over lazy dog paris "
         "france capital weather today tomorrow music science history water mountain city "
         "language computer network garden kitchen window market winter summer").split()


def sentences(n: int, tokenizer) -> list[str]:  # noqa: ANN001
    """n sentences whose token counts spread over 8-128 (with the special tokens)."""
    rng = random.Random(0)
    out = []
    while len(out) < n:
        target = rng.randint(8, 128)
        words = [rng.choice(WORDS) for _ in range(target)]
        while len(tokenizer.encode(" ".join(words))) > target and len(words) > 1:
            words.pop()
        out.append(" ".join(words))
    return out


def server_latency(requests: int) -> float:
    body = json.dumps({"input": "What is the capital of France?"}).encode()
    times = []
    with ingot_server(["--runner", "pooling"]) as url:
        for _ in range(requests + 2):
            req = urllib.request.Request(f"{url}/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
            start = time.perf_counter()
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200
                resp.read()
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    ap.add_argument("--latency-requests", type=int, default=30)
    ns = ap.parse_args()
    path = default_embedder_path()
    llm = LLM(runner="pooling")
    tokenizer = llm.get_tokenizer()
    texts = sentences(ns.sentences, tokenizer)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    print(f"WORKLOAD sentences={len(texts)} tokens={num_tokens} dtype="
          f"{llm.llm_engine.model_config.dtype}", flush=True)
    try:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
    except ImportError:
        st = None
    llm.embed(texts[:64])  # warm
    rates: dict[str, list[float]] = {"ingot": [], "sentence-transformers": []}
    for rnd in range(ns.rounds):
        start = time.perf_counter()
        ours = torch.tensor([o.outputs.embedding for o in llm.embed(texts)])
        t = time.perf_counter() - start
        rates["ingot"].append(len(texts) / t)
        print(f"RESULT engine=ingot round={rnd} sentences_s={len(texts) / t:.1f} "
              f"tokens_s={num_tokens / t:.0f}", flush=True)
        if st is None:
            continue
        start = time.perf_counter()
        ref = torch.tensor(st.encode(texts, batch_size=ns.batch_size))
        t = time.perf_counter() - start
        rates["sentence-transformers"].append(len(texts) / t)
        cos = torch.nn.functional.cosine_similarity(ours.float(), ref.float()).min()
        print(f"RESULT engine=sentence-transformers round={rnd} sentences_s={len(texts) / t:.1f} "
              f"tokens_s={num_tokens / t:.0f} min_cosine_vs_ingot={cos:.5f}", flush=True)
    for name, r in rates.items():
        if r:
            print(f"MEDIAN engine={name} sentences_s={statistics.median(r):.1f}")
    if rates["sentence-transformers"]:
        ratios = [a / b for a, b in zip(rates["ingot"], rates["sentence-transformers"], strict=True)]
        print(f"RATIO ingot_over_sentence_transformers={statistics.median(ratios):.2f}")
    del llm
    print(f"LATENCY server_p50_ms={server_latency(ns.latency_requests) * 1000:.1f}")


if __name__ == "__main__":
    main()
