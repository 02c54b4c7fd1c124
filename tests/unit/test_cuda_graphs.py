"""Decode-bucket graph capture and replay (worker/execution/cuda_graphs.py and its step
program, cuda_graph_program.py), on the CPU.

A stand-in "graph" re-runs the captured closure into the captured output buffer on replay: the
same contract as a CUDA graph (static inputs in, static output out), so these tests check what
the GPU path relies on: every input of a step reaches the static buffers, one graph per bucket,
and the outputs equal the plain forward's. tests/e2e/test_cuda.py runs the real thing on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.worker.execution import cuda_graphs
from ingot.worker.execution.cuda_graph_program import CudaGraphProgram
from ingot.worker.warmup import warmup_shapes


class FakeGraph:
    def __init__(self, run):
        self.run = run
        self.output = run()

    def replay(self) -> None:
        self.output.copy_(self.run())


def fake_capture(run):
    graph = FakeGraph(run)
    return graph, graph.output


ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64,
              block_size=8, device="cpu",
              kv_cache_memory_bytes=32 * 2**20)  # (not the free memory of a busy machine)


def _requests(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 259) for _ in range(rng.randint(1, 90))]}
               for _ in range(n)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
              for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    prompts, params = _requests(40, seed=0)
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    return prompts, params, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _capture(runner):
    """Wrap the runner's step program in a CUDA-graph program recording stand-in graphs (as
    the selection does on a CUDA engine) and capture every decode bucket now."""
    program = CudaGraphProgram(runner.program, runner.config, capture=fake_capture)
    graphs = program.capture(runner)
    runner.program = program
    return graphs


def test_replayed_decode_equals_the_plain_forward(tiny_llama_dir, reference):
    prompts, params, want = reference
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    runner = _runner(llm)
    graphs = _capture(runner)
    decode_shapes = [s for s in warmup_shapes(runner.config) if s.kind == "decode"]
    assert sorted(graphs.graphs) == sorted((s.num_reqs, s.width) for s in decode_shapes)
    assert all(kv[:, 0].abs().sum() == 0 for kv in runner.kv_caches)  # null block clean
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want
    decode_steps = sum(c.executions for c in llm.llm_engine.get_stats()["buckets"].decode.values())
    assert decode_steps > 50 and graphs.replays == decode_steps  # every one replayed


def test_a_graph_that_keeps_stale_inputs_is_caught(tiny_llama_dir, reference, monkeypatch):
    """The deliberately broken case: replays that skip copying the attention metadata (block
    tables, slots, masks stay those of the capture) must change the tokens."""
    prompts, params, want = reference
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    monkeypatch.setattr(cuda_graphs, "_copy_meta", lambda dst, src: None)
    _capture(_runner(llm))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got != want


def test_replay_rejects_a_step_unlike_its_bucket(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    runner = _runner(llm)
    graphs = _capture(runner)
    from ingot.worker.warmup import warmup_scheduler_output

    shape = next(s for s in warmup_shapes(runner.config) if s.kind == "decode")
    ids, pos, meta, _ = runner.prepare_inputs(warmup_scheduler_output(shape))
    meta.num_reqs += 1  # a field the bucket fixes
    with pytest.raises(ValueError, match="num_reqs"), torch.inference_mode():
        graphs.replay(ids, pos, meta)  # (the runner replays in inference mode)
    prefill = next(s for s in warmup_shapes(runner.config) if s.kind == "prefill")
    ids, pos, meta, _ = runner.prepare_inputs(warmup_scheduler_output(prefill))
    assert graphs.replay(ids, pos, meta) is None  # prefill is never replayed
    with pytest.raises(ValueError, match="decode"):
        graphs.capture(ids, pos, meta)


def test_cpu_captures_no_graphs(tiny_llama_dir):
    from ingot.engine.arg_utils import EngineArgs

    def config(**kw):
        return EngineArgs(model=str(tiny_llama_dir), skip_tokenizer_init=True,
                          **kw).create_engine_config().compilation

    assert config(device="cpu").cuda_graphs is False
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    assert _runner(llm).program.decode_graphs is None  # the CPU engine captures nothing by default


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_captures_graphs_unless_eager_is_enforced(tiny_llama_dir):
    from ingot.engine.arg_utils import EngineArgs

    def config(**kw):
        return EngineArgs(model=str(tiny_llama_dir), skip_tokenizer_init=True,
                          **kw).create_engine_config().compilation

    assert config(device="cuda").cuda_graphs is True
    assert config(device="cuda", enforce_eager=True).cuda_graphs is False
