"""The engine's seams without a model: the server's ``EngineClient`` (AsyncLLM implements all of
it, and the server reaches for nothing else), the ``EngineCoreClient`` both cores implement,
the input processor's prompt checks, and the output processor's ``n > 1`` fan-out and
aggregation."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from ingot.core.outputs import EngineCoreOutput
from ingot.core.request import RequestStatus
from ingot.engine.async_engine import AsyncLLM
from ingot.engine.core import EngineCore
from ingot.engine.core_client import EngineCoreClient
from ingot.engine.dp_client import DPEngineCoreClient, LeastLoaded
from ingot.engine.output_processor import OutputProcessor
from ingot.engine.outputs import request_error
from ingot.engine.processor import InputProcessor, prefix_cache_root
from ingot.engine.protocol import EngineClient
from ingot.errors import EngineRequestError, PromptTooLongError, TokenIdError
from ingot.sampling_params import SamplingParams

SRC = Path(__file__).resolve().parents[2] / "src" / "ingot"


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def test_async_llm_is_the_servers_engine_client():
    missing = [m for m in _members(EngineClient) if not hasattr(AsyncLLM, m)]
    # Set per instance (in __init__), not on the class.
    assert missing == ["dead_error"]


@pytest.mark.parametrize("core", [EngineCore, DPEngineCoreClient])
def test_both_cores_are_engine_core_clients(core):
    missing = [m for m in _members(EngineCoreClient) if not hasattr(core, m)]
    assert missing in ([], ["num_steps"])  # num_steps is set in __init__


def test_the_server_uses_only_the_engine_client():
    for path in sorted((SRC / "entrypoints").rglob("*.py")) + sorted((SRC / "worker").rglob("*.py")):
        text = path.read_text()
        assert not re.search(r"engine\.engine\.|\.engine_core\.", text), path
    # Process supervision is below the engine: the DP client does not reach into the executor.
    assert "multiproc_executor" not in (SRC / "engine" / "dp_client.py").read_text()


def test_least_loaded_peek_is_the_next_pick():
    lb = LeastLoaded(3)
    lb.pick()
    assert lb.peek() == lb.peek() == 1 and lb.load == [1, 0, 0]
    assert lb.pick() == 1


class _Tokenizer:
    eos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 50 for c in text]

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(97 + i % 26) for i in ids)

    def convert_ids_to_tokens(self, ids: list[int], **_: object) -> list[str]:
        return [chr(97 + i % 26) for i in ids]


def _model_config(**kw) -> SimpleNamespace:
    base = dict(vocab_size=50, max_model_len=8, generation_config={"eos_token_id": [3]},
                hf_config=SimpleNamespace(eos_token_id=4), is_pooling=False,
                enable_prompt_embeds=False, architecture="LlamaForCausalLM")
    return SimpleNamespace(**{**base, **kw})


def test_input_processor_checks_prompts_in_one_place():
    proc = InputProcessor(_model_config(), _Tokenizer())
    assert proc.eos_token_ids == {2, 3, 4}
    assert proc.tokenize_prompt("ab") == ("ab", [47, 48])
    assert proc.tokenize_prompt({"prompt": "x", "prompt_token_ids": [1]}) == ("x", [1])
    for bad, match in [([], "prompt is empty"),
                       ([5, 99], r"prompt_token_ids must be token ids of the model's vocabulary "
                                 r"\(0 <= id < 50\); got 99"),
                       ([True], "vocabulary"), ([-1], "got -1"), ([2**40], "got 1099511627776")]:
        with pytest.raises(ValueError, match=match):
            proc.check_token_ids(bad)
    proc.check_token_ids([0, 49])  # at the limit: the last row of the embedding
    with pytest.raises(ValueError, match="prompt is empty"):
        proc.tokenize_prompt("")
    with pytest.raises(PromptTooLongError, match="more than max_model_len"):
        proc.validate_prompt([1] * 9)
    with pytest.raises(ValueError, match="--enable-prompt-embeds"):
        proc.process({"prompt_embeds": None}, SamplingParams())
    with pytest.raises(ValueError, match="--runner pooling"):
        InputProcessor(_model_config(is_pooling=True), None).check_generative()


def test_every_token_id_a_request_carries_is_checked_against_the_vocabulary():
    proc = InputProcessor(_model_config(), _Tokenizer())
    proc.check_sampling_params(SamplingParams(stop_token_ids=[0, 49]))  # at the limit
    cases = [
        (SamplingParams(stop_token_ids=[5, 50]), "stop_token_ids"),
        (SamplingParams(stop_token_ids=[2**40]), "stop_token_ids"),
        (SamplingParams(structured_outputs={"regex": "a", "reasoning_end_token_ids": [7, 50]}),
         "structured_outputs.reasoning_end_token_ids"),
    ]
    for params, field in cases:
        with pytest.raises(TokenIdError, match=f"^{field} must be token ids") as info:
            proc.check_sampling_params(params)
        assert info.value.param == field
        with pytest.raises(TokenIdError):  # the engine's own path runs the same check
            proc.process([1, 2], params)
    # An EOS id past the vocabulary can never be sampled: it is not a stop token.
    wide = InputProcessor(_model_config(hf_config=SimpleNamespace(eos_token_id=[4, 70])),
                          _Tokenizer())
    assert wide.eos_token_ids == {2, 3, 4}


def test_cache_salt_roots_the_prefix_cache_chain():
    proc = InputProcessor(_model_config(), _Tokenizer())
    plain = proc.process([1, 2], SamplingParams()).cache_salt
    a = proc.process({"prompt_token_ids": [1, 2], "cache_salt": "a"}, SamplingParams()).cache_salt
    a2 = proc.process({"prompt": "x", "prompt_token_ids": [1, 2], "cache_salt": "a"},
                      SamplingParams()).cache_salt
    b = proc.process({"prompt_token_ids": [1, 2], "cache_salt": "b"}, SamplingParams()).cache_salt
    assert plain == b"" and a == a2 and len({plain, a, b}) == 3
    # With embeds the root depends on both the content and the salt.
    assert prefix_cache_root(b"x" * 32, "a") not in (a, b"x" * 32, prefix_cache_root(b"y" * 32, "a"))
    for bad in ("", 5):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            proc.process({"prompt_token_ids": [1, 2], "cache_salt": bad}, SamplingParams())


def test_output_processor_fans_out_and_aggregates():
    out = OutputProcessor(None, {2})
    children = out.fan_out("r", [1, 2], SamplingParams(n=2, seed=7, max_tokens=4), None)
    assert [c.request_id for c in children] == ["0_r", "1_r"]
    assert [c.params.seed for c in children] == [7, 8] and children[0].params.n == 1
    assert 2 in children[0].params.all_stop_token_ids
    out.add_request("r", None, [1, 2], children)
    assert out.has_request("r") and out.get_num_unfinished_requests() == 1
    step = out.process_outputs([EngineCoreOutput("1_r", [5]), EngineCoreOutput("0_r", [6])])
    (first,) = step.outputs
    assert [c.token_ids for c in first.outputs] == [[6], [5]] and not first.finished
    # A failed child fails its request: its running sibling is to be aborted in the core.
    step = out.process_outputs([EngineCoreOutput("0_r", finish_status=RequestStatus.FINISHED_ABORTED,
                                                 error="bad grammar")])
    assert step.to_abort == ["1_r"] and step.outputs[0].finished
    assert step.outputs[0].error == "bad grammar" and not out.has_request("r")
    error = request_error(step.outputs[0])
    assert type(error) is ValueError and str(error) == "bad grammar"  # the request's fault: 400
    # The engine's fault: the caller gets the error id (a 500), nothing else of it.
    out.add_request("s", None, [1], out.fan_out("s", [1], SamplingParams(), None))
    step = out.process_outputs([EngineCoreOutput(
        "s", finish_status=RequestStatus.FINISHED_ABORTED, error="internal (id e1)",
        error_id="e1")])
    error = request_error(step.outputs[0])
    assert isinstance(error, EngineRequestError) and error.error_id == "e1"


def test_output_processor_abort_returns_the_children():
    out = OutputProcessor(None, set())
    out.add_request("r", None, [1], out.fan_out("r", [1], SamplingParams(n=3), None))
    assert out.abort_requests(["r", "gone"]) == {"r": ["0_r", "1_r", "2_r"]}
    assert out.abort_requests(["r"]) == {} and out.get_num_unfinished_requests() == 0
