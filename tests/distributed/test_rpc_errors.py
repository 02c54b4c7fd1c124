"""Issue #31 item 4 at the executor: under the multiprocess executor (``LLM(...,
tensor_parallel_size=2)``) an RPC that raises on one rank raises its own error class in the
caller (a ValueError stays one), as do an unknown method, a result that cannot travel back and
a function that was never registered, and the engine then serves the same greedy tokens; only
a step that fails ends the workers."""

from __future__ import annotations

from typing import Any

import pytest
from tiny import make_tiny_model

from ingot import LLM, SamplingParams
from ingot.distributed.wire import rpc_function
from ingot.errors import IngotError

pytestmark = pytest.mark.slow  # one engine with two worker processes

PROMPTS = [[3, 17, 92, 45, 200, 11], [9, 8, 7]]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@rpc_function
def fail_on(worker: Any, rank: int) -> int:
    if worker.rank == rank:
        raise ValueError(f"rank {rank} refuses")
    return worker.rank


@rpc_function
def unsendable(worker: Any) -> object:
    return object()


@rpc_function
def drop_runner(worker: Any, rank: int) -> None:
    if worker.rank == rank:
        worker.model_runner = None  # its next step raises; the other rank waits for it


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_rpc_errors_are_returned_and_only_a_failed_step_ends_the_workers(tmp_path):
    path = make_tiny_model("llama", tmp_path, vocab_size=259)
    llm = LLM(str(path), tensor_parallel_size=2, dtype="float32", skip_tokenizer_init=True,
              max_model_len=128, block_size=4)
    engine = llm.llm_engine
    try:
        before = _tokens(llm)
        assert engine.collective_rpc(fail_on, (5,)) == [0, 1]  # at the bar: no rank fails
        with pytest.raises(ValueError, match="rank 1 refuses") as info:
            engine.collective_rpc(fail_on, (1,))
        assert "raised by worker rank 1" in info.value.__notes__[0]  # for the log
        with pytest.raises(AttributeError, match="no RPC method '_private'"):
            engine.collective_rpc("_private")
        with pytest.raises(TypeError, match="cannot be sent back"):
            engine.collective_rpc(unsendable)
        with pytest.raises(TypeError, match="not a registered RPC function"):
            engine.collective_rpc(lambda worker: None)  # refused before anything is sent
        engine.check_health()
        assert _tokens(llm) == before  # the next steps work, with the same answer
        assert engine.collective_rpc(fail_on, (5,)) == [0, 1]

        engine.collective_rpc(drop_runner, (1,))
        with pytest.raises(IngotError, match="worker rank 1 failed during execute_model"):
            _tokens(llm)
        with pytest.raises(IngotError, match="the workers are down"):
            engine.collective_rpc(fail_on, (5,))
    finally:
        engine.shutdown()
