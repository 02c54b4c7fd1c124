"""Speculative decoding end to end: greedy output with speculation is token for token the
output without it; drafts that copy the target are all accepted, random drafts almost never;
the counters add up; bad configurations fail at start-up."""

from __future__ import annotations

import random

import pytest
from test_engine_core_v2 import _engine, _mixed_requests, _run

from faults import fails, injected
from ingot import LLM, SamplingParams
from ingot.engine.arg_utils import EngineArgs

NGRAM = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3, "adaptive": False}


def _spec(k: int, **kw) -> dict:
    return {**NGRAM, "num_speculative_tokens": k, **kw}


def _requests() -> list:
    """The core tests' mixed requests (stop strings, min_tokens, penalties, n=2, aborts), and
    two that run into max_model_len (256) with speculation near the cutoff."""
    reqs = _mixed_requests()
    rng = random.Random(5)
    for _ in range(2):
        prompt = [rng.randrange(3, 259) for _ in range(200)]
        reqs.append((prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)))
    return reqs


# The bf16 cases are there for ingot's CPU kernels (they assert the engine runs them): where
# the kernels do not build they are reported skips, not a torch-only run under the same name.
@pytest.fixture(scope="module", params=["float32",
                                        pytest.param("bfloat16", marks=pytest.mark.needs_kernels)])
def dtype(request):
    return request.param


def _on_cpu_kernels(worker) -> bool:  # noqa: ANN001
    """Whether the worker's decode steps run ingot's CPU decode program."""
    return worker.model_runner.program.decode_program is not None


def _assert_on_cpu_kernels(engine) -> None:  # noqa: ANN001
    assert engine.collective_rpc(_on_cpu_kernels) == [True], "bf16 ran off ingot's CPU kernels"


@pytest.fixture(scope="module")
def kernel_sized_dir(tmp_path_factory):
    """bf16 decode and verification run on ingot's CPU kernels (the default model's path,
    write-all-rows-first included), not the module path."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-llama-hd32")
    # The default model's width and head layout (576 = 9 x 64, 3 KV heads): at this width
    # oneDNN and ingot's GEMV round differently, so a wrong kernel choice shows.
    make_tiny_model("llama", path, vocab_size=259, hidden_size=576, num_attention_heads=9,
                    num_key_value_heads=3)
    make_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def target(tiny_llama_dir, kernel_sized_dir, dtype):
    return tiny_llama_dir if dtype == "float32" else kernel_sized_dir


def _target_engine(target, dtype: str, **kw):  # noqa: ANN001, ANN202
    """An engine on ``target``; a bf16 one must run ingot's CPU decode program."""
    engine = _engine(target, 8, dtype=dtype, **kw)
    if dtype == "bfloat16":
        _assert_on_cpu_kernels(engine)
    return engine


@pytest.fixture(scope="module")
def reference(target, dtype):
    return _run(_target_engine(target, dtype), _requests())


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_ngram_speculation(target, reference, dtype, k):
    _speculation_keeps_the_tokens(_target_engine(target, dtype, speculative_config=_spec(k)),
                                  reference, k)


def test_ngram_speculation_twin_one_wrong_draft_accepted_fails(target, reference, dtype):
    """Broken twin: one verification emits a draft the target rejected."""
    engine = _target_engine(target, dtype, speculative_config=_spec(3))
    with injected("accepts_a_wrong_draft"), fails():
        _speculation_keeps_the_tokens(engine, reference, 3)


def _speculation_keeps_the_tokens(engine, reference, k: int) -> None:
    got = _run(engine, _requests())
    assert got == reference
    for rid in ("32", "33"):  # ran to the length cutoff
        assert got[rid][0][2] == "length" and len(got[rid][0][0]) == 256 - 200
    stats = engine.get_stats()["spec_decode"]
    # The comparison above means something: drafts were verified and many accepted.
    assert stats.num_drafts > 20 and stats.num_accepted_tokens > 20
    assert stats.num_accepted_tokens <= stats.num_draft_tokens <= k * stats.num_drafts
    per_pos = stats.num_accepted_tokens_per_pos
    assert len(per_pos) == k and sum(per_pos) == stats.num_accepted_tokens
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
    assert engine.get_stats()["num_running"] == 0


class _FixedProposer:
    """Drafts from a table: the reference continuation (a draft that copies the target) or
    random tokens."""

    def __init__(self, continuations: dict[str, list[int]] | None, k: int) -> None:
        self.continuations, self.k = continuations, k
        self.rng = random.Random(0)

    def propose(self, requests) -> list[list[int]]:  # noqa: ANN001
        if self.continuations is None:
            return [[self.rng.randrange(3, 259) for _ in range(self.k)] for _ in requests]
        return [self.continuations[r][len(s.output_token_ids):len(s.output_token_ids) + self.k]
                for r, s in requests]

    def remove(self, req_id: str) -> None:
        pass


def _install(worker, proposer) -> None:  # noqa: ANN001
    worker.model_runner.proposer = proposer


def _acceptance(path, continuations, k: int):
    engine = _engine(path, 8, speculative_config=_spec(k))
    engine.collective_rpc(_install, (_FixedProposer(continuations, k),))
    rng = random.Random(3)
    params = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
    for i in range(3):  # 3 x (1 + 4) rows fit the largest decode bucket (16)
        engine.add_request(str(i), [rng.randrange(3, 259) for _ in range(20)], params)
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    return outputs, steps, engine.get_stats()["spec_decode"]


def test_copying_draft_accepts_everything_and_random_draft_nothing(tiny_llama_dir):
    k = 4
    plain, plain_steps, _ = _acceptance(tiny_llama_dir, None, k)  # random drafts
    _, _, random_stats = _acceptance(tiny_llama_dir, None, k)
    assert random_stats.num_drafts > 0
    assert random_stats.num_accepted_tokens / random_stats.num_draft_tokens < 0.05
    copied, steps, stats = _acceptance(tiny_llama_dir, plain, k)
    assert copied == plain  # greedy: the same tokens either way
    assert stats.num_accepted_tokens == stats.num_draft_tokens  # acceptance 1.0
    # 25 tokens: one from the prefill, then k + 1 per verification step.
    assert steps == 1 + -(-24 // (k + 1))
    assert plain_steps > 20  # random drafts: about one token per step


def test_prefix_cache_never_shares_rejected_drafts(tiny_llama_dir):
    """A prompt's second run reuses the blocks its first run published; rejected drafts'
    K/V must not have been among them."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 259) for _ in range(61)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4)
    want = ref.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256, block_size=4,
              speculative_config=_spec(3))
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    cont = prompt + list(first.outputs[0].token_ids[:30])
    second = llm.generate([{"prompt_token_ids": cont}], params)[0]
    want2 = ref.generate([{"prompt_token_ids": cont}], params)[0].outputs[0].token_ids
    assert first.outputs[0].token_ids == want and second.outputs[0].token_ids == want2
    assert second.num_cached_tokens > len(prompt)  # it did reuse blocks of the first run


@pytest.mark.parametrize("kw,message", [
    ({"async_scheduling": True}, "async_scheduling cannot be combined"),
    ({"compile": True}, "not supported with speculative_config"),
    ({"speculative_config": '{"method": "ngram"'}, "not valid JSON"),
    ({"speculative_config": {"method": "eagle3", "model": "/no/such/head",
                             "num_speculative_tokens": 2}}, "not a directory with a config"),
    ({"speculative_config": {"method": "draft_model", "num_speculative_tokens": 2}},
     "needs \"model\""),
])
def test_bad_configs_fail_at_start_up(tiny_llama_dir, kw, message):
    args = {"speculative_config": _spec(2), **kw}
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_llama_dir), **args).create_engine_config()


def test_pooling_runner_refuses_speculation(tiny_llama_dir):
    with pytest.raises(ValueError, match="pooling model never decodes"):
        EngineArgs(model=str(tiny_llama_dir), runner="pooling", convert="embed",
                   speculative_config=_spec(2)).create_engine_config()


def test_server_with_speculation_serves_the_same_tokens_and_counts(tiny_llama_dir,
                                                                   tmp_path_factory):
    """`ingot serve --speculative-config` with the official client: greedy completions equal
    the offline engine's without speculation (n=2 too), and the spec-decode counters move."""
    import json

    import openai
    from server_utils import TINY_FLAGS, metric, run_server

    prompts = [[40 + i] * (5 + 7 * i) for i in range(3)]
    ref = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.outputs[0].text for o in
            ref.generate([{"prompt_token_ids": p} for p in prompts], params)]
    args = [str(tiny_llama_dir), *TINY_FLAGS, "--speculative-config", json.dumps(_spec(3))]
    with run_server(args, tmp_path_factory.mktemp("logs"), log_level="info") as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
        model = client.models.list().data[0].id
        before = server.metrics()
        assert metric(before, "ingot:spec_decode_num_drafts_total") == 0
        got = [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
               for p in prompts]
        assert got == want
        two = client.completions.create(model=model, prompt=prompts[1], max_tokens=24,
                                        temperature=0, n=2, extra_body={"ignore_eos": True})
        assert [c.text for c in two.choices] == [want[1], want[1]]
        m = server.metrics()
        drafts = metric(m, "ingot:spec_decode_num_drafts_total")
        drafted = metric(m, "ingot:spec_decode_num_draft_tokens_total")
        accepted = metric(m, "ingot:spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted <= drafted <= 3 * drafts
        per_pos = [metric(m, "ingot:spec_decode_num_accepted_tokens_per_pos_total",
                          position=str(p)) for p in range(3)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory):
    """A different random Llama with the same byte tokenizer: a draft that rarely agrees."""
    from tiny import make_byte_tokenizer, make_tiny_model

    path = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_model("llama", path, seed=7, vocab_size=259, num_hidden_layers=1)
    make_byte_tokenizer(path)
    return path


def _draft(path, k: int) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k,
            "adaptive": False}


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_identical_with_a_draft_model(target, tiny_draft_dir, reference, dtype, k):
    engine = _target_engine(target, dtype, speculative_config=_draft(tiny_draft_dir, k))
    _draft_model_keeps_the_tokens(engine, reference)


def test_draft_model_twin_one_wrong_draft_accepted_fails(target, tiny_draft_dir, reference,
                                                         dtype):
    engine = _target_engine(target, dtype, speculative_config=_draft(tiny_draft_dir, 3))
    with injected("accepts_a_wrong_draft"), fails():
        _draft_model_keeps_the_tokens(engine, reference)


def _draft_model_keeps_the_tokens(engine, reference) -> None:
    assert _run(engine, _requests()) == reference
    stats = engine.get_stats()["spec_decode"]
    assert stats.num_drafts > 20 and stats.num_accepted_tokens <= stats.num_draft_tokens


def test_the_target_as_its_own_draft_accepts_every_token(target, reference, dtype):
    """A draft that copies the target: acceptance 1.0, k + 1 tokens per verification."""
    k = 3
    engine = _target_engine(target, dtype, speculative_config=_draft(target, k))
    assert _run(engine, _requests()) == reference
    stats = engine.get_stats()["spec_decode"]
    # Greedy with the same weights: only bf16 rounding between the draft's batched prefill
    # and the target's decode rows could ever disagree.
    rate = stats.num_accepted_tokens / stats.num_draft_tokens
    assert rate == 1.0 if dtype == "float32" else rate > 0.9, rate


def test_draft_with_another_vocabulary_is_refused(tiny_llama_dir, tmp_path):
    from tiny import make_byte_tokenizer, make_tiny_model

    make_tiny_model("llama", tmp_path, vocab_size=300)
    make_byte_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        EngineArgs(model=str(tiny_llama_dir),
                   speculative_config=_draft(tmp_path, 2)).create_engine_config()


def test_logprobs_and_seeded_sampling_with_speculation(tiny_llama_dir):
    """Greedy logprobs are the plain engine's (one entry per token, drafts included); a
    seeded random request runs (its draws differ from plain decoding's order) and repeats."""
    rng = random.Random(11)
    prompt = {"prompt_token_ids": [rng.randrange(3, 259) for _ in range(30)]}
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    ref = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256)
    want = ref.generate([prompt], greedy)[0].outputs[0]
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", max_model_len=256,
              speculative_config=_spec(3))
    got = llm.generate([prompt], greedy)[0].outputs[0]
    assert got.token_ids == want.token_ids and len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        assert a.keys() == b.keys()
        assert all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert llm.llm_engine.get_stats()["spec_decode"].num_accepted_tokens > 0
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, seed=3)
    first = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    assert llm.generate([prompt], seeded)[0].outputs[0].token_ids == first
    assert len(first) == 40


@pytest.mark.needs_kernels
@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_bf16_logprobs_bit_equal_with_verification(kernel_sized_dir, batch):
    """Stronger than equal tokens: every emitted token's logprob, computed from the raw
    logits, is bit for bit the plain engine's at batch sizes around the kernel switch (ingot's
    GEMV up to 3 rows, oneDNN above; a verification must take its decode step's kernels for
    the layers and for the LM head). The copying proposer makes every step a verification."""
    rng = random.Random(batch)
    prompts = [[rng.randrange(3, 259) for _ in range(12)] for _ in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)

    def run(engine, proposer=None):  # noqa: ANN001, ANN202
        if proposer is not None:
            engine.collective_rpc(_install, (proposer,))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        out = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id] = (c.token_ids, [lp[t].logprob for lp, t in
                                                       zip(c.logprobs, c.token_ids, strict=True)])
        return out

    plain_engine = _engine(kernel_sized_dir, 8, dtype="bfloat16")
    _assert_on_cpu_kernels(plain_engine)
    plain = run(plain_engine)
    engine = _engine(kernel_sized_dir, 8, dtype="bfloat16", speculative_config=_spec(3))
    _assert_on_cpu_kernels(engine)
    got = run(engine, _FixedProposer({k: v[0] for k, v in plain.items()}, 3))
    assert got == plain
    assert engine.get_stats()["spec_decode"].num_accepted_tokens > 0
