"""Fault injection for the broken twins of the whole-engine equality gates (issue #34).

Each fault patches one of ingot's real code paths so that the engine side goes wrong in the way
a gate exists to catch; a twin runs the gate's own comparison under the fault and requires it
to fail. Nothing in ``src`` knows about these faults.

- In the test's process: ``with injected("weight", name="layers.0.mlp.down_proj"): ...``
  (the patches are undone on exit).
- In child processes (TP ranks, ``ingot serve``): ``child_env("stream_drops_a_chunk")`` is an
  environment in which every Python process installs the fault at start-up (``faults_site/
  sitecustomize.py`` on PYTHONPATH reads ``INGOT_TEST_FAULT``); ``injected_in_children`` sets
  the same variables on this process, for children an in-process ``LLM`` spawns.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

ENV = "INGOT_TEST_FAULT"
_SITE = Path(__file__).parent / "faults_site"

FAULTS: dict[str, Callable[..., None]] = {}


def _fault(fn: Callable[..., None]) -> Callable[..., None]:
    FAULTS[fn.__name__] = fn
    return fn


def _direction(width: int, dtype: torch.dtype) -> torch.Tensor:
    """A fixed random direction (seeded: every rank and every run perturbs the same way)."""
    return torch.randn(width, generator=torch.Generator().manual_seed(0)).to(dtype)


@_fault
def weight(mp: pytest.MonkeyPatch, name: str, scale: float = 0.5, rank: int | None = None) -> None:
    """The first checkpoint tensor whose name contains ``name`` gets noise of ``scale`` times its
    mean magnitude as it is loaded (before sharding and packing), in the worker of global rank
    ``rank`` (dp rank x TP + tp rank) only when given: a wrong weight, or one rank's shard (one
    replica's copy) gone wrong."""
    from ingot.model_executor.loader import model_loader
    from ingot.worker.worker import Worker

    load = model_loader.iter_checkpoint
    init = Worker.__init__
    loading: list[int] = []  # the global rank of the worker being built in this process

    def tracked(self: Worker, config: Any, rank: int = 0, *args: Any, **kwargs: Any) -> None:
        loading.append(config.parallel_config.global_rank(rank))
        try:
            init(self, config, rank, *args, **kwargs)
        finally:
            loading.pop()

    def perturbed(model_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
        hit = rank is not None and loading[-1:] != [rank]
        for tensor_name, t in load(model_config):
            if not hit and name in tensor_name and not isinstance(t, torch.Tensor):
                # A kept-quantized block (--quantization gguf) has no float values to perturb.
                raise TypeError(f"{tensor_name!r} is kept quantized: build the engine with "
                                "quantization='none' to perturb it")
            if not hit and name in tensor_name and t.is_floating_point():
                hit = True
                noise = torch.randn(t.shape, generator=torch.Generator().manual_seed(0))
                t = (t.float() + scale * t.float().abs().mean() * noise).to(t.dtype)
            yield tensor_name, t
        if not hit:  # a fault that perturbs nothing would let its twin test nothing
            raise LookupError(f"no checkpoint tensor's name contains {name!r}")

    mp.setattr(Worker, "__init__", tracked)
    mp.setattr(model_loader, "iter_checkpoint", perturbed)


@_fault
def gguf_dequant_wrong(mp: pytest.MonkeyPatch, nth: int = 3, scale: float = 0.5) -> None:
    """The ``nth`` tensor a GGUF file dequantises gets noise of ``scale`` times its mean
    magnitude (one tensor's dequantisation wrong)."""
    import numpy as np

    from ingot.model_executor.loader import gguf_loader

    dequantize = gguf_loader.dequantize
    calls: list[None] = []

    def wrong(raw: Any, qtype: Any) -> Any:
        out = dequantize(raw, qtype)
        calls.append(None)
        if len(calls) == nth:
            noise = np.random.default_rng(0).standard_normal(out.shape)
            out = (out + scale * np.abs(out).mean() * noise).astype(out.dtype)
        return out

    mp.setattr(gguf_loader, "dequantize", wrong)


@_fault
def quant_shard_swapped(mp: pytest.MonkeyPatch) -> None:
    """A row-parallel rank's GGUF blocks kept quantized are the next rank's columns (the wrong
    input shard of every such weight)."""
    from ingot.model_executor.layers.quantized import QuantizedWeight

    shard = QuantizedWeight.column_shard

    def swapped(self: QuantizedWeight, index: int, num_shards: int) -> QuantizedWeight:
        return shard(self, (index + 1) % num_shards, num_shards)

    mp.setattr(QuantizedWeight, "column_shard", swapped)


@_fault
def batch_dependent(mp: pytest.MonkeyPatch, alpha: float = 0.05) -> None:
    """A row's hidden state before the LM head moves by ``alpha`` x (rows sampled - 1) along a
    fixed direction: alone it is exact, in a batch it depends on its neighbours' count."""
    from ingot.worker.model_runner import ModelRunner

    sample = ModelRunner._sample

    def biased(self: ModelRunner, hidden: torch.Tensor, so: Any, sample_rows: list[int],
               *rest: Any) -> Any:
        if len(sample_rows) > 1:
            hidden = hidden.clone()
            hidden[sample_rows] += alpha * (len(sample_rows) - 1) * _direction(
                hidden.shape[-1], hidden.dtype)
        return sample(self, hidden, so, sample_rows, *rest)

    mp.setattr(ModelRunner, "_sample", biased)


@_fault
def padding_dependent(mp: pytest.MonkeyPatch, alpha: float = 0.05) -> None:
    """A step's sampled rows move by ``alpha`` x (padding rows in the step) along a fixed
    direction: padding to a bucket changes real rows (without buckets there is none)."""
    from ingot.worker.model_runner import ModelRunner

    sample = ModelRunner._sample

    def leaky(self: ModelRunner, hidden: torch.Tensor, so: Any, sample_rows: list[int],
              *rest: Any) -> Any:
        padding = hidden.shape[0] - sum(it.num_tokens for it in so.scheduled)
        if padding > 0:
            hidden = hidden.clone()
            hidden[sample_rows] += alpha * padding * _direction(hidden.shape[-1], hidden.dtype)
        return sample(self, hidden, so, sample_rows, *rest)

    mp.setattr(ModelRunner, "_sample", leaky)


@_fault
def compiled_only(mp: pytest.MonkeyPatch, alpha: float = 0.5) -> None:
    """The compiled program's hidden states move by ``alpha`` along a fixed direction; the
    eager program is untouched (a miscompiled graph)."""
    from ingot.worker.execution.compiled import CompiledProgram
    from ingot.worker.execution.program import EagerProgram

    def forward(self: CompiledProgram, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = EagerProgram.forward(self, *args, **kwargs)
        return out + alpha * _direction(out.shape[-1], out.dtype)

    mp.setattr(CompiledProgram, "forward", forward, raising=False)


@_fault
def prefix_cache_skips_a_block(mp: pytest.MonkeyPatch) -> None:
    """A prefix-cache hit whose last block is not the cached one: the hit counts its tokens as
    computed, but the block table holds a fresh block nobody wrote."""
    from ingot.core.kv_cache_manager import KVCacheManager

    admit = KVCacheManager.admit

    def skipping(self: KVCacheManager, request_id: str, prompt_token_ids: Any = (),
                 salt: bytes = b"") -> int:
        hit = admit(self, request_id, prompt_token_ids, salt)
        blocks = self.req_blocks[request_id]
        if hit:
            (fresh,) = self.pool.allocate(1)  # before the release: never the same block back
            self.pool.free([blocks[-1]])
            blocks[-1] = fresh
        return hit

    mp.setattr(KVCacheManager, "admit", skipping)


@_fault
def accepts_a_wrong_draft(mp: pytest.MonkeyPatch) -> None:
    """The first verification that rejects a draft emits that draft instead of the target's
    token (one wrong draft accepted)."""
    from ingot.model_executor.layers.rejection_sampler import RejectionSampler

    verify = RejectionSampler.__call__
    done: list[bool] = []

    def accepting(self: RejectionSampler, logits: torch.Tensor, metadata: Any, spec: Any) -> Any:
        out = verify(self, logits, metadata, spec)
        offset = 0
        drafts = spec.draft_token_ids.tolist()
        for i, (d, a) in enumerate(zip(spec.num_draft_tokens, out.num_accepted, strict=True)):
            if not done and a < d:
                out.token_ids[i][-1] = drafts[offset + a]
                out.num_accepted[i] = a + 1
                done.append(True)
            offset += d
        return out

    mp.setattr(RejectionSampler, "__call__", accepting)


@_fault
def stream_drops_a_chunk(mp: pytest.MonkeyPatch) -> None:
    """Each completion and chat stream loses its second server-sent event."""
    from ingot.entrypoints.openai.serving import OpenAIServing

    def dropping(stream: Callable[..., Any]) -> Callable[..., Any]:
        async def gen(self: OpenAIServing, *args: Any, **kwargs: Any) -> Any:
            n = 0
            async for event in stream(self, *args, **kwargs):
                n += 1
                if n != 2:
                    yield event

        return gen

    for name in ("completion_stream", "chat_stream"):
        mp.setattr(OpenAIServing, name, dropping(getattr(OpenAIServing, name)))


@_fault
def classifier_softmax_wrong_dim(mp: pytest.MonkeyPatch) -> None:
    """The classifier's softmax taken over a singleton dim (every probability 1.0)."""
    from ingot.model_executor.layers.pooler import Pooler

    activate = Pooler._activate

    def wrong(self: Pooler, logits: torch.Tensor, on: bool) -> torch.Tensor:
        if on and self.activation == "softmax":
            return torch.softmax(logits.unsqueeze(-1), dim=-1).squeeze(-1)
        return activate(self, logits, on)

    mp.setattr(Pooler, "_activate", wrong)


@_fault
def cpu_without_bf16(mp: pytest.MonkeyPatch) -> None:
    """Not a fault but the same plumbing: the platform sees this CPU's flags less every bf16
    one (an AMD EPYC's AVX2 + FMA), so its dtype rules decide as they do on a CPU without bf16
    arithmetic; what the kernels' builds run is untouched (tests cap that with
    ``INGOT_CPU_ISA``)."""
    from ingot.platforms import cpu

    flags = cpu._cpu_flags() - cpu._BF16_FLAGS
    mp.setattr(cpu, "_cpu_flags", lambda: flags)


@contextmanager
def injected(fault: str, **params: Any) -> Iterator[None]:
    """The fault named ``fault`` in this process for the duration of the block."""
    with pytest.MonkeyPatch.context() as mp:
        FAULTS[fault](mp, **params)
        yield


@contextmanager
def fails() -> Iterator[None]:
    """The gate's comparison inside must fail (an AssertionError); what it said is printed, so
    `pytest -rP -k twin` shows each twin's failure."""
    with pytest.raises(AssertionError) as failure:
        yield
    print(f"the gate failed as it must: {str(failure.value).splitlines()[0][:300]}")


def child_env(fault: str, **params: Any) -> dict[str, str]:
    """This process's environment plus what makes a child process install ``fault``."""
    env = dict(os.environ)
    env.update(_child_vars(fault, params, env.get("PYTHONPATH")))
    return env


@contextmanager
def injected_in_children(fault: str, **params: Any) -> Iterator[None]:
    """Child processes started during the block (spawned TP ranks) install ``fault``."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in _child_vars(fault, params, os.environ.get("PYTHONPATH")).items():
            mp.setenv(key, value)
        yield


def _child_vars(fault: str, params: dict[str, Any], pythonpath: str | None) -> dict[str, str]:
    if fault not in FAULTS:
        raise KeyError(f"no fault named {fault!r}: {sorted(FAULTS)}")
    paths = [str(_SITE), *([pythonpath] if pythonpath else [])]
    return {ENV: json.dumps({"name": fault, "params": params}), "PYTHONPATH": os.pathsep.join(paths)}


def install_from_env() -> None:
    """Install the fault ``INGOT_TEST_FAULT`` names, for good (the child's whole life)."""
    spec = json.loads(os.environ[ENV])
    FAULTS[spec["name"]](pytest.MonkeyPatch(), **spec["params"])
