"""bench/compare.py's parsing and report writing, bench/membw.py's bound arithmetic, and
bench/peer_sweep.py's prompts (no model, no peer)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from ingot.benchmarks import workloads

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


compare = _load("compare")
membw = _load("membw")
peer_sweep = _load("peer_sweep")


def _run(setting: str, workload: str, *lines: str):
    return compare.Run(setting, workload, "cmd", compare.parse_results("\n".join(lines)))


def _line(engine: str, workload: str, n: int, time_s: float, out_tok_s: float,
          total_tok_s: float) -> str:
    return (f"RESULT workload={workload} engine={engine} requests={n} input_len=128 "
            f"output_len=128 time_s={time_s} output_tok_s={out_tok_s} total_tok_s={total_tok_s}")


def _figures() -> dict:
    runs = [
        _run("ingot", "offline", "RESULT workload=startup engine=ingot time_s=8.0",
             _line("ingot", "offline", 64, 20.0, 409.6, 819.2)),
        _run("vllm:default", "offline", "RESULT workload=startup engine=vllm time_s=40.0",
             _line("vllm", "offline", 64, 40.0, 204.8, 409.6)),
        _run("vllm:2", "offline", "RESULT workload=startup engine=vllm time_s=30.0",
             _line("vllm", "offline", 64, 32.0, 256.0, 512.0)),
        _run("ingot", "single", "INFO noise", "RESULT workload=startup engine=ingot time_s=2.0",
             _line("ingot", "single", 1, 5.0, 25.6, 51.2)),
        _run("vllm:default", "single", "RESULT workload=startup engine=vllm time_s=20.0",
             _line("vllm", "single", 1, 8.0, 16.0, 32.0)),
        _run("vllm:2", "single", "RESULT workload=startup engine=vllm time_s=22.0",
             _line("vllm", "single", 1, 10.0, 12.8, 25.6)),
        _run("ingot", "prefill", _line("ingot", "prefill", 1, 0.6, 1.7, 1708.3)),
        _run("vllm:default", "prefill", _line("vllm", "prefill", 1, 0.5, 2.0, 2050.0)),
        _run("ingot", "sweep", *[_line("ingot", "sweep", b, 1.0, 10.0 * b, 30.0 * b)
                                 for b in (1, 4, 16, 64)]),
        _run("vllm:2", "sweep", *[_line("vllm", "sweep", b, 1.0, 5.0 * b, 15.0 * b)
                                  for b in (1, 4, 16, 64)]),
    ]
    return {s: compare.summarize_setting([r for r in runs if r.setting == s])
            for s in ("ingot", "vllm:default", "vllm:2")}


def test_parse_result_line():
    r = compare.parse_result_line("RESULT workload=single engine=vllm requests=1 time_s=2.5")
    assert r == {"workload": "single", "engine": "vllm", "requests": 1.0, "time_s": 2.5}
    assert compare.parse_result_line("INFO RESULT workload=x") is None


def test_summaries_and_best_peer_setting():
    f = _figures()
    assert f["ingot"]["offline"] == 819.2  # offline compares total tok/s
    assert f["ingot"]["single"] == 25.6  # single compares output tok/s
    assert f["ingot"]["startup_first"] == 8.0 and f["ingot"]["startup"] == 2.0  # warm: later ones
    assert f["ingot"]["sweep"] == {1: 10.0, 4: 40.0, 16: 160.0, 64: 640.0}
    # Higher is better for rates, lower for times; the winning setting is named.
    assert compare.best_peer(f, "offline") == (512.0, "vllm:2")
    assert compare.best_peer(f, "single") == (16.0, "vllm:default")
    assert compare.best_peer(f, "prefill") == (0.5, "vllm:default")
    assert compare.advantage(0.6, 0.5, higher_is_better=False) == pytest.approx(0.5 / 0.6)


def test_render_section_table_targets_and_bound():
    membw_fig = {"read_gb_s": 10.0, "copy_gb_s": 9.0, "threads": 2.0, "buffer_gib": 2.0,
                 "weight_bytes": 269030016.0, "bound_tok_s": 37.2}
    machine = compare.machine_info(
        "processor\t: 0\nmodel name\t: Test CPU\nflags\t\t: fpu avx512f avx512_bf16 amx_bf16\n"
        "processor\t: 1\n", "MemTotal:       24576000 kB\n")
    assert machine["cores"] == 2 and machine["flags"] == ["avx512f", "avx512_bf16", "amx_bf16"]
    text = compare.render_section(_figures(), machine, ["make compare"], membw_fig, "2026-01-01")
    assert text.startswith(compare.START) and text.rstrip().endswith(compare.END)
    # offline 819.2 / 512.0 = 1.60x >= 1.5x; single 25.6 / 16 = 1.60x; prefill 0.5/0.6 = 0.83x.
    assert re.search(r"\| offline .*\| 819\.2 \| 512\.0 \(vLLM, OMP_NUM_THREADS=2\) \| 1\.60x "
                     r"\| >= 1\.5x \| yes \|", text)
    assert re.search(r"\| single .*\| 16\.0 \(vLLM, default threads\) \| 1\.60x \| >= 1\.2x \| yes",
                     text)
    assert re.search(r"\| prefill .*\| 0\.600 \| 0\.500 .*\| 0\.83x \| >= 1x \| no \|", text)
    # startup: ingot warm 2.0 s vs the peer's best warm 20.0 s -> 10x.
    assert re.search(r"\| startup .*\| 2\.00 \| 20\.00 .*\| 10\.00x \| >= 5x \| yes \|", text)
    assert "| 64 | 640.0 | n/a | 320.0 | 2.00x |" in text
    assert "ingot: single-stream 25.6 tok/s = 69% of the bound (target >= 60%: met)" in text
    assert "Test CPU, 2 cores" in text and "avx512_bf16" in text
    assert "```bash\nmake compare\n```" in text


def test_splice_section_keeps_other_sections():
    doc = "# Performance\n\n## A\nkeep\n"
    first = compare.splice_section(doc, f"{compare.START}\nold\n{compare.END}\n")
    assert first.startswith(doc.rstrip("\n")) and "old" in first
    again = compare.splice_section(first + "\n## B\nalso kept\n",
                                   f"{compare.START}\nnew\n{compare.END}\n")
    assert "old" not in again and "new" in again
    assert "## A\nkeep" in again and "## B\nalso kept" in again
    assert again.count(compare.START) == 1


def test_dry_run_writes_report_and_plot(tmp_path):
    out = tmp_path / "PERF.md"
    rc = compare.main(["--dry-run", "--workloads", "single,sweep", "--log-dir", str(tmp_path),
                       "--output", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "DRY RUN" in text and "| single (1 x 128 -> 128) |" in text
    assert (tmp_path / "throughput_vs_batch.png").stat().st_size > 1000
    # The saved results rewrite the same report, with an added note, without running anything.
    again = tmp_path / "again" / "PERF.md"
    again.parent.mkdir()
    assert compare.main(["--from-json", str(tmp_path / "results.json"), "--output", str(again),
                         "--note", "rewritten"]) == 0
    rewritten = again.read_text()
    assert "Note: rewritten" in rewritten
    assert rewritten.replace("\nNote: rewritten\n", "") == text


def test_decode_weight_bytes():
    # Tied (no lm_head tensor): every parameter once, the embedding read as the lm_head.
    tied = {"token_embd.weight": 1000 * 64, "blk.0.ffn_up.weight": 64 * 128, "norm": 64}
    assert membw.decode_weight_bytes(tied, hidden_size=64) == 2 * (64000 + 8192 + 64)
    # Untied: the whole lm_head plus one embedding row.
    untied = {**tied, "output.weight": 1000 * 64}
    assert membw.decode_weight_bytes(untied, hidden_size=64) == 2 * (64000 + 8192 + 64 + 64)
    assert membw.bound_tok_s(269_000_000, 10.0) == pytest.approx(37.17, rel=1e-3)


def test_peer_sweep_matches_ingot():
    assert peer_sweep.SWEEP_BATCH_SIZES == workloads.SWEEP_BATCH_SIZES
    assert peer_sweep.SWEEP_INPUT_LEN == workloads.SWEEP_INPUT_LEN
    assert peer_sweep.SWEEP_OUTPUT_LEN == workloads.SWEEP_OUTPUT_LEN
    assert peer_sweep.prompts_for(4, 128) == workloads.prompts_for(4, 128)


def test_parse_batch_sizes():
    assert workloads.parse_batch_sizes("1,4, 16,64") == [1, 4, 16, 64]
    with pytest.raises(ValueError):
        workloads.parse_batch_sizes("1,x")
    with pytest.raises(ValueError):
        workloads.parse_batch_sizes("0")


def test_contended_section_has_its_own_markers_and_targets():
    machine = {"cpu": "Test CPU", "cores": 2, "flags": [], "mem_gib": 1.0}
    text = compare.render_section(_figures(), machine, ["x"], None, "2026-01-01", None,
                                  condition=compare.Condition(contend=1))
    assert text.startswith(compare.CONTEND_START) and text.rstrip().endswith(compare.CONTEND_END)
    assert "1 competing CPU-bound process" in text
    # the contention targets: single 1.60x against >= 1.5x, offline 1.60x against >= 1.3x
    assert re.search(r"\| single .*\| 1\.60x \| >= 1\.5x \| yes", text)
    assert re.search(r"\| offline .*\| 1\.60x \| >= 1\.3x \| yes", text)
    quiet = compare.splice_section("# P\n", f"{compare.START}\nquiet\n{compare.END}\n")
    both = compare.splice_section(quiet, text)
    again = compare.splice_section(both, text.replace("Test CPU", "Other CPU"))
    assert "quiet" in again and again.count(compare.CONTEND_START) == 1
    assert "Other CPU" in again and "Test CPU" not in again


def test_contended_runner_wraps_each_process(tmp_path, monkeypatch):
    import contextlib

    from ingot.benchmarks import contend

    events = []

    @contextlib.contextmanager
    def fake_contention(n):
        events.append(("start", n))
        yield []
        events.append(("stop", n))

    def runner(cmd, env, log):
        events.append(("run", cmd[0]))
        return 0, ""

    monkeypatch.setattr(contend, "contention", fake_contention)
    assert compare.contended(runner, 0) is runner
    compare.contended(runner, 2)(["a"], {}, tmp_path / "log")
    assert events == [("start", 2), ("run", "a"), ("stop", 2)]


def test_cpu_limit_section_has_its_own_markers_and_only_the_single_target():
    machine = {"cpu": "Test CPU", "cores": 2, "flags": [], "mem_gib": 1.0}
    cond = compare.Condition(cpu_limit="taskset:0")
    text = compare.render_section(_figures(), machine, ["x"], None, "2026-01-01", None,
                                  condition=cond)
    assert text.startswith("<!-- compare-limit-taskset:start -->")
    assert text.rstrip().endswith("<!-- compare-limit-taskset:end -->")
    assert "inside `taskset -c 0`" in text
    assert re.search(r"\| single .*\| 1\.60x \| >= 1\.3x \| yes", text)
    assert re.search(r"\| offline .*\| 1\.60x \| none \| n/a", text)
    cgroup = compare.render_section(_figures(), machine, ["x"], None, "2026-01-01", None,
                                    condition=compare.Condition(cpu_limit="cgroup:1"))
    doc = compare.splice_section(compare.splice_section("# P\n", text), cgroup)
    doc = compare.splice_section(doc, text.replace("Test CPU", "Other CPU"))
    assert doc.count("compare-limit-taskset:start") == 1
    assert doc.count("compare-limit-cgroup:start") == 1 and "Other CPU" in doc
    with pytest.raises(ValueError, match="marker"):
        compare.splice_section(doc, "## no marker\n")
    with pytest.raises(ValueError, match="use one"):
        compare.Condition(contend=1, cpu_limit="taskset:0")


def test_parse_cpu_limit_forms_and_errors():
    from ingot.benchmarks.cpu_limit import CpuLimit, parse_cpu_limit

    assert parse_cpu_limit("taskset:0") == CpuLimit("taskset", cpus="0")
    assert parse_cpu_limit("taskset:0-1,3").cpus == "0-1,3"
    assert parse_cpu_limit("cgroup:1.5") == CpuLimit("cgroup", quota=1.5)
    for bad, msg in [("taskset", "taskset:CPU-LIST"), ("taskset:a", "not a CPU list"),
                     ("cgroup:x", "not a number"), ("cgroup:0", "between"),
                     ("docker:1", "unknown kind")]:
        with pytest.raises(ValueError, match=msg):
            parse_cpu_limit(bad)


def test_cgroup_limit_writes_the_quota_and_removes_the_group(tmp_path):
    from ingot.benchmarks.cpu_limit import CpuLimit, cpu_limited

    (tmp_path / "cpu").mkdir()  # a cgroup v1 tree: the cpu controller's directory
    with cpu_limited(CpuLimit("cgroup", quota=1.0), root=str(tmp_path)) as prefix:
        (group,) = (tmp_path / "cpu").iterdir()
        assert (group / "cpu.cfs_quota_us").read_text() == "100000"
        assert (group / "cpu.cfs_period_us").read_text() == "100000"
        assert prefix[:2] == ["sh", "-c"] and str(group / "cgroup.procs") in prefix[2]
        for f in group.iterdir():  # (a real cgroup's files vanish with it)
            f.unlink()
    assert list((tmp_path / "cpu").iterdir()) == []
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cgroup.controllers").write_text("cpu\n")
    with cpu_limited(CpuLimit("cgroup", quota=0.5), root=str(v2)):
        (group,) = [p for p in v2.iterdir() if p.is_dir()]
        assert (group / "cpu.max").read_text() == "50000 100000"


def test_limited_runner_prefixes_each_process(tmp_path):
    seen = []

    def runner(cmd, env, log):
        seen.append(cmd)
        return 0, ""

    assert compare.limited(runner, None) is runner
    compare.limited(runner, "taskset:0")(["a", "b"], {}, tmp_path / "log")
    assert seen == [["taskset", "-c", "0", "a", "b"]]
