"""StepProfiler's state machine with the real torch.profiler: each simulated forward step runs
inside a ``record_function("fwdN")`` range, so the trace shows exactly which steps it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ingot.config import ProfilerConfig
from ingot.worker.profiler import StepProfiler


def _forward(i: int) -> None:
    with torch.profiler.record_function(f"fwd{i}"):
        torch.ones(4, 4) @ torch.ones(4, 4)


def _run(profiler: StepProfiler, steps: range) -> None:
    """What the worker does: a forward, then profiler.step()."""
    for i in steps:
        _forward(i)
        profiler.step()


def _recorded_steps(path: Path) -> list[int]:
    events = json.loads(path.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    return sorted(int(n[3:]) for n in names if n.startswith("fwd") and n[3:].isdigit())


def _traces(root: Path) -> list[Path]:
    return sorted(root.glob("*/rank*.trace.json"))


def test_starts_after_n_steps_and_stops_after_m(tmp_path):
    p = StepProfiler(ProfilerConfig(output_dir=str(tmp_path), delay_iterations=2,
                                    max_iterations=3))
    p.start()
    _run(p, range(8))
    assert not p.active
    (trace,) = _traces(tmp_path)
    assert _recorded_steps(trace) == [2, 3, 4]  # skips exactly 2, records exactly 3
    # The automatic stop's trace is reported by the next stop(), once.
    assert p.stop() == trace
    assert p.stop() is None


def test_no_delay_records_until_stopped(tmp_path):
    p = StepProfiler(ProfilerConfig(output_dir=str(tmp_path)))
    _forward(99)  # before start: not recorded
    p.start()
    assert p.active
    _run(p, range(5))
    path = p.stop()
    assert path is not None and path.name == "rank0.trace.json"
    assert _recorded_steps(path) == [0, 1, 2, 3, 4]


def test_two_cycles_give_two_directories(tmp_path):
    p = StepProfiler(ProfilerConfig(output_dir=str(tmp_path)))
    paths = []
    for cycle in range(2):
        p.start()
        _run(p, range(cycle * 10, cycle * 10 + 2))
        paths.append(p.stop())
    assert paths[0].parent != paths[1].parent
    assert _traces(tmp_path) == sorted(paths)
    assert _recorded_steps(paths[0]) == [0, 1] and _recorded_steps(paths[1]) == [10, 11]


def test_stop_during_delay_writes_nothing(tmp_path):
    p = StepProfiler(ProfilerConfig(output_dir=str(tmp_path), delay_iterations=5))
    p.start()
    _run(p, range(3))
    assert not p.active
    assert p.stop() is None
    assert _traces(tmp_path) == []
    p.start()  # the machine is reusable after an empty cycle
    assert not p.active


def test_only_selected_ranks_write(tmp_path):
    config = ProfilerConfig(output_dir=str(tmp_path), ranks=[1])
    writers = []
    for rank in range(3):
        p = StepProfiler(config, rank=rank)
        p.start()
        _run(p, range(2))
        if p.stop() is not None:
            writers.append(rank)
    assert writers == [1]
    assert [t.name for t in _traces(tmp_path)] == ["rank1.trace.json"]
    # The default selects rank 0 only.
    default = ProfilerConfig(output_dir=str(tmp_path / "d"))
    assert [StepProfiler(default, rank=r).enabled for r in range(3)] == [True, False, False]


def test_start_twice_is_an_error(tmp_path):
    p = StepProfiler(ProfilerConfig(output_dir=str(tmp_path)))
    p.start()
    with pytest.raises(ValueError, match="already running"):
        p.start()
    p.stop()


@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"delay_iterations": -1}, "delay_iterations"),
        ({"max_iterations": "5"}, "max_iterations"),
        ({"ranks": "0"}, "ranks"),
        ({"ranks": [0, -1]}, "ranks"),
        ({"output_dir": 3}, "output_dir"),
        ({"record_shapes": "yes"}, "record_shapes"),
        ({"outdir": "x"}, "unknown profiler option"),
        ([1], "must be an object"),
    ],
)
def test_config_validation(value, fragment):
    with pytest.raises(ValueError, match=fragment):
        ProfilerConfig.from_dict(value)


def test_config_from_additional_config():
    from ingot.engine.arg_utils import EngineArgs

    args = EngineArgs(additional_config='{"profiler": {"delay_iterations": "x"}}')
    with pytest.raises(ValueError, match="profiler.delay_iterations"):
        args.create_engine_config()
