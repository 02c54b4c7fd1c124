"""The engine on CUDA: eager, CUDA graphs for decode buckets, and compiled layers inside them.

Skipped on machines without a GPU (CI has none); run on a lent GPU machine with
`bench/gpu_check.sh`, whose log is quoted in docs/PERFORMANCE.md.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_harness import hf_greedy
from tiny import hf_model

from ingot import LLM, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENGINE = dict(device="cuda", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128,
              block_size=16)


def _llm(path, **kw) -> LLM:
    return LLM(str(path), **{**ENGINE, "dtype": "float32", **kw})


def _worker(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker


def _random_requests(n: int, seed: int) -> tuple[list[dict], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(rng.randint(1, 100))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), ignore_eos=True)
              for _ in prompts]
    return prompts, params


def test_eager_on_cuda_matches_hf_fp32_greedy(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, enforce_eager=True)
    runner = _worker(llm).model_runner
    assert {p.device.type for p in runner.model.parameters()} == {"cuda"}
    assert all(kv.device.type == "cuda" for kv in runner.kv_caches)
    hf = hf_model(tiny_llama_dir)  # the fp32 reference, on the CPU
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(5, 60))] for _ in range(4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def _decode_steps(llm: LLM) -> int:
    return sum(c.executions for c in llm.llm_engine.get_stats()["buckets"].decode.values())


def test_cuda_graph_decode_matches_eager(tiny_llama_dir):
    """Not eager, not compiled: every decode bucket captured and replayed as a CUDA graph."""
    graphed = _llm(tiny_llama_dir, compile=False)
    graphs = _worker(graphed).model_runner.program.decode_graphs
    assert graphs is not None and len(graphs.graphs) >= 3
    eager = _llm(tiny_llama_dir, enforce_eager=True)
    assert _worker(eager).model_runner.program.decode_graphs is None
    prompts, params = _random_requests(100, seed=3)
    got = graphed.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert graphs.replays == _decode_steps(graphed) > 50


def test_compiled_on_cuda_matches_eager_and_never_recompiles(tiny_llama_dir, tmp_path):
    compiled = _llm(tiny_llama_dir, compile=True, cache_dir=str(tmp_path))
    stats = _worker(compiled).compile_stats()
    assert stats["enabled"] and stats["graphs"] >= 3
    assert stats["compilations"] == stats["graphs"]  # empty cache: every bucket built once
    eager = _llm(tiny_llama_dir, enforce_eager=True)

    prompts, params = _random_requests(200, seed=0)
    got = compiled.generate(prompts, params, use_tqdm=False)
    want = eager.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    after = _worker(compiled).compile_stats()
    assert after["compilations"] == stats["compilations"]
    assert after["calls_after_warmup"] == 0
    # Compiled layers inside the captured decode graphs.
    graphs = _worker(compiled).model_runner.program.decode_graphs
    assert graphs.replays == _decode_steps(compiled) > 50

    # A second start on the same cache compiles nothing.
    warm = _llm(tiny_llama_dir, compile=True, cache_dir=str(tmp_path))
    warm_stats = _worker(warm).compile_stats()
    assert warm_stats["compilations"] == 0 and warm_stats["cache_hits"] == warm_stats["graphs"]
    again = warm.generate(prompts[:20], params[:20], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want[:20]]


def test_bf16_on_cuda_tracks_the_fp32_reference(tiny_llama_dir):
    """bf16 greedy tokens agree with fp32's on nearly every position; the check is tight enough
    that fp16-with-garbage (the broken case) fails it."""
    prompts, _ = _random_requests(16, seed=2)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    reference = [o.outputs[0].token_ids
                 for o in _llm(tiny_llama_dir, enforce_eager=True).generate(prompts, params)]

    def agreement(llm: LLM) -> float:
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # Count the matching prefix per request: after a first divergence the rest is moot.
        same = 0
        for a, b in zip(outs, reference, strict=True):
            for x, y in zip(a, b, strict=True):
                if x != y:
                    break
                same += 1
        return same / sum(len(r) for r in reference)

    bf16 = _llm(tiny_llama_dir, dtype="bfloat16", enforce_eager=True)
    assert agreement(bf16) >= 0.8
    broken = _llm(tiny_llama_dir, dtype="bfloat16", enforce_eager=True)
    with torch.no_grad():  # the deliberately broken case: perturb one layer's output projection
        proj = _worker(broken).model_runner.model.model.layers[0].self_attn.o_proj
        proj.weight.add_(torch.randn_like(proj.weight) * proj.weight.abs().mean() * 4)
    assert agreement(broken) < 0.8
