"""Padding to buckets on a real (tiny) model: slot numbers, the KV cache is never touched by
padding, and outputs are identical with buckets / context buckets on and off."""

from __future__ import annotations

import random

import pytest
import torch

from ingot import LLM, SamplingParams
from ingot.model_executor.layers.linear import cpu_packed_linear_supported
from ingot.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from ingot.worker.model_runner import slot_mapping


def _llm(path, **kw):
    args = dict(dtype="float32", max_model_len=512, block_size=16, max_num_seqs=8)
    args.update(kw)
    return LLM(str(path), **args)


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_slot_numbers_from_the_spec():
    table = torch.tensor([[10, 15, 22]])
    assert slot_mapping(table, torch.tensor([0]), torch.tensor([100]), 64).tolist() == [996]
    pos = torch.tensor([62, 63, 64, 65])
    assert slot_mapping(table, torch.zeros(4, dtype=torch.int64), pos, 64).tolist() == [702, 703, 960, 961]


def test_prefill_of_100_tokens_pads_to_128_with_slot_minus_one(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, block_size=64)
    item = ScheduledRequest("x", 100, 0, [10, 15], True)
    new = NewRequestData("x", list(range(3, 103)), SamplingParams())
    so = SchedulerOutput([item], [new], is_prefill=True, num_padded=128)
    input_ids, positions, meta, last_rows = _runner(llm).prepare_inputs(so)
    slots = meta.slot_mapping.tolist()
    assert slots == list(range(640, 704)) + list(range(960, 996)) + [-1] * 28
    assert input_ids.shape == (128,) and last_rows == [99]
    assert positions[100:].tolist() == [99] * 28  # padding repeats the last real position


def test_decode_batch_pads_with_null_rows(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    items = [ScheduledRequest(f"r{i}", 1, 20 + i, [3 + i, 9 + i], False) for i in range(3)]
    new = [NewRequestData(f"r{i}", [7] * (21 + i), SamplingParams()) for i in range(3)]
    so = SchedulerOutput(items, new, is_prefill=False, num_padded=4, ctx_bucket=256)
    input_ids, positions, meta, last_rows = _runner(llm).prepare_inputs(so)
    assert input_ids.shape == (4,) and last_rows == [0, 1, 2]
    assert meta.slot_mapping.tolist()[3] == -1
    assert meta.block_table[3].eq(0).all()  # the dummy row reads only the null block
    # Default context ladder [256]: positions up to 23 read 256 // 16 blocks, not max_model_len's.
    assert meta.block_table.shape[1] == 256 // 16
    off = _llm(tiny_llama_dir, additional_config={"decode_context_length_buckets": None})
    so = SchedulerOutput(items, new, is_prefill=False, num_padded=4, ctx_bucket=512)
    _, _, meta, _ = _runner(off).prepare_inputs(so)
    assert meta.block_table.shape[1] == 512 // 16  # context bucketing off: max_model_len wide


def test_padding_never_writes_the_kv_cache(tiny_llama_dir, monkeypatch):
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=128)
    runner = _runner(llm)
    checked = {"prefill": 0, "decode": 0}
    original = runner.execute_model

    def checked_execute(so):
        before = [c.clone() for c in runner.kv_caches]
        out = original(so)
        real_slots = set()
        for it in so.scheduled:
            blocks = runner.input_batch.block_ids(it.req_id)
            for p in range(it.start_position, it.start_position + it.num_tokens):
                real_slots.add(blocks[p // 16] * 16 + p % 16)
        for b, a in zip(before, runner.kv_caches, strict=True):
            per_slot = (b != a).reshape(2, b.shape[1] * b.shape[2], -1).any(-1).any(0)
            changed = per_slot.nonzero().flatten().tolist()
            assert set(changed) <= real_slots
        padded = so.num_padded > so.total_num_scheduled_tokens
        if padded:
            checked["prefill" if so.is_prefill else "decode"] += 1
        return out

    monkeypatch.setattr(runner, "execute_model", checked_execute)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (5, 77, 130, 40, 9)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert checked["prefill"] > 0 and checked["decode"] > 0


def _outputs(llm, prompts, params):
    """(greedy tokens, their logprobs) per prompt."""
    results = []
    for out in llm.generate(prompts, params):
        c = out.outputs[0]
        results.append((c.token_ids, [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]))
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_identical_outputs_with_buckets_and_context_buckets_on_and_off(tmp_path, arch):
    from tiny import make_tiny_model

    _buckets_change_nothing(make_tiny_model(arch, tmp_path))


def test_buckets_twin_padding_that_moves_real_rows_fails(tmp_path):
    """Broken twin: a step's real rows depend on how much padding its bucket added."""
    from tiny import make_tiny_model

    from faults import fails, injected

    path = make_tiny_model("llama", tmp_path)
    with injected("padding_dependent"), fails():
        _buckets_change_nothing(path)


def _buckets_change_nothing(path) -> None:
    rng = random.Random(2)
    # Lengths chosen so decoding crosses the 128 context bucket and prefills span chunks.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 120, 126, 60, 200, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    configs = {
        "off": {"additional_config": {"enable_bucketing": False}},
        "buckets": {},
        "ctx": {"additional_config": {"decode_context_length_buckets": [128, 256]}},
        "chunked": {"max_num_batched_tokens": 64, "additional_config": {"num_batched_tokens_buckets": [16, 64]}},
    }
    results = {}
    for name, kw in configs.items():
        llm = _llm(path, skip_tokenizer_init=True, **kw)
        results[name] = _outputs(llm, prompts, params)
        alone = _outputs(llm, [prompts[1]], params)  # 120 prompt tokens: decode crosses 128
        assert alone[0][0] == results[name][1][0]
        if name == "ctx":
            ctx = llm.llm_engine.get_stats()["buckets"].decode_ctx
            assert ctx[128] > 0 and ctx[256] > 0  # both buckets were really used
    ref = results["off"]
    for name, got in results.items():
        for (tokens, lps), (ref_tokens, ref_lps) in zip(got, ref, strict=True):
            assert tokens == ref_tokens, name
            assert lps == pytest.approx(ref_lps, abs=1e-5), name


@pytest.mark.parametrize("prefills", [1, 8])
def test_bucket_stats_count_padding(tiny_llama_dir, prefills):
    llm = _llm(tiny_llama_dir, additional_config={"max_num_prefills_per_step": prefills})
    stats = llm.llm_engine.get_stats()["buckets"]
    assert set(stats.decode) == {1, 2, 4, 8} and all(c.executions == 0 for c in stats.decode.values())
    llm.generate([[5] * 10, [6] * 20, [7] * 30], SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 3 if prefills == 1 else 1  # packed: the three prompts share one 128-token step
    assert stats.prefill[128].executions == steps
    assert stats.prefill[128].padding == steps * 128 - 60
    assert stats.decode[4].executions >= 1 and stats.decode[4].padding >= 1


def test_engine_stats(tiny_llama_dir):
    llm = _llm(tiny_llama_dir)
    engine = llm.llm_engine
    engine.add_request("a", [5] * 40, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    stats = engine.get_stats()
    assert stats["scheduler_state"] == "active_prefill" and stats["num_running"] == 1
    assert stats["kv_blocks_used"] == 3  # ceil(40 / 16)
    assert stats["kv_blocks_used"] + stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["total_padding_tokens"] == 128 - 40
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats()["kv_blocks_used"] == 0


@pytest.mark.skipif(not cpu_packed_linear_supported(torch.bfloat16, torch.device("cpu")),
                    reason="needs oneDNN's bf16 linear (AVX512-BF16)")
def test_eager_warmup_runs_each_row_count_then_leaves_no_trace(tiny_llama_dir, monkeypatch):
    from ingot.worker.model_runner import ModelRunner

    rows_seen: list[tuple[bool, int]] = []
    original = ModelRunner.prepare_inputs

    def recording(self, so):
        rows_seen.append((so.is_prefill, so.scheduled[0].num_tokens if so.is_prefill
                          else len(so.scheduled)))
        return original(self, so)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", recording)
    monkeypatch.setenv("INGOT_CPU_GEMM", "0")  # bf16 linears on oneDNN's packed kernels
    llm = _llm(tiny_llama_dir, max_num_batched_tokens=512, dtype="bfloat16")
    runner = _runner(llm)
    grid = runner.grid
    # One dummy step per prefill bucket (from position 0) and per decode batch bucket.
    assert sorted(n for prefill, n in rows_seen if prefill) == list(grid.num_batched_tokens_buckets)
    assert sorted(n for prefill, n in rows_seen if not prefill) == list(grid.num_seqs_buckets)
    assert llm.llm_engine.startup_stats()["warmup_seconds"] > 0
    # No trace: the null block is zero again and no bucket counted an execution.
    assert all(bool((cache[:, 0] == 0).all()) for cache in runner.kv_caches)
    stats = llm.llm_engine.get_stats()["buckets"]
    assert stats == type(stats).for_grid(grid)


def test_no_warmup_without_onednn_linears(tiny_llama_dir, monkeypatch):
    """float32 linears run MKL's GEMM or oneDNN's float32 kernels (and bf16 ones ingot's GEMM
    on CPUs without AMX), which build nothing or little per shape: no dummy step runs. Broken
    twin, on every CPU: the same engine told that a linear runs oneDNN's packed bf16 kernels
    warms up (the real oneDNN case is test_eager_warmup_runs_each_row_count_then_leaves_no_trace,
    where the CPU has them)."""
    from ingot.worker.execution import select
    from ingot.worker.model_runner import ModelRunner

    steps: list[int] = []
    original = ModelRunner.prepare_inputs

    def recording(self, so):
        steps.append(1)
        return original(self, so)

    monkeypatch.setattr(ModelRunner, "prepare_inputs", recording)
    llm = _llm(tiny_llama_dir)
    assert steps == [] and llm.llm_engine.startup_stats()["warmup_seconds"] == 0
    del llm
    monkeypatch.setattr(select, "runs_onednn_linears", lambda model: True)
    llm = _llm(tiny_llama_dir)
    assert steps and llm.llm_engine.startup_stats()["warmup_seconds"] > 0
