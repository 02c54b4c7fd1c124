"""Tensor replacement: teacher forcing at module level (spec §6).

Chosen ingot modules get their output overwritten, row by row, with the reference's output at
the same absolute position. If the errors downstream of a module vanish once its output is
replaced, the error originated in that module; if a later module still fails with clean
inputs, it has a bug of its own (the error is not inherited).

The reference is a capture (normally HF fp32, one forward over the whole sequence) or a plain
``{module name: tensor [positions, ...]}``. Rows are keyed by position, so this is for runs of
one request at a time whose fed tokens follow the reference sequence; rows whose token differs
from the reference at that position are left alone (their context is not the reference's).

The replaced value is written in the module's native output format:

* decoder layer ``(mlp_out, residual)`` -> ``(reference, 0)``: the next norm adds them, so the
  hidden state it sees is exactly the reference layer output;
* norm ``(normed, residual)`` -> ``(reference, residual)``;
* a tensor -> the reference; another tuple -> its first item replaced.

Register replacement before any capture of the same modules so the capture records the
replaced values (forward hooks run in registration order, each seeing the previous result).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ingot.accuracy.capture import Capture, is_decoder_layer, load_capture, match_names

logger = logging.getLogger("ingot")


def reference_from_capture(
    capture: str | Path | Capture, modules: Sequence[str]
) -> tuple[dict[str, torch.Tensor], dict[int, int]]:
    """({module: tensor [max_position + 1, ...]}, {position: token id}) from a capture whose
    steps together cover positions 0..S-1 (an HF capture has them all in one step)."""
    cap = capture if isinstance(capture, Capture) else load_capture(capture)
    names = match_names(cap.modules, modules)
    if not names:
        raise ValueError(f"the capture at {cap.path} holds none of {list(modules)}")
    tokens: dict[int, int] = {}
    for step in cap.steps:
        tokens.update(zip(step.positions, step.meta["input_ids"], strict=True))
    length = max(tokens) + 1
    out: dict[str, torch.Tensor] = {}
    for name in names:
        table: torch.Tensor | None = None
        for step in cap.steps:
            if name not in step.meta["modules"]:
                continue
            t = step.tensor(name)
            if table is None:
                table = t.new_zeros((length, *t.shape[1:]))
            table[torch.tensor(step.positions)] = t
        if table is not None:
            out[name] = table
    return out, tokens


class TensorReplacer:
    """Forward hooks that overwrite the outputs of ``reference``'s modules in an ingot model."""

    def __init__(
        self,
        model: nn.Module,
        reference: dict[str, torch.Tensor],
        reference_tokens: dict[int, int] | None = None,
    ) -> None:
        model = getattr(model, "_orig_mod", model)
        modules = dict(model.named_modules())
        unknown = [n for n in reference if n not in modules]
        if unknown:
            raise ValueError(f"no ingot module named {unknown[0]!r} to replace")
        self.reference = reference
        self.reference_tokens = reference_tokens
        self.replaced_rows = 0
        self._rows: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        self._warned = False
        self._handles = [model.register_forward_pre_hook(self._pre_forward, with_kwargs=True)]
        for name in reference:
            self._handles.append(modules[name].register_forward_hook(self._make_hook(name)))

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        input_ids, positions, _, meta = (list(args) + [None] * 4)[:4]
        input_ids = kwargs.get("input_ids", input_ids)
        positions = kwargs.get("positions", positions)
        meta = kwargs.get("meta", meta)
        n = int(input_ids.shape[0])
        rows = torch.nonzero(meta.slot_mapping[:n] >= 0).flatten()
        pos = positions[rows]
        length = next(iter(self.reference.values())).shape[0]
        keep = pos < length
        if self.reference_tokens is not None:
            ids = input_ids[rows].tolist()
            same = [
                self.reference_tokens.get(int(p)) == t
                for p, t in zip(pos.tolist(), ids, strict=True)
            ]
            keep &= torch.tensor(same, dtype=torch.bool, device=keep.device)
        if not bool(keep.all()) and not self._warned:
            logger.warning("tensor replacement: rows off the reference sequence are left alone")
            self._warned = True
        self._rows, self._positions = rows[keep], pos[keep]

    def _make_hook(self, name: str):  # noqa: ANN202
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            rows, positions = self._rows, self._positions
            if rows is None or rows.numel() == 0:
                return None
            ref = self.reference[name]
            first = output[0] if isinstance(output, tuple) else output
            values = ref[positions.to(ref.device)].to(device=first.device, dtype=first.dtype)
            new_first = first.clone()
            new_first[rows] = values
            self.replaced_rows += int(rows.numel())
            if not isinstance(output, tuple):
                return new_first
            if is_decoder_layer(name, module):
                residual = output[1].clone()
                residual[rows] = 0  # the next norm adds residual + hidden: make it the reference
                return (new_first, residual, *output[2:])
            return (new_first, *output[1:])

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> TensorReplacer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


@contextlib.contextmanager
def replace_modules(
    llm_or_model: Any, reference: str | Path | Capture, modules: Sequence[str]
) -> Iterator[TensorReplacer]:
    """Replace the outputs of ``modules`` (names or globs) of an ``ingot.LLM`` (or its model)
    with a reference capture while the block is active."""
    model = llm_or_model
    if hasattr(llm_or_model, "llm_engine"):
        from ingot.accuracy.ingot_runner import local_worker

        model = local_worker(llm_or_model.llm_engine).model
    tensors, tokens = reference_from_capture(reference, modules)
    replacer = TensorReplacer(model, tensors, tokens)
    try:
        yield replacer
    finally:
        replacer.remove()
