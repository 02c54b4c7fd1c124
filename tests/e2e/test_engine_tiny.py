"""Engine behaviour on a tiny random Llama (fp32): batching, chunking, accounting, options."""

from __future__ import annotations

import random

import pytest
import torch
from paged_harness import hf_greedy, hf_logits
from tiny import hf_model

from faults import fails, injected
from ingot import LLM, SamplingParams
from ingot.engine.llm_engine import LLMEngine
from ingot.errors import PromptTooLongError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _llm(path, **kw):
    args = dict(dtype="float32", max_model_len=256, block_size=4)
    args.update(kw)
    return LLM(str(path), **args)


def _prompts(n, seed=0, lo=1, hi=60):
    rng = random.Random(seed)
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return _llm(tiny_llama_dir)


@pytest.mark.parametrize("max_batched", [None, 16])
def test_batch_invariance(tiny_llama_dir, max_batched):
    """A request gives the same greedy tokens alone and inside a batch of 16 mixed lengths,
    with whole prefills and with prefills chunked into 16-token pieces."""
    kw = {} if max_batched is None else {"max_num_batched_tokens": max_batched, "max_num_seqs": 16}
    _batched_equals_alone(_llm(tiny_llama_dir, **kw))


def _batched_equals_alone(llm) -> None:
    prompts = _prompts(16)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    for i in (0, 5, 15):
        (alone,) = llm.generate([prompts[i]], GREEDY)
        assert alone.outputs[0].token_ids == batched[i]


def test_batch_invariance_twin_a_batch_dependent_row_fails(tiny_llama_dir):
    """Broken twin: a row's hidden state depends on how many rows share its step."""
    with injected("batch_dependent"), fails():
        _batched_equals_alone(_llm(tiny_llama_dir))


def test_engine_matches_hf_greedy_in_a_batch(tiny_llama_dir, llm):
    _greedy_in_a_batch_matches_hf(tiny_llama_dir, llm)


def _greedy_in_a_batch_matches_hf(tiny_llama_dir, llm) -> None:
    hf = hf_model(tiny_llama_dir)
    prompts = _prompts(4, seed=1)
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 12)


def test_hf_greedy_twin_a_perturbed_weight_fails(tiny_llama_dir):
    with injected("weight", name="layers.1.mlp.down_proj"):
        broken = _llm(tiny_llama_dir)
    with fails():
        _greedy_in_a_batch_matches_hf(tiny_llama_dir, broken)


def test_block_accounting_after_random_requests_and_aborts(tiny_llama_dir):
    llm = _llm(
        tiny_llama_dir, num_gpu_blocks_override=40, max_num_seqs=8, max_num_batched_tokens=32,
        max_model_len=64,
    )
    engine: LLMEngine = llm.llm_engine
    manager = engine.engine_core.kv_cache_manager
    pool = manager.pool
    start_free = pool.num_free_blocks
    assert start_free == 40 - 1  # every block but the null block
    rng = random.Random(7)
    ids = []
    for i, prompt in enumerate(_prompts(200, seed=3, hi=40)):
        params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 20), ignore_eos=True)
        ids.append(engine.add_request(f"r{i}", prompt, params))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if rng.random() < 0.2:
            live = [r for r in ids if engine.output_processor.has_request(r)]
            if live:
                engine.abort_request(rng.choice(live))
        # Every step: exactly the blocks no live request holds are free (shared prefix
        # blocks count once).
        held = {b for blocks in manager.req_blocks.values() for b in blocks}
        assert pool.num_free_blocks == start_free - len(held)
    assert steps > 50
    assert pool.num_free_blocks == start_free
    stats = engine.get_stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_logprobs_and_prompt_logprobs_match_hf(tiny_llama_dir, llm):
    _logprobs_match_hf(tiny_llama_dir, llm)


def test_logprobs_twin_a_slightly_wrong_weight_fails(tiny_llama_dir):
    """A 1% error in one weight moves the logprobs past the 1e-4 tolerance."""
    with injected("weight", name="layers.0.self_attn.o_proj", scale=0.01):
        broken = _llm(tiny_llama_dir)
    with fails():
        _logprobs_match_hf(tiny_llama_dir, broken)


def _logprobs_match_hf(tiny_llama_dir, llm) -> None:
    hf = hf_model(tiny_llama_dir)
    prompt = _prompts(1, seed=2, lo=20, hi=20)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    (out,) = llm.generate([prompt], params)
    completion = out.outputs[0]
    ref = torch.log_softmax(hf_logits(hf, prompt + completion.token_ids), dim=-1)
    for i, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        top = row.topk(3).indices.tolist()
        assert [t for t in entry if t != tok] == [t for t in top if t != tok][: len(entry) - 1]
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        target = prompt[pos]
        assert entry[target].logprob == pytest.approx(ref[pos - 1, target].item(), abs=1e-4)
        rank = int((ref[pos - 1] > ref[pos - 1, target]).sum()) + 1
        assert entry[target].rank == rank
    total = sum(e[t].logprob for t, e in zip(completion.token_ids, completion.logprobs, strict=True))
    assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_prompt_logprobs_across_prefill_chunks(tiny_llama_dir, llm):
    prompt = _prompts(1, seed=4, lo=40, hi=40)[0]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    (whole,) = llm.generate([prompt], params)
    chunked = _llm(tiny_llama_dir, max_num_batched_tokens=8, max_num_seqs=8)
    (parts,) = chunked.generate([prompt], params)
    a = [None if e is None else e[prompt[i]].logprob for i, e in enumerate(whole.prompt_logprobs)]
    b = [None if e is None else e[prompt[i]].logprob for i, e in enumerate(parts.prompt_logprobs)]
    assert a[0] is None and b[0] is None
    assert a[1:] == pytest.approx(b[1:], abs=1e-4)


def test_n_samples_and_seeds(llm):
    prompt = _prompts(1, seed=5)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    (a,) = llm.generate([prompt], params)
    (b,) = llm.generate([prompt, _prompts(1, seed=9)[0]], params)[:1]
    assert len(a.outputs) == 3 and [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # children get distinct seeds


def test_stop_token_ids_max_tokens_and_min_tokens(llm):
    prompt = _prompts(1, seed=6)[0]
    (free,) = llm.generate([prompt], GREEDY)
    tokens = free.outputs[0].token_ids
    assert free.outputs[0].finish_reason == "length" and len(tokens) == 12
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    (stopped,) = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at])
    )
    out = stopped.outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    (delayed,) = llm.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at],
                       min_tokens=first + 2),
    )
    assert stop_at not in delayed.outputs[0].token_ids[: first + 2]


def test_stop_string_is_not_emitted(llm):
    # A random model often emits invalid UTF-8; pick a prompt whose continuation is clean text.
    free_params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    candidates = [f"{w} {i}" for i in range(40) for w in ("abc", "the cat")]
    outs = llm.generate(candidates, free_params)
    prompt, text = next(
        (p, o.outputs[0].text)
        for p, o in zip(candidates, outs, strict=True)
        if len(o.outputs[0].text) >= 8 and "\ufffd" not in o.outputs[0].text
    )
    stop = text[3:5]
    (stopped,) = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop])
    )
    out = stopped.outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_chat_uses_the_template(llm):
    (out,) = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))
    assert out.prompt == "<s>user: hi\nassistant:"


@pytest.mark.parametrize(
    "prompt, error",
    [
        ("", ValueError),
        ([], ValueError),
        ([1] * 300, PromptTooLongError),
        ([100000], ValueError),
    ],
)
def test_bad_prompts_are_rejected_and_engine_keeps_working(llm, prompt, error):
    with pytest.raises(error):
        llm.generate([prompt], GREEDY)
    assert not llm.llm_engine.has_unfinished_requests()
    (ok,) = llm.generate([[5, 6, 7]], GREEDY)
    assert len(ok.outputs[0].token_ids) == 12


def test_cache_too_small_for_one_full_request_is_a_startup_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="lower --max-model-len"):
        _llm(tiny_llama_dir, num_gpu_blocks_override=4)


def test_unknown_llm_argument(tiny_llama_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_llama_dir), max_num_seq=4)
