"""The CPU thread policy (platforms/cpu_threads.py): counts from affinity masks, cgroup quota
files, environment variables and flags; bad values; the adaptive controller on scripted step
times (no timing is measured here)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from ingot.platforms.cpu_threads import (
    AdaptiveThreads,
    CpuBudget,
    parse_cpu_list,
    plan_threads,
    read_cgroup_cpu_quota,
    read_other_cpu_use,
    step_key,
)

TWO = CpuBudget((0, 1))


# ---- CPU lists ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("0-1", [0, 1]), ("0,2", [0, 2]), ("5,2-4", [5, 2, 3, 4]), (" 3 ", [3]), ("0-0", [0])],
)
def test_parse_cpu_list(text: str, cpus: list[int]) -> None:
    assert parse_cpu_list(text, "X") == cpus


@pytest.mark.parametrize(
    ("text", "match"),
    [("a-b", "X='a-b' is not a CPU list"), ("3-1", "empty or negative"), ("", "not a CPU list"),
     ("0,0", "names a CPU twice"), ("1,", "not a CPU list")],
)
def test_parse_cpu_list_rejects(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cpu_list(text, "X")


# ---- cgroup quota files ---------------------------------------------------------------------


def _cgroup(tmp_path: Path, proc_lines: str, files: dict[str, str]) -> tuple[str, str]:
    root = tmp_path / "cg"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    root.mkdir(exist_ok=True)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(proc_lines)
    return str(root), str(proc)


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/box\n", {"box/cpu.max": "150000 100000\n"})
    quota, source = read_cgroup_cpu_quota(root, proc)
    assert quota == 1.5 and source.endswith("box/cpu.max")


def test_cgroup_v2_unlimited_and_parent_limit(tmp_path: Path) -> None:
    # The leaf says "max" but its parent allows one CPU: the parent's limit binds.
    root, proc = _cgroup(tmp_path, "0::/a/b\n", {
        "a/b/cpu.max": "max 100000\n", "a/cpu.max": "50000 50000\n", "cpu.max": "max 100000\n",
    })
    assert read_cgroup_cpu_quota(root, proc)[0] == 1.0


def test_cgroup_v2_no_limit_anywhere(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/a\n", {"a/cpu.max": "max 100000\n"})
    assert read_cgroup_cpu_quota(root, proc) == (None, None)


def test_cgroup_v2_hybrid_unified_mount(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "0::/u\n", {"unified/u/cpu.max": "200000 100000\n"})
    assert read_cgroup_cpu_quota(root, proc)[0] == 2.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    root, proc = _cgroup(tmp_path, "3:cpu,cpuacct:/job\n0::/\n", {
        "cpu,cpuacct/job/cpu.cfs_quota_us": "100000\n",
        "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
    })
    quota, source = read_cgroup_cpu_quota(root, proc)
    assert quota == 1.0 and "job" in source


def test_cgroup_unreadable_means_unlimited(tmp_path: Path) -> None:
    assert read_cgroup_cpu_quota(str(tmp_path / "none"), str(tmp_path / "none")) == (None, None)


@pytest.mark.parametrize("text", ["lots 100000", "100000 x", "1 2 3", ""])
def test_cgroup_v2_malformed_is_an_error(tmp_path: Path, text: str) -> None:
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": text})
    with pytest.raises(ValueError, match="cannot read cgroup CPU quota"):
        read_cgroup_cpu_quota(root, proc)


# ---- the plan -------------------------------------------------------------------------------


def test_default_is_one_thread_per_allowed_cpu() -> None:
    plan = plan_threads(TWO, {})
    assert (plan.threads, plan.bind, plan.adaptive) == (2, None, True)
    assert "one per CPU" in plan.describe() and "affinity 0-1" in plan.describe()


def test_affinity_of_one_cpu_gives_one_thread_not_adaptive() -> None:
    plan = plan_threads(CpuBudget((1,)), {})
    assert (plan.threads, plan.adaptive) == (1, False)


@pytest.mark.parametrize(("quota", "threads"), [(1.5, 1), (1.0, 1), (0.5, 1), (2.0, 2), (8.0, 2)])
def test_quota_rounds_down_and_never_exceeds_affinity(quota: float, threads: int) -> None:
    plan = plan_threads(CpuBudget((0, 1), quota, "x/cpu.max"), {})
    assert plan.threads == threads
    if threads < 2:
        assert plan.source == "the cgroup CPU quota" and "quota 1.5" in CpuBudget(
            (0, 1), 1.5, "x").describe()


def test_omp_num_threads_sets_the_count() -> None:
    assert plan_threads(TWO, {"OMP_NUM_THREADS": "1"}).threads == 1
    assert plan_threads(TWO, {"OMP_NUM_THREADS": "4,2"}).threads == 4  # nested list: 1st level
    assert plan_threads(TWO, {"OMP_NUM_THREADS": ""}).threads == 2  # empty: unset


@pytest.mark.parametrize("value", ["two", "0", "-1", "1.5"])
def test_bad_omp_num_threads_is_a_clear_error(value: str) -> None:
    with pytest.raises(ValueError, match="OMP_NUM_THREADS.*(unset it|at least 1)"):
        plan_threads(TWO, {"OMP_NUM_THREADS": value})


def test_flag_beats_omp_num_threads() -> None:
    plan = plan_threads(TWO, {"OMP_NUM_THREADS": "2"}, cpu_threads=1)
    assert (plan.threads, plan.source) == (1, "--cpu-threads")


@pytest.mark.parametrize("value", [0, -2, "x", True, 1.5])
def test_bad_cpu_threads_flag(value: object) -> None:
    with pytest.raises(ValueError, match="--cpu-threads"):
        plan_threads(TWO, {}, cpu_threads=value)  # type: ignore[arg-type]


def test_vllm_bind_env_list_binds_one_thread_per_cpu() -> None:
    plan = plan_threads(CpuBudget((0, 1, 2)), {"VLLM_CPU_OMP_THREADS_BIND": "0,2",
                                                "OMP_NUM_THREADS": "3"})
    assert (plan.threads, plan.bind) == (2, (0, 2))
    assert "bound to CPUs 0,2" in plan.describe()


@pytest.mark.parametrize("value", ["auto", "nobind"])
def test_vllm_bind_auto_and_nobind_do_not_bind(value: str) -> None:
    plan = plan_threads(TWO, {"VLLM_CPU_OMP_THREADS_BIND": value, "OMP_NUM_THREADS": "1"})
    assert (plan.threads, plan.bind) == (1, None)


def test_bind_flag_beats_env_and_must_match_cpu_threads() -> None:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    assert plan_threads(TWO, env, cpu_threads_bind="1").bind == (1,)
    with pytest.raises(ValueError, match="contradicts --cpu-threads-bind"):
        plan_threads(TWO, {}, cpu_threads=2, cpu_threads_bind="0")


def test_bind_outside_the_affinity_mask_is_an_error() -> None:
    with pytest.raises(ValueError, match="CPU 3 is not one this process may run on \\(0-1\\)"):
        plan_threads(TWO, {}, cpu_threads_bind="0,3")


def test_bind_for_several_workers_is_an_error() -> None:
    with pytest.raises(ValueError, match="one worker"):
        plan_threads(TWO, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_more_threads_than_cpus_is_allowed() -> None:
    # Honoured (the user asked), start_cpu_threads warns; the plan itself just records it.
    plan = plan_threads(CpuBudget((0,)), {"OMP_NUM_THREADS": "2"})
    assert plan.threads == 2 and plan.budget.usable == 1


def test_step_key_is_the_steps_bucket_and_its_computed_rows() -> None:
    class SO:
        def __init__(self, n: int, prefill: bool, padded: int) -> None:
            self.total_num_scheduled_tokens, self.is_prefill, self.num_padded = n, prefill, padded

    # Prefill: the token bucket, however many of its tokens are real (padding is computed).
    assert step_key(SO(97, True, 128)) == step_key(SO(128, True, 128)) == (True, 128, 0)
    # Decode: the batch bucket, and the rows computed in it (a verification step of 2 requests
    # with 1 draft each is 4 rows: not the same cost as a plain decode of 2 in bucket 4).
    assert step_key(SO(3, False, 4)) == (False, 4, 3)
    assert step_key(SO(4, False, 4)) != step_key(SO(2, False, 4))
    # No bucket grid (num_padded 0): the step's own size.
    assert step_key(SO(5, False, 0)) == (False, 5, 5)


# ---- /proc/stat ------------------------------------------------------------------------------


def test_read_other_cpu_use(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  9 9 9 9 9 9 9 9 0 0\n"
                    "cpu0 100 0 50 1000 5 0 0 10 0 0\n"
                    "cpu1 200 0 0 1000 0 0 0 0 0 0\n"
                    "cpu2 999 0 0 0 0 0 0 0 0 0\n")
    self_stat = tmp_path / "self"
    # pid (comm with ) spaces) state ppid ... utime=field 14, stime=field 15
    self_stat.write_text("42 (py thon) x) R " + " ".join(["0"] * 10) + " 70 30 0 0\n")
    busy, mine = read_other_cpu_use((0, 1), str(stat), str(self_stat))
    import os

    hz = os.sysconf("SC_CLK_TCK")
    assert busy == pytest.approx((160 + 200) / hz) and mine == pytest.approx(100 / hz)
    assert read_other_cpu_use((7,), str(stat), str(self_stat)) is None


# ---- the adaptive controller, on scripted times ----------------------------------------------


class Script:
    """A fake machine: step time by thread count, and other processes' CPU use."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others = 0.0  # CPUs others use
        self.busy = self.mine = 0.0
        self.times = {1: 0.024, 2: 0.012}
        self.sets: list[int] = []

    def clock(self) -> float:
        return self.now

    def use(self) -> tuple[float, float]:
        return self.busy, self.mine

    def run(self, ctl: AdaptiveThreads, steps: int, key: object = (False, 1)) -> None:
        for _ in range(steps):
            dt = self.times[ctl.probe.threads if ctl.probe else ctl.current]
            self.now += dt
            self.busy += dt * (self.others + 1)
            self.mine += dt
            ctl.observe(key, dt)


def make(script: Script, **kw: object) -> AdaptiveThreads:
    return AdaptiveThreads(2, set_threads=script.sets.append, clock=script.clock,
                           read_use=script.use, **kw)  # type: ignore[arg-type]


def test_quiet_machine_never_probes() -> None:
    s = Script()
    ctl = make(s)
    s.run(ctl, 500)
    assert ctl.current == 2 and s.sets == [] and ctl.switches == []


def test_competitor_moves_to_fewer_threads_and_back(caplog: pytest.LogCaptureFixture) -> None:
    s = Script()
    ctl = make(s)
    s.run(ctl, 50)
    s.others, s.times = 1.0, {1: 0.024, 2: 0.050}  # one busy process: 2 threads now lose
    with caplog.at_level(logging.INFO, logger="ingot"):
        s.run(ctl, 40)
    assert ctl.current == 1 and ctl.switches[-1][1:3] == (2, 1)
    assert "CPU compute threads 2 -> 1: " in caplog.text  # the reason and both step times
    probes = len(s.sets)
    s.run(ctl, 300)  # still contended: /proc/stat says so, so no costly upward probes
    assert ctl.current == 1 and len(ctl.switches) == 1 and len(s.sets) == probes
    s.others, s.times = 0.0, {1: 0.024, 2: 0.012}
    s.run(ctl, 40)
    assert ctl.current == 2 and ctl.switches[-1][1:3] == (1, 2)
    assert s.sets[-1] == 2


def test_contended_from_the_start_switches_after_two_steps() -> None:
    """The controller samples other processes' CPU use when it is built (start-up), so a
    competitor already running is known at the first step; a probe step at half the time or
    less settles the move (a contended 2-thread prefill step costs seconds: pay it once)."""
    s = Script()
    s.others, s.times = 1.0, {1: 1.0, 2: 10.0}
    s.now = s.busy = 5.0  # warmup: others ran beside it
    ctl = make(s)
    s.busy, s.mine, s.now = 15.0, 5.0, 10.0  # 5 s of warmup: 5 CPU-s others, 5 ingot's
    s.run(ctl, 2, key=(True, 2048, 0))
    assert ctl.current == 1 and ctl.switches[-1][1:3] == (2, 1)
    # Broken twin: a probe step only a little faster still needs its three samples.
    s2 = Script()
    s2.others, s2.times = 1.0, {1: 8.0, 2: 10.0}
    ctl2 = make(s2)
    s2.run(ctl2, 2, key=(True, 2048, 0))
    assert ctl2.current == 2 and ctl2.probe is not None


def test_light_competitor_keeps_threads_when_they_stay_faster() -> None:
    s = Script()
    ctl = make(s)
    s.run(ctl, 20)
    s.others, s.times = 0.6, {1: 0.024, 2: 0.014}
    s.run(ctl, 400)
    assert ctl.current == 2 and ctl.switches == []
    assert 1 in s.sets and s.sets[-1] == 2  # it probed, and went back


def test_slow_steps_trigger_a_probe_without_proc_stat() -> None:
    s = Script()
    ctl = AdaptiveThreads(2, set_threads=s.sets.append, clock=s.clock, read_use=lambda: None)
    s.run(ctl, 20)
    s.times = {1: 0.024, 2: 0.060}
    s.run(ctl, 20)
    assert ctl.current == 1 and "recent median" in ctl.switches[-1][3]


def test_probe_samples_other_shapes_do_not_count() -> None:
    s = Script()
    ctl = make(s)
    s.run(ctl, 10)
    s.others, s.times = 1.0, {1: 0.024, 2: 0.050}
    for _ in range(20):  # until the contention starts a probe
        s.run(ctl, 1)
        if ctl.probe is not None:
            break
    assert ctl.probe is not None and ctl.probe.threads == 1
    s.run(ctl, 20, key=(True, 128))  # prefill steps during the probe: it gives up, no switch
    assert ctl.probe is None and ctl.current == 2


def test_max_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AdaptiveThreads(0)


@pytest.mark.needs_f32_kernels
def test_bind_pins_the_calling_threads_team() -> None:
    import os

    from ingot.model_executor.layers.cpu_kernels import bind_openmp_team
    from ingot.platforms.cpu_threads import _bind_current_team

    before = os.sched_getaffinity(0)
    cpu = max(before)
    try:
        assert _bind_current_team((cpu,), bind_openmp_team)
        assert os.sched_getaffinity(0) == {cpu}
    finally:
        os.sched_setaffinity(0, before)


def test_cli_flags_reach_engine_args() -> None:
    from ingot.cli.main import build_parser
    from ingot.engine.arg_utils import engine_args_from

    ns = build_parser().parse_args(["bench", "single", "--contend", "2", "--cpu-threads", "1",
                                    "--cpu-threads-bind", "0", "--no-cpu-adaptive-threads"])
    args = engine_args_from(ns)
    assert ns.contend == 2
    assert (args.cpu_threads, args.cpu_threads_bind, args.cpu_adaptive_threads) == (1, "0", False)


def test_bad_thread_settings_fail_at_config_time(tiny_llama_dir: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from ingot.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--cpu-threads"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu", cpu_threads=0).create_engine_config()
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='lots' is not a positive integer"):
        EngineArgs(model=str(tiny_llama_dir), device="cpu").create_engine_config()
    monkeypatch.delenv("OMP_NUM_THREADS")
    config = EngineArgs(model=str(tiny_llama_dir), device="cpu", cpu_threads=1,
                        cpu_adaptive_threads=False).create_engine_config()
    assert (config.cpu_threads.threads, config.cpu_threads.adaptive) == (1, False)


def _set_threads(worker: object, n: int) -> None:
    import torch

    torch.set_num_threads(n)


def _get_threads(worker: object) -> int:
    import torch

    return torch.get_num_threads()


def test_worker_applies_and_logs_the_plan(tiny_llama_dir: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    import torch

    from ingot import LLM, SamplingParams

    before = torch.get_num_threads()
    try:
        with caplog.at_level(logging.INFO, logger="ingot"):
            llm = LLM(str(tiny_llama_dir), device="cpu", cpu_threads=1,
                      cpu_adaptive_threads=False, max_model_len=64, max_num_seqs=2)
        assert "CPU compute threads: 1 (--cpu-threads), unbound;" in caplog.text
        worker = llm.llm_engine.engine_core.executor.worker
        assert worker.cpu_threads.current == 1 and worker.cpu_threads.controller is None
        # Model ops run on the worker's compute thread: change its count there, as if a new
        # thread stepped, and the next step re-applies the plan.
        engine = llm.llm_engine
        engine.collective_rpc(_set_threads, (2,))
        assert engine.collective_rpc(_get_threads) == [2]
        worker.cpu_threads._thread = None
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2))
        assert engine.collective_rpc(_get_threads) == [1]
    finally:
        torch.set_num_threads(before)


def test_hopeless_probe_ends_after_one_step() -> None:
    s = Script()
    ctl = AdaptiveThreads(2, set_threads=s.sets.append, clock=s.clock, read_use=lambda: None)
    s.run(ctl, 20)
    s.times = {1: 0.024, 2: 0.060}
    s.run(ctl, 20)
    assert ctl.current == 1
    for _ in range(200):  # until the periodic upward retry starts
        s.run(ctl, 1)
        if ctl.probe is not None:
            break
    assert ctl.probe is not None and ctl.probe.threads == 2
    s.run(ctl, 1)  # 60 ms against 24: settled after this one step, not probe_steps
    assert ctl.probe is None and ctl.current == 1 and s.sets[-2:] == [2, 1]


def test_per_rank_bind_lists_vllm_form() -> None:
    from ingot.platforms.cpu_threads import rank_bind_lists

    assert rank_bind_lists("0-1|2-3", 2, "X") == ["0-1", "2-3"]
    assert rank_bind_lists(" 0 | nobind ", 2, "X") == ["0", "nobind"]
    with pytest.raises(ValueError, match="X='0-1' has 1 parts for 2 ranks"):
        rank_bind_lists("0-1", 2, "X")
    with pytest.raises(ValueError, match="CPU 1 is in the lists of ranks 0 and 1"):
        rank_bind_lists("0-1|1-2", 2, "VLLM_CPU_OMP_THREADS_BIND")
    with pytest.raises(ValueError, match="is not a CPU list"):
        rank_bind_lists("0|a", 2, "X")


def test_prefill_steps_run_at_the_plans_threads_while_decode_adapts() -> None:
    """oneDNN's GEMMs (prefill) give other bits at another thread count: a lowered controller
    still runs prefill at the plan's count (then returns to its own); decode keeps its count.
    Twin: without the rule, the prefill step would have run at the lowered count."""
    import torch

    from ingot.platforms.cpu_threads import CpuThreads

    class SO:
        def __init__(self, prefill: bool) -> None:
            self.is_prefill, self.is_empty = prefill, False
            self.total_num_scheduled_tokens, self.num_padded = 8, 8

    plan = plan_threads(TWO, {"OMP_NUM_THREADS": "2"})
    controller = AdaptiveThreads(2, (0, 1), set_threads=torch.set_num_threads)
    controller.current = 1  # lowered while another process used the CPUs
    threads = CpuThreads(plan, controller)
    before = torch.get_num_threads()
    try:
        threads.ensure_thread()
        seen = []
        threads.execute(lambda so: seen.append(torch.get_num_threads()), SO(True))
        after_prefill = torch.get_num_threads()
        threads.execute(lambda so: seen.append(torch.get_num_threads()), SO(False))
        assert seen == [2, 1] and after_prefill == 1
    finally:
        torch.set_num_threads(before)
