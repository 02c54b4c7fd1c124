"""GGUF weights kept quantized under tensor parallelism (``--quantization gguf -tp 2``): each rank
keeps its rows of a column-parallel weight, whole blocks of a row-parallel one's columns and its
vocab shard of the tied embedding / LM head, packed for the quantized kernels. A tiny llama GGUF
(every linear quantized, 4 types) served with two worker processes over gloo gives TP=1's greedy
tokens and logprobs within 1e-4 (the row-parallel partial sums add in another order); its twin,
each rank holding the other rank's columns, must fail."""

from __future__ import annotations

import pytest
import tiny_gguf
from gguf import GGMLQuantizationType as QT

from ingot import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.needs_quant_kernels]

PROMPTS = [[3, 17, 92, 45, 200, 11, 8, 250, 77, 5, 133], [9, 8, 7], list(range(40, 70))]
# q/k/v one type (a fused group kept quantized has one), o_proj's and down's 64 and 128 input
# columns split into whole 32-weight blocks over 2 ranks
QTYPES = {"attn_q": QT.Q4_1, "attn_k": QT.Q4_1, "attn_v": QT.Q4_1, "attn_output": QT.Q5_0,
          "ffn_gate": QT.Q8_0, "ffn_up": QT.Q8_0, "ffn_down": QT.Q4_0}


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp-quant") / "tiny.gguf"
    kept = {f"blk.{i}.{part}.weight": qtype for i in (0, 1) for part, qtype in QTYPES.items()}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tiny_gguf, "DEFAULT_QTYPES", {**kept, "token_embd.weight": QT.Q8_0})
        tiny_gguf.write_tiny_gguf(path)
    return path


def _run(path, tp: int) -> tuple[list, list, list]:  # noqa: ANN001
    llm = LLM(str(path), tensor_parallel_size=tp, quantization="gguf", dtype="float32",
              max_model_len=128, block_size=4, max_num_seqs=8)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
        stats = llm.llm_engine.collective_rpc("startup_stats")
        return ([o.outputs[0].token_ids for o in outs],
                [[{t: v.logprob for t, v in step.items()} for step in o.outputs[0].logprobs]
                 for o in outs], stats)
    finally:
        llm.llm_engine.shutdown()


def _assert_same(tp1, tp2) -> None:  # noqa: ANN001
    assert tp2[0] == tp1[0]
    for a, b in zip(tp1[1], tp2[1], strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert step_a.keys() == step_b.keys()
            assert list(step_b.values()) == pytest.approx(list(step_a.values()), abs=1e-4)


@pytest.fixture(scope="module")
def tp1(gguf_path):
    return _run(gguf_path, 1)


def test_tp2_serves_the_quantized_blocks_with_tp1s_tokens(gguf_path, tp1):
    tp2 = _run(gguf_path, 2)
    _assert_same(tp1, tp2)
    # each rank holds about half the blocks (the norms are replicated, the vocab shard padded)
    full = tp1[2][0]["load_bytes"]
    assert [s["load_bytes"] < 0.6 * full for s in tp2[2]] == [True, True], (full, tp2[2])


def test_twin_with_each_rank_holding_the_other_ranks_columns_fails(gguf_path, tp1):
    from faults import fails, injected_in_children

    with injected_in_children("quant_shard_swapped"):
        tp2 = _run(gguf_path, 2)
    with fails():
        _assert_same(tp1, tp2)
