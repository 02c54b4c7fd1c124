"""The teacher-forced logit gate of the quantized-weight tests (issue #33): top-1 agreement and
mean KL over the full vocabulary, from the logits themselves (``record_logits``, the accuracy
toolkit's hook on ``compute_logits``: prompt logprobs carry only the top k, whose truncated KL
would understate the divergence)."""

from __future__ import annotations

import torch

from ingot import LLM, SamplingParams
from ingot.accuracy.ingot_runner import local_worker, record_logits


def window_logits(llm: LLM, windows: list[list[int]]) -> list[torch.Tensor]:
    """float32 logits [len(window), V] of each window fed as a prompt, one request at a time
    (a prefill's rows are then the prompt's)."""
    model = local_worker(llm.llm_engine).model
    probe = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = []
    for window in windows:
        with record_logits(model) as rec:
            llm.generate([{"prompt_token_ids": window}], probe, use_tqdm=False)
        logits = torch.cat(rec.rows)
        assert logits.shape[0] >= len(window)
        out.append(logits[:len(window)])
    return out


def gate_sums(reference: torch.Tensor, got: torch.Tensor) -> tuple[int, float, int]:
    """(positions whose argmax agrees, summed KL(reference || got) in nats, positions).
    log-softmax in float32 a few dozen rows at a time, each row's KL summed in float64: within
    1e-8 of an all-float64 computation (measured), at a fraction of its memory and time."""
    agree = int((reference.argmax(-1) == got.argmax(-1)).sum().item())
    kl = 0.0
    for ref, new in zip(reference.split(64), got.split(64), strict=True):
        ref_lp, new_lp = ref.log_softmax(-1), new.log_softmax(-1)
        kl += (ref_lp.exp() * (ref_lp - new_lp)).sum(-1, dtype=torch.float64).sum().item()
    return agree, kl, reference.shape[0]


def gate(reference: torch.Tensor, got: torch.Tensor) -> tuple[float, float]:
    """(top-1 agreement, mean KL(reference || got) in nats) over the positions (rows)."""
    agree, kl, n = gate_sums(reference, got)
    return agree / n, kl / n
