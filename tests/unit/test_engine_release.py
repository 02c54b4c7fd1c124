"""An LLM dropped without shutdown() lets its worker go: model, KV cache and compute thread
(a notebook or a test that builds engine after engine must not keep every one of them; each
default-model engine holds about 0.7 GB)."""

from __future__ import annotations

import gc
import threading
import weakref

from ingot import LLM, SamplingParams
from ingot.accuracy.ingot_runner import local_worker


def _device_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "ingot-device" and t.is_alive()}


def _build(model_dir) -> tuple[LLM, weakref.ref]:  # noqa: ANN001
    llm = LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True, max_model_len=64,
              block_size=4)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))
    return llm, weakref.ref(local_worker(llm.llm_engine))


def test_a_dropped_llm_releases_its_worker_and_thread(tiny_llama_dir):
    gc.collect()  # engines earlier tests dropped go first
    before = _device_threads()
    llm, worker = _build(tiny_llama_dir)
    (thread,) = _device_threads() - before  # this engine's compute thread
    assert worker() is not None
    del llm
    gc.collect()
    thread.join(timeout=10)  # it ends after its queue's last call: moments
    assert not thread.is_alive()
    gc.collect()
    assert worker() is None


def test_twin_an_engine_still_referenced_keeps_its_worker(tiny_llama_dir):
    """Broken twin: the same check while something still holds the engine must fail."""
    llm, worker = _build(tiny_llama_dir)
    engine = llm.llm_engine
    del llm
    gc.collect()
    try:
        assert worker() is not None  # the check above would fail here
    finally:
        engine.shutdown()
