"""The per-bucket rule that decides whether a decode step verifies drafts."""

from __future__ import annotations

from ingot.core.spec_policy import PROBE_EVERY, SpecDecodingStats, SpecPolicy


def _run(policy: SpecPolicy, steps: int, verify_rate: float, decode_rate: float) -> list[bool]:
    choices = []
    for _ in range(steps):
        choice = policy.speculate(1, 1)
        choices.append(choice)
        policy.observe(1, choice, int(verify_rate if choice else decode_rate), 1.0)
    return choices


def test_speculation_that_loses_is_stopped_and_probed():
    policy = SpecPolicy(adaptive=True, disable_by_batch_size=None)
    choices = _run(policy, 6 * PROBE_EVERY, verify_rate=30, decode_rate=60)
    late = choices[2 * PROBE_EVERY:]
    # Measured a loss: it decodes plainly, verifying once per PROBE_EVERY steps to re-check.
    assert sum(late) == len(late) // PROBE_EVERY


def test_speculation_that_wins_keeps_going_and_probes_decode():
    policy = SpecPolicy(adaptive=True, disable_by_batch_size=None)
    choices = _run(policy, 6 * PROBE_EVERY, verify_rate=90, decode_rate=60)
    late = choices[2 * PROBE_EVERY:]
    assert len(late) - sum(late) == len(late) // PROBE_EVERY


def test_rates_that_change_change_the_choice():
    policy = SpecPolicy(adaptive=True, disable_by_batch_size=None)
    _run(policy, 4 * PROBE_EVERY, verify_rate=90, decode_rate=60)
    choices = _run(policy, 8 * PROBE_EVERY, verify_rate=20, decode_rate=60)
    assert sum(choices[-4 * PROBE_EVERY:]) == 4  # only the probes verify now


def test_knobs():
    assert not SpecPolicy(True, disable_by_batch_size=4).speculate(5, 8)
    assert not SpecPolicy(False, disable_by_batch_size=4).wants_drafts(5, 8)
    always = SpecPolicy(adaptive=False, disable_by_batch_size=None)
    assert all(_run(always, 40, verify_rate=1, decode_rate=100))


def test_stats_and_log_line():
    stats = SpecDecodingStats(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    assert stats.num_accepted_tokens_per_pos == [1, 1, 0]
    assert stats.mean_acceptance_length == 2.0
    before = stats.copy()
    assert "mean acceptance length 2.00" in stats.log_line()
    assert stats.log_line(before) is None  # nothing new since
    stats.observe(3, 3)
    assert "mean acceptance length 4.00" in stats.log_line(before)
