"""Embedding throughput of the default embedder (all-MiniLM-L6-v2): ingot against
sentence-transformers on the same weights, 2,000 sentences of 8-128 tokens, each engine in its
own process per round, rounds alternating; then the p50 latency of one short embedding request through
`ingot serve --runner pooling`.

sentence-transformers is not a dependency of ingot; install it beside the venv, e.g.
  pip install --no-deps -t /tmp/st sentence-transformers scipy scikit-learn joblib \\
      threadpoolctl cloudpickle narwhals
  PYTHONPATH=/tmp/st .venv/bin/python bench/embedding_throughput.py
Without it only ingot's figures are printed. ``--engines ingot,ingot-bf16,...`` adds ingot
in bf16. vLLM's CPU backend is not run by this script.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
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


def child(engine: str, n: int, batch_size: int, vectors: str, adaptive: bool = True) -> None:
    """One engine, one timed pass over the workload in this (fresh) process; prints a RESULT
    line and saves the vectors for the parent's agreement check."""
    path = default_embedder_path()
    from transformers import AutoTokenizer

    texts = sentences(n, AutoTokenizer.from_pretrained(path))
    if engine == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu")
        st.encode(texts[:64], batch_size=batch_size)  # warm
        start = time.perf_counter()
        vecs = torch.tensor(st.encode(texts, batch_size=batch_size))
        seconds = time.perf_counter() - start
        dtype = "float32"
    else:
        llm = LLM(runner="pooling", cpu_adaptive_threads=adaptive,
                  **({"dtype": "bfloat16"} if engine == "ingot-bf16" else {}))
        dtype = str(llm.llm_engine.model_config.dtype).removeprefix("torch.")
        llm.embed(texts[:64])  # warm
        start = time.perf_counter()
        outs = llm.embed(texts)
        seconds = time.perf_counter() - start
        vecs = torch.tensor([o.outputs.embedding for o in outs])
    torch.save(vecs.float(), vectors)
    print("RESULT " + json.dumps({"engine": engine, "seconds": seconds, "dtype": dtype}), flush=True)


def run_child(engine: str, ns: argparse.Namespace, vectors: str) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, "--sentences", str(ns.sentences),
           "--batch-size", str(ns.batch_size), "--vectors", vectors]
    if ns.no_cpu_adaptive_threads:
        cmd.append("--no-cpu-adaptive-threads")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sentences", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' batch")
    ap.add_argument("--latency-requests", type=int, default=30)
    ap.add_argument("--engines", default="ingot,sentence-transformers",
                    help="comma-separated: ingot (its default dtype), ingot-bf16, "
                         "sentence-transformers")
    ap.add_argument("--no-cpu-adaptive-threads", action="store_true",
                    help="ingot keeps all its threads (as sentence-transformers does)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--vectors", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(ns.child, ns.sentences, ns.batch_size, ns.vectors, not ns.no_cpu_adaptive_threads)
        return
    engines = ns.engines.split(",")
    if "sentence-transformers" in engines and importlib.util.find_spec("sentence_transformers") is None:
        print("sentence-transformers is not installed: running ingot only", flush=True)
        engines = [e for e in engines if e != "sentence-transformers"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_embedder_path())
    texts = sentences(ns.sentences, tokenizer)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    print(f"WORKLOAD sentences={len(texts)} tokens={num_tokens} load_before={os.getloadavg()}",
          flush=True)
    rates: dict[str, list[float]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.rounds):  # engines alternate, each in its own process
            for engine in engines:
                res = run_child(engine, ns, f"{tmp}/{engine}.pt")
                t = res["seconds"]
                rates[engine].append(len(texts) / t)
                print(f"RESULT engine={engine} dtype={res['dtype']} round={rnd} "
                      f"sentences_s={len(texts) / t:.1f} tokens_s={num_tokens / t:.0f}", flush=True)
        vecs = {e: torch.load(f"{tmp}/{e}.pt") for e in engines}
    for engine in engines[1:]:
        cos = torch.nn.functional.cosine_similarity(vecs[engines[0]], vecs[engine]).min()
        print(f"AGREEMENT {engines[0]} vs {engine}: min_cosine={cos:.6f}")
    for name, r in rates.items():
        print(f"MEDIAN engine={name} sentences_s={statistics.median(r):.1f} "
              f"tokens_s={statistics.median(r) * num_tokens / len(texts):.0f}")
    for name in engines[1:]:
        ratios = [a / b for a, b in zip(rates[engines[0]], rates[name], strict=True)]
        print(f"RATIO {engines[0]}_over_{name}={statistics.median(ratios):.2f} "
              f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
    print(f"LOAD after={os.getloadavg()}", flush=True)
    if ns.latency_requests:
        print(f"LATENCY server_p50_ms={server_latency(ns.latency_requests) * 1000:.1f}")


if __name__ == "__main__":
    main()
