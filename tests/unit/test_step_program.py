"""How a step runs (worker/execution/): the selection rule, and the decode-program wrapper's
wiring, on any CPU. A stand-in decode program (the model's own decoder modules, counted) takes
the place of ingot's bf16 kernel program, which tests/e2e/test_cpu_decode_fast_path.py runs
where its kernels build."""

from __future__ import annotations

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.engine.arg_utils import EngineArgs
from ingot.model_executor.layers.attention_backend import AttentionBackend
from ingot.model_executor.loader.model_loader import load_model
from ingot.worker.execution.cuda_graph_program import CudaGraphProgram
from ingot.worker.execution.decode_program import BackendDecodeProgram
from ingot.worker.execution.program import EagerProgram
from ingot.worker.execution.select import select_step_program


class ModulesAsProgram:
    """A decode program that runs the model's decoder modules and counts its steps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls = 0

    def serves(self, meta) -> bool:  # noqa: ANN001
        return meta.is_decode

    def forward(self, input_ids, positions, kv_caches, meta):  # noqa: ANN001, ANN201
        self.calls += 1
        return self.model.model(input_ids, positions, kv_caches, meta)


def test_selection_wraps_the_layers_program(tiny_llama_dir):
    config = EngineArgs(model=str(tiny_llama_dir), dtype="float32",
                        skip_tokenizer_init=True).create_engine_config()
    cpu = torch.device("cpu")
    model = load_model(config.model_config, cpu)
    eager = select_step_program(config, model, cpu, None)
    assert type(eager) is EagerProgram
    # Unbound float32 linears run MKL's GEMM, which builds nothing per shape: warm-up skipped.
    assert eager.warmup is not None and not eager.warmup.needed
    fast = ModulesAsProgram(model)
    program = select_step_program(config, model, cpu, fast)
    assert type(program) is BackendDecodeProgram and type(program.inner) is EagerProgram
    assert program.decode_program is fast and program.decode_graphs is None
    assert program.compiler is None and program.grad_mode is torch.inference_mode
    config.compilation.cuda_graphs = True  # (a CUDA engine's default)
    graphed = select_step_program(config, model, cpu, fast)
    assert type(graphed) is CudaGraphProgram and graphed.inner.decode_program is fast
    assert not graphed.leaves_aux_states
    drafter = select_step_program(config, model, cpu, fast, drafter=True)
    assert type(drafter) is BackendDecodeProgram and drafter.inner.warmup is None


@pytest.fixture
def stand_in_programs(monkeypatch):
    """Every decoder the torch backend binds gets a stand-in decode program."""
    built: list[ModulesAsProgram] = []

    def decode_program(self, model):  # noqa: ANN001, ANN202
        if not hasattr(model, "model"):
            return None
        built.append(ModulesAsProgram(model))
        return built[-1]

    monkeypatch.setattr(AttentionBackend, "decode_program", decode_program)
    return built


def _generate(llm: LLM, max_tokens: int) -> list[list[int]]:
    prompts = [{"prompt_token_ids": list(range(3 + i, 30 + 2 * i))} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, skip_tokenizer_init=True)


def _runner(llm: LLM):  # noqa: ANN202
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_decode_steps_run_the_decode_program_and_nothing_else(tiny_llama_dir,
                                                               stand_in_programs):
    llm = LLM(str(tiny_llama_dir), **ENGINE)
    (fast,) = stand_in_programs
    runner = _runner(llm)
    program = runner.program
    assert program.decode_program is fast
    got = _generate(llm, 8)
    assert fast.calls == 7  # every decode step (one batch of three), no prefill
    runner.program = program.inner  # the modules, every step
    assert _generate(llm, 8) == got and fast.calls == 7


def test_a_draft_model_decodes_through_its_program(tiny_llama_dir, stand_in_programs):
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3,
            "adaptive": False}
    llm = LLM(str(tiny_llama_dir), speculative_config=spec, **ENGINE)
    target, draft = stand_in_programs
    assert _runner(llm).program.decode_program is target
    got = _generate(llm, 12)
    # The target verifies (decode steps of several rows a request); the draft proposes with
    # k - 1 = 2 one-token decode forwards a proposal, through its own program.
    assert target.calls > 0 and draft.calls > 0 and draft.calls % 2 == 0
    assert got == _generate(LLM(str(tiny_llama_dir), **ENGINE), 12)  # speculation changes none
