"""Structured outputs end to end on a tiny random Llama (byte-level tokenizer, fp32).

A random model writes noise, so any valid output is the grammar mask's doing; each gate has a
broken variant (the runner's mask call turned off) that must fail on some seed.
"""

from __future__ import annotations

import re
import time
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

import ingot.worker.model_runner as model_runner
from ingot import LLM, SamplingParams
from ingot.sampling_params import StructuredOutputsParams

PROMPT = [5, 6, 7, 8]
SEEDS = range(12)


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    flag: bool
    code: Literal["a", "bc"]


class Item(BaseModel):
    """Nested object, enum, bounded integer and array, required fields, no extra keys;
    bounded so that a random model's output ends."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["x", "y", "z"]
    n: int = Field(ge=0, le=999)
    tags: list[Literal["p", "q"]] = Field(max_length=3)
    inner: Inner


def _valid_item(text: str) -> bool:
    try:
        Item.model_validate_json(text, strict=True)
        return True
    except ValidationError:
        return False


GRAMMAR = r"""
root ::= "(" num ("+" num){0,3} ")"
num ::= [0-9] | [1-9] [0-9]
"""
GRAMMAR_RE = re.compile(r"\((?:[0-9]|[1-9][0-9])(?:\+(?:[0-9]|[1-9][0-9])){0,3}\)")
REGEX = r"[a-d]{2,5}-[0-9]{2}"

CASES = {
    "json": (dict(json=Item.model_json_schema()), _valid_item),
    "regex": (dict(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (dict(choice=["yes", "no", 'say "hi"', "é"]), lambda t: t in ("yes", "no", 'say "hi"', "é")),
    "grammar": (dict(grammar=GRAMMAR), lambda t: GRAMMAR_RE.fullmatch(t) is not None),
}


def _llm(path, **kw):
    return LLM(str(path), dtype="float32", max_model_len=256, block_size=4, **kw)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


def _params(constraint, seeds=SEEDS, max_tokens=240, **kw):
    # Room to finish: a random model writes much of the whitespace JSON allows.
    return [
        SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens,
                       structured_outputs=StructuredOutputsParams(**constraint), **kw)
        for s in seeds
    ]


def _run(llm, constraint, **kw):
    params = _params(constraint, **kw)
    return [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params)]


@pytest.mark.parametrize("kind", list(CASES))
def test_constrained_outputs_are_valid(llm, kind):
    constraint, valid = CASES[kind]
    outs = _run(llm, constraint)
    bad = [o.text for o in outs if not valid(o.text)]
    assert not bad, bad
    assert all(o.finish_reason == "stop" for o in outs), [o.finish_reason for o in outs]


@pytest.mark.parametrize("kind", list(CASES))
def test_broken_variant_without_the_mask_fails(llm, kind, monkeypatch):
    """The gate can fail: with the runner's mask call a no-op, outputs stop validating (the
    matcher then rejects a token and the request is aborted, not the engine)."""
    monkeypatch.setattr(model_runner, "apply_grammar_bitmask", lambda *a: None)
    constraint, valid = CASES[kind]
    outs = _run(llm, constraint, seeds=range(4))
    assert not all(valid(o.text) for o in outs)
    assert "abort" in {o.finish_reason for o in outs}
    # the engine still serves a constrained request once the mask is back
    monkeypatch.undo()
    (out,) = _run(llm, constraint, seeds=[0])
    assert valid(out.text)


def test_bad_constraints_fail_their_request_only(llm):
    kv = llm.llm_engine.engine_core.kv_cache_manager.pool
    free = kv.num_free_blocks
    bad = [
        dict(json={"type": "integer", "minimum": "x"}),
        dict(json={"type": "no-such-type"}),
        dict(regex="(unclosed"),
        dict(grammar="root ::= undefined_rule"),
        dict(structural_tag='{"type": "nonsense"}'),
    ]
    for constraint in bad:
        with pytest.raises(ValueError, match="invalid structured_outputs"):
            llm.generate([PROMPT], _params(constraint, seeds=[0]))
    # n > 1: a failing request leaves no child behind
    with pytest.raises(ValueError):
        llm.generate([PROMPT], SamplingParams(n=3, structured_outputs={"regex": "(("}))
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.engine_core.structured_output.num_requests == 0
    (out,) = _run(llm, CASES["regex"][0], seeds=[1])
    assert re.fullmatch(REGEX, out.text)
    assert kv.num_free_blocks == free


def test_compile_timeout_fails_the_request(tiny_llama_dir, monkeypatch):
    """A compile slower than compile_timeout_s fails its request with a ValueError; the
    engine serves the next one. (The slow compile is simulated: real compile times vary.)"""
    from ingot.structured_output.manager import StructuredOutputManager

    compile_now = StructuredOutputManager._compile_now

    def slow(self, params):
        if params.kind == "json":
            time.sleep(0.5)
        return compile_now(self, params)

    monkeypatch.setattr(StructuredOutputManager, "_compile_now", slow)
    llm = _llm(tiny_llama_dir, structured_outputs_config={"compile_timeout_s": 0.1})
    with pytest.raises(ValueError, match="did not compile within 0.1 s"):
        llm.generate([PROMPT], _params(dict(json=Item.model_json_schema()), seeds=[0]))
    assert not llm.llm_engine.has_unfinished_requests()
    (out,) = _run(llm, CASES["regex"][0], seeds=[0])  # still serving, other kinds compile
    assert re.fullmatch(REGEX, out.text)


def test_whitespace_runs_are_capped(tiny_llama_dir, llm):
    """max_json_whitespace bounds runs of whitespace in JSON; without the cap (null) the same
    seeds produce longer runs, so the check can fail."""
    def longest_run(outs):
        return max((len(m) for o in outs for m in re.findall(r"\s+", o.text)), default=0)

    constraint = dict(json_object=True)
    capped = _llm(tiny_llama_dir, structured_outputs_config={"max_json_whitespace": 2})
    outs = _run(capped, constraint, seeds=range(6), max_tokens=40)
    assert longest_run(outs) <= 2
    assert all(o.text.lstrip().startswith("{") for o in outs)
    uncapped = _llm(tiny_llama_dir, structured_outputs_config={"max_json_whitespace": None})
    assert longest_run(_run(uncapped, constraint, seeds=range(6), max_tokens=40)) > 2
    compact = _run(llm, dict(json=Item.model_json_schema(), disable_any_whitespace=True))
    # xgrammar's fixed separators (", " and ": "), nothing else
    assert all(_valid_item(o.text) and not re.search(r"[\n\r\t]|\s\s", o.text) for o in compact)


def test_grammar_end_finishes_without_eos(llm):
    """With ignore_eos the request has no stop token: it stops when the grammar completes."""
    outs = _run(llm, dict(choice=["alpha", "beta"]), ignore_eos=True, seeds=range(4))
    assert all(o.text in ("alpha", "beta") and o.finish_reason == "stop" for o in outs)
    assert all(len(o.token_ids) == len(o.text) for o in outs)  # no EOS token appended


def test_compiled_grammars_are_cached(llm):
    manager = llm.llm_engine.engine_core.structured_output
    _run(llm, dict(regex="[xy]{3}"), seeds=[0])
    compiles = manager.num_compiles
    _run(llm, dict(regex="[xy]{3}"), seeds=[1, 2])
    assert manager.num_compiles == compiles


def test_unconstrained_neighbours_are_unchanged(llm):
    """Greedy tokens of an unconstrained request are the same alone and next to constrained
    requests (their mask rows land on their own rows only)."""
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (alone,) = llm.generate([[9, 10, 11]], greedy)
    mixed = llm.generate(
        [PROMPT, [9, 10, 11], PROMPT],
        [*_params(CASES["regex"][0], seeds=[0]), greedy, *_params(CASES["json"][0], seeds=[1])],
    )
    assert mixed[1].outputs[0].token_ids == alone.outputs[0].token_ids
    assert re.fullmatch(REGEX, mixed[0].outputs[0].text)
    assert _valid_item(mixed[2].outputs[0].text)


@pytest.mark.slow
def test_mp_executor_carries_the_mask(tiny_llama_dir, llm):
    """Under the mp executor the bitmask crosses into the worker process: same seeded outputs
    as in-process, all valid."""
    constraint, valid = CASES["json"]
    mp = _llm(tiny_llama_dir, distributed_executor_backend="mp")
    try:
        got = [o.text for o in _run(mp, constraint, seeds=range(4))]
    finally:
        mp.llm_engine.shutdown()
    want = [o.text for o in _run(llm, constraint, seeds=range(4))]
    assert got == want and all(valid(t) for t in got)


def test_constraint_starts_after_the_reasoning_end(tiny_llama_dir):
    """With reasoning_end_token_ids the grammar leaves tokens free until the output contains
    that sequence, then constrains the rest; without it, the very first token is masked."""
    from transformers import AutoTokenizer

    from ingot.config import StructuredOutputsConfig
    from ingot.core.request import Request
    from ingot.model_executor.layers.grammar_bitmask import unpack_bitmask
    from ingot.sched_output import ScheduledRequest
    from ingot.structured_output.manager import StructuredOutputManager, TokenVerdict

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    manager = StructuredOutputManager(tok, 259, StructuredOutputsConfig())
    end = tok.encode("</think>", add_special_tokens=False)
    yes_no = {tok.encode(w, add_special_tokens=False)[0] for w in ("yes", "no")}

    def add(rid, **extra):
        params = SamplingParams(structured_outputs={"choice": ["yes", "no"], **extra})
        params.all_stop_token_ids = {2}
        request = Request(rid, PROMPT, params)
        manager.add_request(rid, request.sampling_params)
        while not manager.ready(rid):  # it compiles on the pool
            manager.wait_for_compiles(1.0)
        return ScheduledRequest(rid, [5], 0, [1], sample=True)

    def allowed(sched):
        mask = manager.grammar_bitmask([sched])
        if mask is None:
            return None
        return set(unpack_bitmask(torch.from_numpy(mask.bitmask), 259)[0].nonzero().flatten().tolist())

    plain = add("plain")
    assert allowed(plain) == yes_no  # broken variant: no reasoning phase, masked at once
    thinking = add("thinking", reasoning_end_token_ids=end)
    assert allowed(thinking) is None
    for t in tok.encode("hmm </think", add_special_tokens=False):
        assert manager.accept_token("thinking", t) is TokenVerdict.ACCEPTED  # free text
        assert allowed(thinking) is None
    assert manager.accept_token("thinking", end[-1]) is TokenVerdict.ACCEPTED
    assert allowed(thinking) == yes_no
    assert manager.accept_token("thinking", 100) is TokenVerdict.REJECTED  # now constrained


def test_async_scheduling_gives_the_same_constrained_outputs(tiny_llama_dir, llm):
    """With async scheduling a constrained request waits for its token in flight before its
    next step (its mask needs it); outputs equal the synchronous engine's, unconstrained
    neighbours included."""
    constraint, valid = CASES["json"]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [PROMPT] * 3 + [[9, 10, 11]]
    params = [*_params(constraint, seeds=range(3)), greedy]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    asynchronous = _llm(tiny_llama_dir, async_scheduling=True)
    got = asynchronous.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == want
    assert all(valid(o.outputs[0].text) for o in got[:3])
