"""Embedding throughput of the default embedder (all-MiniLM-L6-v2): ingot against
sentence-transformers on the same weights, 2,000 sentences of 8-128 tokens, each engine in its
own process per round, rounds alternating; then the p50 latency of one short embedding request through
`ingot serve --runner pooling`.

sentence-transformers is not a dependency of ingot; install it beside the venv, e.g.
  pip install --no-deps -t /tmp/st sentence-transformers scipy scikit-learn joblib \\
      threadpoolctl cloudpickle narwhals
  PYTHONPATH=/tmp/st .venv/bin/python bench/embedding_throughput.py
Without it only ingot's figures are printed. ``--engines ingot,ingot-bf16,...`` adds ingot
in bf16; ``vllm`` adds vLLM's CPU backend (float32, its pooling runner), run with the peer's
Python (``$INGOT_PEER_VENV``, default ~/.cache/ingot-peer/vllm; see ../shared/bench/vllm_peer.sh
for its install); that child imports neither ingot nor this venv's packages.
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

PEER_VENV = os.environ.get("INGOT_PEER_VENV", os.path.expanduser("~/.cache/ingot-peer/vllm"))

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
    from serve_util import ingot_server

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


def child(engine: str, n: int, batch_size: int, vectors: str, model_path: str,
          adaptive: bool = True) -> None:
    """One engine, one timed pass over the workload in this (fresh) process; prints a RESULT
    line and saves the vectors for the parent's agreement check."""
    from transformers import AutoTokenizer

    texts = sentences(n, AutoTokenizer.from_pretrained(model_path))
    dtype = "float32"
    if engine == "sentence-transformers":
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(model_path, device="cpu")
        st.encode(texts[:64], batch_size=batch_size)  # warm
        start = time.perf_counter()
        vecs = torch.tensor(st.encode(texts, batch_size=batch_size))
        seconds = time.perf_counter() - start
    elif engine == "vllm":
        from vllm import LLM as VllmLLM

        # The CPU backend reserves this fraction of host memory (weights + KV cache).
        llm = VllmLLM(model=model_path, runner="pooling", dtype="float32", max_model_len=256,
                      gpu_memory_utilization=0.06)
        llm.embed(texts[:64], use_tqdm=False)  # warm
        start = time.perf_counter()
        outs = llm.embed(texts, use_tqdm=False)
        seconds = time.perf_counter() - start
        vecs = torch.tensor([o.outputs.embedding for o in outs])
    else:
        from ingot import LLM

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


def run_child(engine: str, ns: argparse.Namespace, vectors: str, model_path: str) -> dict:
    python = os.path.join(PEER_VENV, "bin", "python") if engine == "vllm" else sys.executable
    cmd = [python, __file__, "--child", engine, "--sentences", str(ns.sentences),
           "--batch-size", str(ns.batch_size), "--vectors", vectors, "--model-path", model_path]
    if ns.no_cpu_adaptive_threads:
        cmd.append("--no-cpu-adaptive-threads")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    out = proc.stdout
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
                         "sentence-transformers, vllm")
    ap.add_argument("--no-cpu-adaptive-threads", action="store_true",
                    help="ingot keeps all its threads (as sentence-transformers does)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--vectors", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        child(ns.child, ns.sentences, ns.batch_size, ns.vectors, ns.model_path,
              not ns.no_cpu_adaptive_threads)
        return
    from ingot.model_executor.loader.packaged_models import default_embedder_path

    model_path = str(default_embedder_path())
    engines = ns.engines.split(",")
    if "vllm" in engines and not os.path.exists(os.path.join(PEER_VENV, "bin", "python")):
        print(f"no vLLM peer venv at {PEER_VENV} (../shared/bench/vllm_peer.sh installs it): "
              "running without vllm", flush=True)
        engines = [e for e in engines if e != "vllm"]
    if "sentence-transformers" in engines and importlib.util.find_spec("sentence_transformers") is None:
        print("sentence-transformers is not installed: running ingot only", flush=True)
        engines = [e for e in engines if e != "sentence-transformers"]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    texts = sentences(ns.sentences, tokenizer)
    num_tokens = sum(len(tokenizer.encode(t)) for t in texts)
    print(f"WORKLOAD sentences={len(texts)} tokens={num_tokens} load_before={os.getloadavg()}",
          flush=True)
    rates: dict[str, list[float]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(ns.rounds):  # engines alternate, each in its own process
            for engine in engines:
                res = run_child(engine, ns, f"{tmp}/{engine}.pt", model_path)
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
