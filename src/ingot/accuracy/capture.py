"""Tensor capture: forward hooks on named modules, written to disk step by step.

Works on an ingot model (inside a running ``LLM``) and on the HF transformers reference, under
one naming scheme, ingot's. HF's separate q/k/v and gate/up projections appear under ingot's
fused names (``self_attn.qkv_proj``, ``mlp.gate_up_proj``) as the concatenation of their outputs,
so both captures of the same model align name for name.

Every captured tensor is *canonical*: only real token rows (ingot's bucket padding is dropped,
HF's batch dimension of 1 is squeezed), and the hidden state a module hands on:

* a decoder layer: ingot returns ``(mlp_out, residual)`` with the residual add deferred to the
  next norm; the capture stores ``mlp_out + residual``, which is HF's layer output;
* a norm with a fused residual add returns ``(normed, residual)``: the capture stores ``normed``;
* any other tuple (HF attention's ``(out, weights)``, ingot rotary's ``(q, k)``): the first item.

Hooks must be registered before the model is compiled or warmed up: Dynamo traces hooks that
exist when it compiles and would recompile (or miss them) otherwise. The engine runs eager
today; :func:`capture_ingot` is the place that would have to hook before compilation.

On-disk layout (``format_version`` 1)::

    capture_dir/
      index.json                 {"format_version", "source", "patterns", "modules": [names in
                                  execution order], "steps": [step dirs], "metadata": {...}}
      step_0000_prefill/
        meta.json                {"step", "phase", "num_real_tokens", "num_padded_tokens",
                                  "positions": [per real row], "input_ids": [per real row],
                                  "req_ids": [per real row],
                                  "modules": {name: {"file", "dtype", "shape"}}}
        model.layers.0.self_attn.pt   one tensor [num_real_tokens, ...] (torch.save)
      step_0001_decode/
        ...

``step`` counts model forwards since the capture was installed (captured or not), so a step
filter ``steps={0, 3}`` means the first and fourth forward.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

logger = logging.getLogger("ingot")

FORMAT_VERSION = 1

# The default module set: enough to localise a bug to one module of one layer.
DEFAULT_PATTERNS = (
    "model.embed_tokens",
    "model.layers.*.input_layernorm",
    "model.layers.*.self_attn",
    "model.layers.*.post_attention_layernorm",
    "model.layers.*.mlp",
    "model.layers.*",
    "model.norm",
)

# ingot fused module (suffix) -> the HF modules whose outputs it concatenates (last dim)
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

_RANGE = re.compile(r"(\d+)-(\d+)")


def expand_patterns(patterns: Iterable[str]) -> list[str]:
    """Expand numeric ranges: ``model.layers.0-2.mlp`` -> three patterns, one per layer."""
    out: list[str] = []
    for pattern in patterns:
        parts = pattern.split(".")
        expanded = [[]]  # type: list[list[str]]
        for part in parts:
            m = _RANGE.fullmatch(part)
            options = [str(i) for i in range(int(m[1]), int(m[2]) + 1)] if m else [part]
            if m and int(m[1]) > int(m[2]):
                raise ValueError(f"empty layer range {part!r} in module pattern {pattern!r}")
            expanded = [prefix + [o] for prefix in expanded for o in options]
        out.extend(".".join(p) for p in expanded)
    return out


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """Glob over dotted names: ``*`` stays within one name component, ``**`` crosses dots,
    ``?`` is one character; the whole name must match."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif pattern[i] == "?":
            out.append(r"[^.]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def match_names(names: Iterable[str], patterns: Iterable[str]) -> list[str]:
    """Names (in their given order) matched by any of the patterns."""
    regexes = [pattern_regex(p) for p in expand_patterns(patterns)]
    return [n for n in names if n and any(r.fullmatch(n) for r in regexes)]


def _hf_namespace(model: nn.Module) -> dict[str, list[str]]:
    """Canonical (ingot) name -> the HF module names that produce it."""
    names = [n for n, _ in model.named_modules()]
    present = set(names)
    fused_parts = set()
    space: dict[str, list[str]] = {}
    for name in names:
        for fused, parts in FUSED_PARTS.items():
            first = parts[0]
            if name.endswith("." + first):
                prefix = name[: -len(first)]
                members = [prefix + p for p in parts]
                if all(m in present for m in members):
                    space[prefix + fused] = members
                    fused_parts.update(members)
    for name in names:
        if name and name not in fused_parts:
            space.setdefault(name, [name])
    return space


_LAYER_NAME = re.compile(r"(.*\.)?layers\.\d+")


def is_decoder_layer(name: str, module: nn.Module) -> bool:
    """ingot decoder layers return ``(hidden, residual)`` with the residual add deferred."""
    return type(module).__name__.endswith("DecoderLayer") or bool(_LAYER_NAME.fullmatch(name))


def _ingot_canonical(name: str, module: nn.Module, output: Any) -> torch.Tensor:
    if isinstance(output, tuple):
        if is_decoder_layer(name, module):
            # ingot defers the residual add to the next norm; HF's layer output includes it.
            return output[0] + output[1]
        return output[0]
    return output


def _hf_canonical(output: Any) -> torch.Tensor:
    if isinstance(output, tuple):
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output[0] if output.dim() >= 2 and output.shape[0] == 1 else output


@dataclass
class _Step:
    index: int
    phase: str
    positions: list[int]
    input_ids: list[int]
    req_ids: list[str]
    num_padded: int
    real_rows: torch.Tensor | None  # indices of real rows among the padded ones
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    parts: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)


class TensorCapture:
    """Forward hooks on the modules of ``model`` whose canonical names match ``patterns``.

    ``flavor`` is ``"ingot"`` (inputs are the flattened, bucket-padded batch) or ``"hf"``
    (inputs are [1, S]). Use :func:`capture_ingot` / :func:`capture_hf` rather than this class
    directly. Disk writes happen at the end of each captured step.
    """

    def __init__(
        self,
        model: nn.Module,
        patterns: Sequence[str],
        out_dir: str | Path,
        source: str,
        flavor: str = "ingot",
        steps: Iterable[int] | None = None,
        phases: Iterable[str] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> None:
        if flavor not in ("ingot", "hf"):
            raise ValueError(f"flavor must be 'ingot' or 'hf', got {flavor!r}")
        model = getattr(model, "_orig_mod", model)  # hook the eager module under torch.compile
        self.model = model
        self.flavor = flavor
        self.out_dir = Path(out_dir)
        self.source = source
        self.patterns = list(patterns)
        self.steps = None if steps is None else set(steps)
        self.phases = None if phases is None else set(phases)
        self.metadata = dict(metadata or {})
        self.enabled = True
        self.step_counter = 0
        self.module_order: list[str] = []
        self.step_dirs: list[str] = []
        self._current: _Step | None = None
        self._pending: dict[str, Any] | None = None  # phase / request info from the runner
        self._handles: list[Any] = []

        modules = dict(model.named_modules())
        if flavor == "hf":
            space = _hf_namespace(model)
        else:
            space = {name: [name] for name in modules if name}
        self.names = match_names(space, self.patterns)
        if not self.names:
            raise ValueError(
                f"no module of the {source} model matches {self.patterns}; module names look "
                f"like {', '.join(list(space)[:6])}"
            )
        self._order_done = False
        for name in self.names:
            members = space[name]
            for i, member in enumerate(members):
                part = (i, len(members)) if len(members) > 1 else None
                self._handles.append(
                    modules[member].register_forward_hook(self._make_hook(name, part))
                )
        self._handles.append(model.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self._handles.append(model.register_forward_hook(self._post_forward))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        logger.info("capturing %d modules of %s into %s", len(self.names), source, self.out_dir)

    # ---- step bracketing -------------------------------------------------------------------
    def set_step_info(self, phase: str, req_ids: list[str], tokens_per_req: list[int]) -> None:
        """Called by the runner wrapper before a forward: phase and which request owns rows."""
        self._pending = {"phase": phase, "req_ids": req_ids, "tokens_per_req": tokens_per_req}

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        index = self.step_counter
        self.step_counter += 1
        pending, self._pending = self._pending, None
        if not self.enabled:
            return
        if self.flavor == "hf":
            ids = kwargs.get("input_ids", args[0] if args else None)
            ids = ids[0].tolist()
            positions = list(range(len(ids)))
            phase, real_rows, num_padded = "prefill", None, len(ids)
            req_ids = [self.metadata.get("request_id", "hf")] * len(ids)
        else:
            input_ids, positions_t, _, meta = (list(args) + [None] * 4)[:4]
            input_ids = kwargs.get("input_ids", input_ids)
            positions_t = kwargs.get("positions", positions_t)
            meta = kwargs.get("meta", meta)
            num_padded = int(input_ids.shape[0])
            # Padding rows have slot -1 (an engine invariant): the real rows are the others.
            real_rows = torch.nonzero(meta.slot_mapping[:num_padded] >= 0).flatten()
            positions = positions_t[real_rows].tolist()
            ids = input_ids[real_rows].tolist()
            if pending is not None:
                phase = pending["phase"]
                req_ids = [
                    r
                    for r, n in zip(pending["req_ids"], pending["tokens_per_req"], strict=True)
                    for _ in range(n)
                ]
            else:  # driven without the runner (e.g. a test harness): infer from the shape
                phase = "decode" if meta.is_decode else "prefill"
                req_ids = ["?"] * len(ids)
        if (self.steps is not None and index not in self.steps) or (
            self.phases is not None and phase not in self.phases
        ):
            return
        self._current = _Step(
            index, phase, positions, ids, req_ids[: len(ids)], num_padded, real_rows
        )

    def _make_hook(self, name: str, part: tuple[int, int] | None):  # noqa: ANN202
        """``part`` = (index, count) for one HF member of a fused ingot module."""

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            step = self._current
            if step is None:
                return
            if self.flavor == "hf":
                t = _hf_canonical(output)
            else:
                t = _ingot_canonical(name, module, output)
                if step.real_rows is not None and t.dim() >= 1 and t.shape[0] == step.num_padded:
                    t = t.index_select(0, step.real_rows.to(t.device))
            t = t.detach().clone()
            if part is not None:
                parts = step.parts.setdefault(name, {})
                parts[part[0]] = t
                if len(parts) < part[1]:
                    return
                t = torch.cat([parts[i] for i in range(part[1])], -1)
                del step.parts[name]
            step.tensors[name] = t
            if not self._order_done and name not in self.module_order:
                self.module_order.append(name)

        return hook

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        step, self._current = self._current, None
        if step is None:
            return
        self._write(step)
        self._order_done = True

    def _write(self, step: _Step) -> None:
        dirname = f"step_{step.index:04d}_{step.phase}"
        path = self.out_dir / dirname
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        modules = {}
        for name, t in step.tensors.items():
            fname = f"{name}.pt"
            torch.save(t.cpu().contiguous(), path / fname)
            modules[name] = {
                "file": fname,
                "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape),
            }
        meta = {
            "step": step.index,
            "phase": step.phase,
            "num_real_tokens": len(step.positions),
            "num_padded_tokens": step.num_padded,
            "positions": step.positions,
            "input_ids": step.input_ids,
            "req_ids": step.req_ids,
            "modules": modules,
        }
        (path / "meta.json").write_text(json.dumps(meta))
        self.step_dirs.append(dirname)
        self._write_index()

    def _write_index(self) -> None:
        order = self.module_order + [n for n in self.names if n not in self.module_order]
        index = {
            "format_version": FORMAT_VERSION,
            "source": self.source,
            "patterns": self.patterns,
            "modules": order,
            "steps": self.step_dirs,
            "metadata": self.metadata,
        }
        (self.out_dir / "index.json").write_text(json.dumps(index, indent=1))

    # ---- lifecycle -------------------------------------------------------------------------
    def enable(self) -> None:
        self.enabled = True

    def disable(self) -> None:
        self.enabled = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._write_index()

    def __enter__(self) -> TensorCapture:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


@contextlib.contextmanager
def capture_ingot(
    llm: Any,
    out_dir: str | Path,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    steps: Iterable[int] | None = None,
    phases: Iterable[str] | None = None,
    source: str = "ingot",
) -> Iterator[TensorCapture]:
    """Capture modules of a running ``ingot.LLM`` while the block is active.

    The model runner's ``execute_model`` is wrapped (for the block only) to tell the capture
    each step's phase and which request owns which rows.
    """
    engine = llm.llm_engine
    from ingot.accuracy.ingot_runner import local_worker

    worker = local_worker(engine)
    runner = worker.model_runner
    metadata = {
        "model": engine.model_config.model,
        "dtype": str(engine.model_config.dtype).removeprefix("torch."),
        "hf_overrides": engine.model_config.hf_overrides,
        "flavor": "ingot",
    }
    cap = TensorCapture(worker.model, patterns, out_dir, source, "ingot", steps, phases, metadata)
    original = runner.execute_model

    def execute_model(so: Any) -> Any:
        if not so.is_empty:
            cap.set_step_info(
                "prefill" if so.is_prefill else "decode",
                [it.req_id for it in so.scheduled],
                [it.num_tokens for it in so.scheduled],
            )
        return original(so)

    runner.execute_model = execute_model
    try:
        yield cap
    finally:
        del runner.execute_model
        cap.remove()


@torch.no_grad()
def capture_hf(
    hf_model: nn.Module,
    token_ids: Sequence[int],
    out_dir: str | Path,
    patterns: Sequence[str] = DEFAULT_PATTERNS,
    source: str = "hf",
) -> Path:
    """One HF forward over ``token_ids`` (all positions at once), captured as step 0."""
    dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    metadata = {"flavor": "hf", "dtype": dtype}
    with TensorCapture(hf_model, patterns, out_dir, source, "hf", metadata=metadata):
        hf_model(input_ids=torch.tensor([list(token_ids)]), use_cache=False)
    return Path(out_dir)


# ---- reading captures back ----------------------------------------------------------------
@dataclass
class CapturedStep:
    path: Path
    meta: dict[str, Any]

    @property
    def phase(self) -> str:
        return self.meta["phase"]

    @property
    def positions(self) -> list[int]:
        return self.meta["positions"]

    @property
    def modules(self) -> list[str]:
        return list(self.meta["modules"])

    def tensor(self, name: str) -> torch.Tensor:
        info = self.meta["modules"][name]
        return torch.load(self.path / info["file"], weights_only=True)


@dataclass
class Capture:
    path: Path
    index: dict[str, Any]
    steps: list[CapturedStep]

    @property
    def modules(self) -> list[str]:
        return list(self.index["modules"])

    @property
    def source(self) -> str:
        return self.index["source"]


def load_capture(path: str | Path) -> Capture:
    path = Path(path)
    index_file = path / "index.json"
    if not index_file.exists():
        raise ValueError(f"{path} is not a capture directory (no index.json)")
    index = json.loads(index_file.read_text())
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{path}: capture format {index.get('format_version')} is not {FORMAT_VERSION}"
        )
    steps = []
    for d in index["steps"]:
        meta = json.loads((path / d / "meta.json").read_text())
        steps.append(CapturedStep(path / d, meta))
    return Capture(path, index, steps)
