"""Pooling: one output per request from its prompt's hidden states (a pooling runner's
replacement for logits and sampling).

Per step the runner hands over the hidden states and, per scheduled request, where its segment
lies; the pooler reduces each segment (MEAN: a float32 sum, CLS: the first prompt token, LAST:
the segment's last token) and keeps the running result, so a prompt chunked over several
steps pools exactly as in one step: mean pooling accumulates across chunks, last-token pooling
takes the final chunk's last token. When a request's last segment has run, its vector is
finished: embeddings are cut to ``dimensions`` and L2-normalised; classifiers run the model's
head (``model.classify``) and an activation (softmax, or sigmoid for one label).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F


@dataclass
class PoolingSegment:
    """One request's tokens in this step's hidden states."""

    req_id: str
    first_row: int
    num_rows: int
    start_position: int  # 0: the segment holds the prompt's first token
    final: bool  # the segment ends the prompt: the request's output is due


@dataclass
class _Pending:
    task: str
    normalize: bool
    dimensions: int | None
    activation: bool
    acc: torch.Tensor | None = None  # MEAN: running sum; CLS / LAST: the chosen row
    count: int = 0


def classification_activation(config: Any) -> str:
    """HF's reading of a classifier's outputs: "sigmoid" (one label, multi-label), "identity"
    (regression) or "softmax"."""
    problem = getattr(config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or int(getattr(config, "num_labels", 2)) == 1:
        return "sigmoid"
    return "softmax"


class Pooler:
    def __init__(self, pooling_type: str, model: Any) -> None:
        if pooling_type not in ("MEAN", "CLS", "LAST"):
            raise ValueError(f"pooling_type {pooling_type!r} is not MEAN, CLS or LAST")
        self.pooling_type = pooling_type
        self.model = model
        self.activation = classification_activation(getattr(model, "config", None))
        self.pending: dict[str, _Pending] = {}

    def add_request(
        self, req_id: str, task: str, normalize: bool, dimensions: int | None, activation: bool
    ) -> None:
        if task in ("classify", "score") and not hasattr(self.model, "classify"):
            raise ValueError(f"task {task!r} needs a classification model")
        self.pending[req_id] = _Pending(task, normalize, dimensions, activation)

    def remove_request(self, req_id: str) -> None:
        self.pending.pop(req_id, None)

    def __call__(
        self, hidden: torch.Tensor, segments: list[PoolingSegment]
    ) -> dict[str, list[float]]:
        """Reduce this step's segments; returns the finished requests' outputs."""
        if not segments:
            return {}
        device = hidden.device
        firsts = torch.tensor([s.first_row for s in segments], device=device)
        counts = torch.tensor([s.num_rows for s in segments], device=device)
        if self.pooling_type == "MEAN":
            # One sum per segment over its rows in place: each depends on its own rows only
            # (batched == alone), and index_add_ over a gathered copy cost one small op per row.
            reduced = torch.stack([hidden[s.first_row : s.first_row + s.num_rows].sum(0, dtype=torch.float32)
                                   for s in segments])
        elif self.pooling_type == "CLS":
            reduced = hidden[firsts].float()
        else:
            reduced = hidden[firsts + counts - 1].float()
        done: list[tuple[str, _Pending, torch.Tensor]] = []
        for i, seg in enumerate(segments):
            p = self.pending[seg.req_id]
            if self.pooling_type == "MEAN":
                p.acc = reduced[i] if p.acc is None else p.acc + reduced[i]
                p.count += seg.num_rows
            elif self.pooling_type == "LAST" or seg.start_position == 0:
                p.acc = reduced[i]  # LAST: each later chunk replaces it; CLS: the first row
            if seg.final:
                assert p.acc is not None
                done.append((seg.req_id, p, p.acc / p.count if self.pooling_type == "MEAN" else p.acc))
        if not done:
            return {}
        return self._finish(done)

    def _finish(self, done: list[tuple[str, _Pending, torch.Tensor]]) -> dict[str, list[float]]:
        results: dict[str, list[float]] = {}
        heads = [(rid, p, v) for rid, p, v in done if p.task in ("classify", "score")]
        if heads:
            pooled = torch.stack([v for _, _, v in heads])
            dtype = next(self.model.parameters()).dtype
            logits = self.model.classify(pooled.to(dtype)).float()
            for (rid, p, _), row in zip(heads, logits, strict=True):
                results[rid] = self._activate(row, p.activation).tolist()
        for rid, p, vec in done:
            if p.task in ("classify", "score"):
                continue
            if p.dimensions is not None:
                vec = vec[: p.dimensions]
            if p.normalize:
                vec = F.normalize(vec, p=2, dim=-1)
            results[rid] = vec.tolist()
            self.pending.pop(rid, None)
        for rid, _, _ in heads:
            self.pending.pop(rid, None)
        return results

    def _activate(self, logits: torch.Tensor, on: bool) -> torch.Tensor:
        if not on or self.activation == "identity":
            return logits
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return torch.softmax(logits, dim=-1)
