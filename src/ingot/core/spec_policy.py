"""When a decode step verifies drafts, and what speculation has achieved (its counters).

Speculation pays when the target's verification of ``1 + d`` rows per request costs less
than the extra tokens it yields; on a CPU, where a bigger batch already uses the machine,
the extra rows can make a step slower than the tokens are worth. So the rule is measured, per
decode batch bucket: the output tokens per second of verification steps and of plain decode
steps (exponential moving averages of the steps themselves). A bucket speculates while its
verification rate is at least its decode rate; every ``PROBE_EVERY``-th step of a bucket runs
the other kind, so both rates stay current as acceptance and context lengths change. Before a
bucket has both figures it speculates. ``disable_by_batch_size`` (vLLM's knob) turns it off
above a batch size; ``adaptive: false`` speculates whenever drafts exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: One step in this many (per batch bucket) runs the kind the rule did not choose.
PROBE_EVERY = 16
#: Weight of the newest step in the moving averages.
EMA_WEIGHT = 0.25


@dataclass
class SpecDecodingStats:
    """Running totals, vLLM's spec-decode counters: a draft = one request's drafts in one
    verification step."""

    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1

    def merged(self, others: list[SpecDecodingStats]) -> SpecDecodingStats:
        """These totals plus ``others``' (data-parallel replicas)."""
        total = self.copy()
        for o in others:
            total.num_drafts += o.num_drafts
            total.num_draft_tokens += o.num_draft_tokens
            total.num_accepted_tokens += o.num_accepted_tokens
            total.num_accepted_tokens_per_pos = [
                a + b for a, b in zip(total.num_accepted_tokens_per_pos,
                                      o.num_accepted_tokens_per_pos, strict=True)]
        return total

    def log_line(self, since: SpecDecodingStats | None = None) -> str | None:
        """vLLM's periodic line over the steps since ``since`` (None: since start); None when
        nothing was verified in between."""
        base = since or SpecDecodingStats(self.num_spec_tokens)
        drafts = self.num_drafts - base.num_drafts
        if drafts <= 0:
            return None
        draft_tokens = self.num_draft_tokens - base.num_draft_tokens
        accepted = self.num_accepted_tokens - base.num_accepted_tokens
        per_pos = [(a - b) / drafts for a, b in
                   zip(self.num_accepted_tokens_per_pos, base.num_accepted_tokens_per_pos,
                       strict=True)]
        return (
            f"SpecDecoding metrics: mean acceptance length {1 + accepted / drafts:.2f}, "
            f"accepted {accepted}/{draft_tokens} draft tokens "
            f"({100 * accepted / max(draft_tokens, 1):.1f}%), {drafts} drafts; per-position "
            f"acceptance rate: {', '.join(f'{r:.3f}' for r in per_pos)}"
        )

    def copy(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                                 self.num_accepted_tokens, list(self.num_accepted_tokens_per_pos))

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verified request per step: 1 + accepted drafts (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class _Rates:
    verify: float | None = None  # output tokens per second
    decode: float | None = None
    steps: int = 0


class SpecPolicy:
    def __init__(self, adaptive: bool, disable_by_batch_size: int | None) -> None:
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self._buckets: dict[int, _Rates] = {}

    def _choice(self, rates: _Rates, steps: int) -> bool:
        if rates.verify is None or rates.decode is None:
            # Measure both: the first steps speculate, one in PROBE_EVERY does not.
            return rates.decode is not None or steps % PROBE_EVERY != PROBE_EVERY - 1
        wins = rates.verify >= rates.decode
        return wins != (steps % PROBE_EVERY == PROBE_EVERY - 1)

    def _next(self, num_reqs: int, bucket: int) -> tuple[bool, _Rates | None]:
        """The choice for the bucket's next decode step, and its rates (None: not adaptive
        or over the batch cap, where nothing is counted)."""
        if self.disable_by_batch_size is not None and num_reqs > self.disable_by_batch_size:
            return False, None
        if not self.adaptive:
            return True, None
        rates = self._buckets.setdefault(bucket, _Rates())
        return self._choice(rates, rates.steps), rates

    def speculate(self, num_reqs: int, bucket: int) -> bool:
        """Whether this decode step (of ``num_reqs`` requests, batch bucket ``bucket``)
        verifies drafts; counts the step."""
        choice, rates = self._next(num_reqs, bucket)
        if rates is not None:
            rates.steps += 1
        return choice

    def wants_drafts(self, num_reqs: int, bucket: int) -> bool:
        """Whether the next decode step (assumed the same batch) will verify: drafts are
        proposed only then."""
        return self._next(num_reqs, bucket)[0]

    def observe(self, bucket: int, verified: bool, num_tokens: int, seconds: float) -> None:
        """A decode step of ``bucket`` ran: ``num_tokens`` output tokens in ``seconds``."""
        if seconds <= 0:
            return
        rates = self._buckets.setdefault(bucket, _Rates())
        rate = num_tokens / seconds
        old = rates.verify if verified else rates.decode
        new = rate if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate
        if verified:
            rates.verify = new
        else:
            rates.decode = new
