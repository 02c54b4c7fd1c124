import importlib.util
import re
from pathlib import Path

import pytest

from ingot.benchmarks.workloads import WORKLOADS, prompts_for, result_line

PEER = Path(__file__).resolve().parents[3] / "shared" / "bench" / "vllm_workloads.py"


def _peer_module():
    spec = importlib.util.spec_from_file_location("vllm_workloads", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # defines functions only; vllm is imported inside main()
    return module


def test_same_workloads_and_prompts_as_the_peer():
    peer = _peer_module()
    assert peer.WORKLOADS == WORKLOADS
    for n, inp, _ in WORKLOADS.values():
        assert peer.prompts_for(n, inp) == prompts_for(n, inp)


def test_result_line_format():
    line = result_line("offline", 64, 128, 128, 2.0, 64 * 128)
    assert re.fullmatch(
        r"RESULT workload=offline engine=ingot requests=64 input_len=128 output_len=128 "
        r"time_s=2\.000 output_tok_s=4096\.0 total_tok_s=8192\.0",
        line,
    )


def test_decode_rate_counts_the_tokens_after_the_first():
    from types import SimpleNamespace

    from ingot.benchmarks.workloads import decode_rate
    from ingot.engine.outputs import RequestMetrics

    def result(first, last, n):
        metrics = RequestMetrics(arrival_time=0.0, first_token_time=first, finished_time=last)
        return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=[0] * n)])

    assert decode_rate([result(1.0, 3.0, 129)]) == " decode_tok_s=64.0"
    assert decode_rate([result(1.0, 3.0, 129)] * 2) == ""  # several streams: no one rate
    assert decode_rate([result(None, 3.0, 129)]) == ""
    assert decode_rate([result(1.0, 3.0, 1)]) == ""


def test_contention_runs_competitors_and_stops_them_on_error():
    from ingot.benchmarks.contend import contention

    procs = []
    with pytest.raises(RuntimeError, match="workload failed"):
        with contention(2) as running:
            procs = list(running)
            assert len(procs) == 2 and all(p.poll() is None for p in procs)
            raise RuntimeError("workload failed")
    assert all(p.returncode is not None for p in procs)


@pytest.mark.parametrize("n", [-1, 1.5, True])
def test_contend_rejects_bad_counts(n):
    from ingot.benchmarks.contend import contention

    with pytest.raises(ValueError, match="--contend must be 0 or a positive number"):
        with contention(n):
            pass
