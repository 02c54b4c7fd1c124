"""Speculative decoding: proposers of draft tokens (the rejection sampler that verifies them is
in model_executor/layers/rejection_sampler.py; the scheduler's per-step policy in
core/spec_policy.py)."""
